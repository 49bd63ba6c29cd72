"""The CLI's error surface: one `error:` line saying what to do, strict JSON, and a full disk handled for real."""

import contextlib
import errno
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CkptError, DiskFullError, ReadOnlyRepoError, explain
from ckptstore.repo import fsck
from tests.conftest import assert_same, ckpt_env, ckpt_here


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every strict parser does."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def run(cwd, *args, fsize: int | None = None):
    """`ckpt ARGS` in a subprocess; `fsize` caps the size of any file it writes (RLIMIT_FSIZE)."""
    env = ckpt_env()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit if fsize else None)


def one_error_line(result, *words):
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_json_outputs_are_strict_json_with_nan_and_inf_metrics(tmp_path):
    assert run(tmp_path, "init").returncode == 0
    torch.save({"w": torch.arange(6.0)}, tmp_path / "c.pt")
    assert run(tmp_path, "commit", "c.pt", "--metric", "loss=nan", "--metric", "gain=inf").returncode == 0
    torch.save({"w": torch.arange(6.0) * 2}, tmp_path / "c.pt")
    assert run(tmp_path, "commit", "c.pt", "--metric", "loss=-inf").returncode == 0
    log = strict_json(run(tmp_path, "log", "--json").stdout)
    assert log[0]["metrics"] == {"loss": None} and log[1]["metrics"] == {"gain": None, "loss": None}
    for args in (["show", "--json"], ["stats", "--json"], ["diff", "HEAD~1", "HEAD", "--json"]):
        strict_json(run(tmp_path, *args).stdout)
    assert "loss=nan" in run(tmp_path, "log", "HEAD~1").stdout or "loss=nan" in run(tmp_path, "log").stdout


def test_usage_errors_and_unknown_failures_are_one_line(tmp_path):
    one_error_line(run(tmp_path, "log", "--bogus"), "--bogus", "--help")
    one_error_line(run(tmp_path, "frobnicate"), "frobnicate")
    assert run(tmp_path, "init").returncode == 0
    one_error_line(run(tmp_path, "commit", "missing.pt"), "missing.pt")


def test_a_newer_schema_is_refused_in_one_line_saying_what_to_do(tmp_path):
    assert run(tmp_path, "init").returncode == 0
    with contextlib.closing(sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")
    one_error_line(run(tmp_path, "log"), "newer ckptstore", "upgrade ckptstore")


def test_debug_shows_the_traceback(tmp_path):
    result = run(tmp_path, "--debug", "log")
    assert result.returncode == 1 and "Traceback" in result.stderr and "error: " in result.stderr


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` at `where` (root only); yields False where it cannot be mounted."""
    where.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                    str(where)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=True)


def fill(path: Path) -> None:
    """Write to `path` until its file system refuses (tmpfs: ENOSPC)."""
    with open(path, "wb", buffering=0) as handle:
        for block in (1 << 16, 512, 1):
            with contextlib.suppress(OSError):
                while handle.write(b"\xff" * block):
                    pass


def checkpoint(path: Path, numel: int, seed: int) -> dict:
    state = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(seed)), "step": seed}
    torch.save(state, path)
    return state


def assert_intact(root: Path, states: dict) -> None:
    with Repository.open(root) as repo:
        assert fsck(repo, full=True).ok
        for ref, state in states.items():
            back = repo.checkout(ref)
            assert back["step"] == state["step"] and back["w"].view(torch.int32).equal(state["w"].view(torch.int32))


def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path):
    """Commit onto a full disk (objects, then the database), and checkout -o onto one."""
    with small_disk(tmp_path / "disk", "3m") as mounted:
        repo = tmp_path / "disk" / "repo"
        repo.mkdir()
        states = {"main~1": checkpoint(tmp_path / "a.pt", 20_000, 1), "main": checkpoint(tmp_path / "b.pt", 20_000, 2)}
        with Repository.init(repo) as store:
            store.commit(tmp_path / "a.pt")
            store.commit(tmp_path / "b.pt")
        big = tmp_path / "big.pt"
        checkpoint(big, 1_000_000, 3)  # 4 MB of random floats: more than the disk holds
        cap = None if mounted else 1 << 20  # without a tmpfs: files may not grow past 1 MiB
        full = "disk is full" if mounted else "file-size limit"
        one_error_line(run(repo, "commit", str(big), fsize=cap), full, "nothing was lost")
        assert_intact(repo, states)
        if mounted:  # the database's own write hits the full disk: SQLite's "database or disk is full"
            fill(tmp_path / "disk" / "filler")
            one_error_line(run(repo, "tag", "t1"), "disk is full", "nothing was lost")
            one_error_line(run(repo, "checkout", "main", "-o", str(tmp_path / "disk" / "out.pt")),
                           f"the disk holding {tmp_path / 'disk'} is full", "what was there is unchanged")
            # reading needs no room: log and a restore onto another disk work (SQLite read as immutable)
            assert run(repo, "log").returncode == 0
            restored = run(repo, "checkout", "main~1", "-o", str(tmp_path / "out.pt"))
            assert restored.returncode == 0, restored.stderr
            assert_same(states["main~1"], torch.load(tmp_path / "out.pt", weights_only=True))
            with Repository.open(repo) as held:  # opened while full: read-only for as long as it lasts
                assert held.read_only
                (tmp_path / "disk" / "filler").unlink()
                held.commit({"w": torch.ones(3)}, branch="later")  # room again: it writes
                assert not held.read_only and len(held.log("later")) == 3
        else:
            one_error_line(run(repo, "checkout", "main", "-o", str(tmp_path / "out.pt"), fsize=40_000),
                           "file-size limit", "nothing was lost")
        assert_intact(repo, states)


def test_a_file_size_limit_below_the_database_is_said_as_such_not_as_a_failing_disk(tmp_path):
    """SQLite says "disk I/O error" of a write `ulimit -f` refused: it was sent to fsck as possible damage
    (auditor helper 302); a database or -wal at the limit is the file-size limit's one line."""
    states = {"main": checkpoint(tmp_path / "a.pt", 1000, 1)}
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit(tmp_path / "a.pt")
    checkpoint(tmp_path / "b.pt", 1000, 2)
    database = tmp_path / "repo" / ".ckpt" / "ckpt.db"
    assert database.stat().st_size > 1024
    failed = run(tmp_path / "repo", "commit", str(tmp_path / "b.pt"), fsize=1024)  # `ulimit -f 1`
    one_error_line(failed, "largest size allowed here", "`ulimit -f`", str(database), "nothing was lost")
    assert failed.returncode == 1 and "could not be read or written" not in failed.stderr
    assert_intact(tmp_path / "repo", states)


def test_commits_that_run_out_of_disk_at_any_point_lose_nothing(tmp_path):
    """With the disk filled to leave a little less room each time, a commit either completes or fails
    in one disk-full line; either way every earlier commit reads back bit for bit."""
    long = os.environ.get("CKPT_HYPOTHESIS_PROFILE") == "long"
    with small_disk(tmp_path / "disk", "4m") as mounted:
        if not mounted:  # RLIMIT_FSIZE cannot leave "a little room"; the test above covers that case
            return
        repo = tmp_path / "disk" / "repo"
        states = {"main": checkpoint(tmp_path / "a.pt", 20_000, 1)}
        with Repository.init(repo) as store:
            store.commit(tmp_path / "a.pt")
        outcomes = set()
        for n, room in enumerate(range(0, 400_000, 20_000 if long else 100_000)):
            filler = tmp_path / "disk" / "filler"
            fill(filler)
            os.truncate(filler, max(filler.stat().st_size - room, 0))  # frees `room` bytes
            checkpoint(tmp_path / "next.pt", 40_000, 10 + n)
            result = run(repo, "commit", str(tmp_path / "next.pt"), "--step", str(n))
            if result.returncode == 0:
                outcomes.add("committed")
                states = {f"{ref}~1" if ref.startswith("main") else ref: s for ref, s in states.items()}
                states["main"] = torch.load(tmp_path / "next.pt", weights_only=True)
            else:
                outcomes.add("disk full")
                one_error_line(result, "disk is full", "nothing was lost")
            filler.unlink()
            assert_intact(repo, states)
        assert outcomes == {"disk full", "committed"}, outcomes



def test_os_failures_below_ckptstore_are_explained():
    """The classification main() prints: the cause is found through wrapping exceptions too."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/data/x")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from inner
    except RuntimeError as exc:
        assert isinstance(explain(exc), DiskFullError) and "/data/x" in str(explain(exc))
    denied = explain(PermissionError(errno.EACCES, "Permission denied", "/shared/.ckpt/lock"))
    assert isinstance(denied, CkptError) and "permission denied on /shared/.ckpt/lock" in str(denied)
    assert "--read-only" in str(denied)  # the repository's own file: reading commands still work
    beside = explain(PermissionError(errno.EACCES, "Permission denied", "/data/out/.c.pt.new-89768e.ckpt-tmp"))
    assert str(beside) == "permission denied writing into /data/out; ask for access to it or write elsewhere"
    moved = explain(PermissionError(errno.EACCES, "Permission denied", "/r/.ckpt/tmp/ab12", None,
                                    "/r/.ckpt/objects/b3/x"))
    assert str(moved) == ("permission denied moving /r/.ckpt/tmp/ab12 into /r/.ckpt/objects/b3; ask for write access "
                          "to that folder")  # the folder it went into, not the temporary file (auditor)
    sticky = explain(PermissionError(errno.EPERM, "Operation not permitted", "/tmp/.x.1.ckpt-tmp", None, "/tmp/x.pt"))
    assert str(sticky) == ("permission denied replacing /tmp/x.pt: another user's file in a folder that lets only its "
                           "owner replace or remove it; ask them to remove it, or write elsewhere")  # (readers)
    own = explain(PermissionError(errno.EACCES, "Permission denied", "/shared/.ckpt/.config.toml.a1.ckpt-tmp"))
    assert "writing into /shared/.ckpt" in str(own) and "--read-only" in str(own)
    try:
        "\udcff.pt".encode()  # a file name with a byte that is not UTF-8, as Python's os functions give it
    except UnicodeEncodeError as exc:
        assert str(explain(exc)).startswith("'\\xff.pt' holds bytes that are not UTF-8")  # as names print (auditor)
    assert isinstance(explain(OSError(errno.EROFS, "Read-only file system")), ReadOnlyRepoError)
    assert "a folder where a file was expected" in str(explain(IsADirectoryError(errno.EISDIR, "x", "/r/.ckpt/lock")))
    assert explain(ValueError("something else")) is None
    too_large = explain(OSError(errno.EFBIG, "File too large", "/data/x"))  # `ulimit -f`, or FAT32's 4 GiB
    assert "disk is full" not in str(too_large) and "`ulimit -f`" in str(too_large) and "nothing was lost" in str(
        too_large)
    assert "`ulimit -n 65536`" in str(explain(OSError(errno.EMFILE, "Too many open files")))
    assert "out of memory (Unable to allocate 1.00 TiB" in str(explain(MemoryError("Unable to allocate 1.00 TiB")))
    assert "out of memory (no more could be allocated)" in str(explain(MemoryError()))


def test_init_takes_a_max_chain_count_or_auto_and_refuses_anything_else(tmp_path):
    bad = run(tmp_path, "init", "bad", "--max-chain", "often")
    assert bad.returncode == 2 and bad.stderr.count("error:") == 1 and "max_chain" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad" / ".ckpt").exists()
    assert run(tmp_path, "init", "capped", "--max-chain", "3").returncode == 0
    assert run(tmp_path, "init", "auto").returncode == 0
    with Repository.open(tmp_path / "capped") as capped, Repository.open(tmp_path / "auto") as auto:
        assert capped.config.encoding.max_chain == 3 and auto.config.encoding.max_chain == "auto"


def test_a_wrong_option_value_exits_2_as_its_siblings_do(tmp_path):
    """`init --max-chain -1`, `commit --max-loss-change 0.1`, `--knob foo=1`, `--branch ''` and `checkout --only ''`
    exited 1 where `--lossy bogus`, `--metric x` and `-o ''` exit 2, as the reference says (auditor helper 279)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    for args, said in ((["init", "x", "--max-chain", "-1"], "'--max-chain': max_chain must be 'auto' or a count"),
                       (["commit", "c.pt", "--max-loss-change", "0.1"], "--max-loss-change: '0.1': write it as a "),
                       (["commit", "c.pt", "--max-loss-change", "-1%"], "--max-loss-change: '-1%': must be"),
                       (["commit", "c.pt", "--knob", "foo=1"], "--knob: unknown lossy knob 'foo'"),
                       (["commit", "c.pt", "--lossy", "balanced", "--knob", "prun=1"], "--knob: unknown lossy knob"),
                       (["commit", "c.pt", "--lossy", "balanced", "--knob", "prune=2"],  # a value (helper 293)
                        "--knob: lossy knob prune=2: expected a number in [0, 1]"),
                       (["commit", "c.pt", "--branch", ""], "'--branch': is empty (a variable not set?)"),
                       (["watch", ".", "--once", "--branch", ""], "'--branch': is empty (a variable not set?)"),
                       (["checkout", "HEAD", "-o", "o.pt", "--only", ""], "'--only': is empty (a variable not set?)")):
        out = ckpt_here(tmp_path, *args)
        assert out.returncode == 2 and out.stderr.startswith(f"error: Invalid value for {said}"), (args, out.stderr)
    assert not (tmp_path / "x").exists() and not (tmp_path / "o.pt").exists()
    assert ckpt_here(tmp_path, "log").stdout.count("commit ") == 1  # none of them committed
    out = ckpt_here(tmp_path, "checkout", "HEAD", "--only", "w")  # a wrong pairing too (CLI fuzz helper 323)
    assert out.returncode == 2 and "--only writes part of a commit, so it needs -o PATH" in out.stderr, out.stderr


def test_init_makes_the_repository_that_repo_or_ckpt_repo_names_and_a_path_given_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPT_REPO", raising=False)
    assert CliRunner().invoke(cli, ["--repo", "by-option", "init"]).exit_code == 0
    assert CliRunner().invoke(cli, ["init"], env={"CKPT_REPO": str(tmp_path / "by-env")}).exit_code == 0
    assert CliRunner().invoke(cli, ["--repo", "by-option", "init", "by-path"]).exit_code == 0
    made = sorted(p.parent.name for p in tmp_path.rglob(".ckpt"))
    assert made == ["by-env", "by-option", "by-path"]  # none in the folder the commands were typed in


def test_repo_and_ckpt_repo_name_the_repository_itself_never_one_above_it(tmp_path):
    """A typo in --repo or CKPT_REPO must not send a commit to the repository holding its parent."""
    assert run(tmp_path, "init").returncode == 0
    torch.save({"w": torch.ones(4)}, tmp_path / "a.pt")
    missing = tmp_path / "run7"
    by_option = run(tmp_path, "--repo", str(missing), "commit", "a.pt")
    one_error_line(by_option)
    assert f"--repo {missing} holds no ckptstore repository" in by_option.stderr
    by_env = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "a.pt"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=ckpt_env(CKPT_REPO=str(missing)))
    one_error_line(by_env)
    assert f"CKPT_REPO={missing} holds no ckptstore repository" in by_env.stderr
    as_file = CliRunner().invoke(cli, ["status"], env={"CKPT_REPO": str(tmp_path / "a.pt")})
    assert as_file.exit_code == 1 and "CKPT_REPO=" in str(as_file.exception) and "is a file" in str(as_file.exception)
    the_store = run(tmp_path, "--repo", str(tmp_path / ".ckpt"), "log")  # its advice was `ckpt init …/.ckpt`
    one_error_line(the_store, f"--repo {tmp_path / '.ckpt'} is a repository's own .ckpt/ folder: name the folder "
                   f"that holds it ({tmp_path})")
    too_long = run(tmp_path, "--repo", str(tmp_path / ("x" * 300)), "log")
    one_error_line(too_long)
    assert "is too long for this file system" in too_long.stderr
    with Repository.open(tmp_path) as repo:
        assert repo.log() == []  # nothing landed in the repository above


def test_an_empty_repo_or_ckpt_repo_is_refused_not_taken_for_the_repository_above(tmp_path):
    """`ckpt --repo "$UNSET" prune` pruned the repository above the current folder, `--repo "" init` made one in
    it (auditor helper 279)."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    (tmp_path / "work").mkdir()
    for args, env, named in ((["--repo", "", "log"], {}, "'--repo'"), (["--repo", "", "init"], {}, "'--repo'"),
                             (["log"], {"CKPT_REPO": ""}, "CKPT_REPO")):
        out = ckpt_here(tmp_path / "work", *args, env=env)
        assert out.returncode == 2 and out.stdout == "", (args, out)
        assert out.stderr.startswith(f"error: Invalid value for {named}: is empty (a variable not set?)"), out.stderr
    assert not (tmp_path / "work" / ".ckpt").exists()
    assert ckpt_here(tmp_path / "work", "--repo", "..", "log", env={"CKPT_REPO": ""}).returncode == 0  # typed wins
    # commands that open no repository are not refused an empty CKPT_REPO (review helper 289)
    assert ckpt_here(tmp_path / "work", "log", "--help", env={"CKPT_REPO": ""}).returncode == 0
    assert ckpt_here(tmp_path / "work", "init", "new", env={"CKPT_REPO": ""}).returncode == 0
    assert (tmp_path / "work" / "new" / ".ckpt").is_dir()
    bare = ckpt_here(tmp_path / "work", "init", env={"CKPT_REPO": ""})  # no PATH: CKPT_REPO would name it (helper 291)
    assert bare.returncode == 2 and "CKPT_REPO: is empty" in bare.stderr and not (tmp_path / "work" / ".ckpt").exists()


def test_read_only_init_writes_nothing_and_bare_groups_print_their_help(tmp_path):
    refused = CliRunner().invoke(cli, ["--read-only", "init", str(tmp_path / "r")])
    assert isinstance(refused.exception, ReadOnlyRepoError) and not (tmp_path / "r").exists()
    bare = run(tmp_path, "remote")
    assert bare.returncode == 2 and "error:" not in bare.stderr
    assert "Usage: ckpt remote" in bare.stderr and len(bare.stderr.splitlines()) > 5  # the help as lines, not one


def test_help_and_version_to_a_stdout_that_refuses_them_fail_as_any_output_does(tmp_path):
    """click wrote these itself: a full disk read as the repository's, a reader gone as exit 1."""
    env = ckpt_env()
    for args in (["--version"], ["log", "--help"]):
        with open("/dev/full", "w") as full:
            filled = subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=tmp_path, env=env, stdout=full,
                                    stderr=subprocess.PIPE, text=True, timeout=120)
        assert filled.returncode == 1 and filled.stderr == "error: cannot write the output: No space left on device\n"
        read, write = os.pipe()
        os.close(read)
        with os.fdopen(write, "w") as gone:
            piped = subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=tmp_path, env=env, stdout=gone,
                                   stderr=subprocess.PIPE, text=True, timeout=120)
        assert piped.returncode == 141 and piped.stderr == "", piped.stderr
    assert run(tmp_path, "--version").stdout.startswith("ckpt, version ")


def test_a_command_started_with_stdout_closed_says_it_could_not_write(tmp_path):
    assert run(tmp_path, "init").returncode == 0
    closed = subprocess.run(f"{sys.executable} -m ckptstore log --json >&-", shell=True, cwd=tmp_path, text=True,
                            stderr=subprocess.PIPE, env=ckpt_env(), timeout=120)
    assert closed.returncode == 1 and closed.stderr == "error: cannot write the output: standard output is closed\n"
    version = subprocess.run(f"{sys.executable} -m ckptstore --version >&-", shell=True, cwd=tmp_path, text=True,
                             stderr=subprocess.PIPE, env=ckpt_env(), timeout=120)
    assert version.returncode == 1 and "standard output is closed" in version.stderr


def test_init_where_nothing_can_be_made_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file, not a folder")
    for args, words in ((["init", str(tmp_path / "afile" / "sub")], f"cannot create {tmp_path / 'afile' / 'sub'}"),
                        (["init", "--metadata", f"sqlite:///{tmp_path / 'nope' / 'x.db'}", "fresh"], "does not exist")):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and words in str(result.exception), (args, result.exception)
    assert not (tmp_path / "fresh").exists()  # the folder it had made is gone too


def test_a_tensor_name_that_is_no_valid_text_prints_escaped(tmp_path):
    header = b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'  # JSON's escape of a lone surrogate
    (tmp_path / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x07")
    with Repository.init(tmp_path) as repo:
        repo.commit(tmp_path / "m.safetensors")
    shown = run(tmp_path, "show", "HEAD")
    assert shown.returncode == 0 and "\\ud800" in shown.stdout, shown.stderr


def test_an_older_repository_opened_on_a_full_disk_says_so_and_upgrades_once_there_is_room(tmp_path):
    from ckptstore.metadata.migrate import downgrade

    with small_disk(tmp_path / "disk", "3m") as mounted:
        if not mounted:
            pytest.skip("needs a tmpfs to fill (root)")
        repo = tmp_path / "disk" / "repo"
        with Repository.init(repo) as store:
            store.commit({"w": torch.ones(8)})
        downgrade(f"sqlite:///{repo / '.ckpt' / 'ckpt.db'}", "0007")  # as an older ckptstore left it
        fill(tmp_path / "disk" / "filler")
        one_error_line(run(repo, "log"), "disk is full", "nothing was lost")
        (tmp_path / "disk" / "filler").unlink()
        assert run(repo, "log").returncode == 0


def _as_a_user(*args):
    """`ckpt ARGS` as root without the power to override file modes, as any other user would run it."""
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m", "ckptstore", *args]


def test_a_database_file_that_cannot_be_opened_says_why(tmp_path):
    with Repository.init(tmp_path) as store:
        store.commit({"w": torch.ones(8)})
    database = tmp_path / ".ckpt" / "ckpt.db"
    if os.geteuid() == 0:
        database.chmod(0)
        env = ckpt_env()
        result = subprocess.run(_as_a_user("log"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        one_error_line(result, "cannot be read by this user")
        database.chmod(0o644)
    database.rename(tmp_path / "kept.db")
    database.mkdir()
    one_error_line(run(tmp_path, "log"), "is a folder")


def _output_to(cwd, stdout, *args):
    """`ckpt ARGS` writing its output to `stdout` (a file descriptor or an open file); stderr captured."""
    env = ckpt_env()
    return subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def test_a_reader_that_left_ends_a_command_quietly_as_git_does(tmp_path):
    """`ckpt log | head -1`: exit 141 (128 + SIGPIPE), nothing on stderr (no error, no 'Exception ignored')."""
    with Repository.init(tmp_path) as repo:
        for i in range(2):
            repo.commit({"w": torch.full((8,), float(i))}, message=f"c{i}")
    for args in (["log"], ["log", "--graph"], ["show"], ["diff", "HEAD~1", "HEAD"], ["log", "--json"]):
        reader, writer = os.pipe()
        os.close(reader)  # gone before ckpt writes: every write meets EPIPE
        try:
            result = _output_to(tmp_path, writer, *args)
        finally:
            os.close(writer)
        assert (result.returncode, result.stderr) == (141, ""), (args, result.returncode, result.stderr)


def test_an_output_that_cannot_be_written_is_not_called_the_repository_disk(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(4)})
    with open("/dev/full", "w") as full:
        result = _output_to(tmp_path, full, "log")
    one_error_line(result, "cannot write the output", "No space left on device")
    assert "disk is full" not in result.stderr and "ckpt gc" not in result.stderr


def test_a_recorded_commit_whose_summary_cannot_be_written_says_its_id_on_stderr(tmp_path):
    """A full, closed or abandoned stdout ended a recorded commit with a bare "cannot write the output": read as a
    failed commit, its id lost, and the retry said "nothing changed" (auditor helper 279)."""
    assert run(tmp_path, "init").returncode == 0
    reader, writer = os.pipe()
    os.close(reader)
    for count, (stdout, code, why) in enumerate((("/dev/full", 1, "No space left on device"),
                                                 (">&-", 1, "standard output is closed"),
                                                 (writer, 141, "Broken pipe")), start=1):
        torch.save({"w": torch.full((8,), float(count))}, tmp_path / "c.pt")
        if stdout == ">&-":
            result = subprocess.run(f"{sys.executable} -m ckptstore commit c.pt >&-", shell=True, cwd=tmp_path,
                                    text=True, stderr=subprocess.PIPE, env=ckpt_env(), timeout=120)
        else:
            with open(stdout, "w") if isinstance(stdout, str) else contextlib.nullcontext(stdout) as out:
                result = _output_to(tmp_path, out, "commit", "c.pt")
        with Repository.open(tmp_path) as repo:
            head, commits = repo.head()[1], len(repo.log())
        assert (result.returncode, commits) == (code, count), (stdout, result.stderr)
        assert result.stderr == f"error: commit {head} was recorded; its summary could not be written ({why})\n"
    os.close(writer)


def test_an_output_that_cannot_be_written_names_the_output_not_the_repository(tmp_path):
    """-o on a read-only file system, or in a folder where no file can be made (/dev/fd), is the output's problem."""
    from tests.conftest import ckpt_here

    out = explain(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/.x.pt.1a2b.ckpt-tmp"))
    assert not isinstance(out, ReadOnlyRepoError) and str(out) == "/mnt/ro is on a read-only file system; write " \
        "elsewhere"
    inside = explain(OSError(errno.EROFS, "Read-only file system", "/runs/a/.ckpt/ckpt.db"))
    assert isinstance(inside, ReadOnlyRepoError)  # the repository's own files: as before
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0 and ckpt_here(tmp_path, "commit", "m.pt").returncode == 0
    for args in (["export", "HEAD", "-o", "/dev/fd/1"], ["checkout", "HEAD", "-o", "/dev/fd/1"]):
        said = ckpt_here(tmp_path, *args)
        assert said.returncode == 1 and said.stderr.count("\n") == 1, said.stderr
        # refused before any work since the descriptor's link is not followed (it was: "cannot make a file")
        assert said.stderr.startswith("error: /dev/fd/1 names an open descriptor") and "report" not in said.stderr


@pytest.mark.parametrize("verb", [["gc"], ["prune", "--keep-last", "1"]])
def test_gc_and_prune_say_once_that_they_wait_for_the_repository_lock(tmp_path, verb):
    """A sharded save whose ranks failed keeps its lock until that process saves again: gc waited without a word.
    Then it said so twice: its own line at once, and the lock's 2 s in (auditor helper 354). Now the lock's alone."""
    import threading

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.zeros(3)})
        repo.commit({"w": torch.ones(3)})
        lock = repo.lock()
        lock.__enter__()  # what a commit in flight holds
        threading.Timer(3.0, lock.__exit__, (None, None, None)).start()  # past the 2 s notice
        result = ckpt_here(tmp_path, *verb)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: waiting for the repository lock of {tmp_path / '.ckpt'}: commits in flight hold it (shared), or a "
        "sharded save whose ranks failed, until its process saves again or exits; this command starts once they "
        "finish, and commits started meanwhile wait for it"], result.stderr
    assert result.stdout.startswith("removed ")


def test_paths_no_walk_can_take_are_one_error_line(tmp_path):
    """A dangling .ckpt link at init, a symlink loop given to commit or --repo, and folders nested past Python's
    stack were "unexpected … please report it" (auditor)."""


    (tmp_path / ".ckpt").symlink_to("/nonexistent/store/.ckpt")
    one_error_line(ckpt_here(tmp_path, "init"), f"{tmp_path / '.ckpt'} is a symlink to /nonexistent/store/.ckpt, "
                   "which does not exist", "repoint it")
    (tmp_path / ".ckpt").unlink()
    assert ckpt_here(tmp_path, "init").returncode == 0
    (tmp_path / "loop").symlink_to("loop")
    for args in (["commit", "loop"], ["--repo", "loop", "log"]):
        one_error_line(ckpt_here(tmp_path, *args), f"'{tmp_path / 'loop'}' is a symlink that leads back to itself",
                       "remove or repoint it")
    deep = tmp_path / "ck"
    deep.mkdir()
    (deep / "top.txt").write_text("top")
    here = deep
    try:
        for _ in range(1000):  # not os.makedirs: it recurses as deep
            here = here / "d"
            here.mkdir()
        (here / "f.txt").write_text("deep")
        one_error_line(ckpt_here(tmp_path, "commit", "ck"), "folders nested too deeply", "shallower tree")
    finally:  # bottom up, whatever happened: a recursive removal (pytest's, later) would hit the same stack
        (here / "f.txt").unlink(missing_ok=True)
        while here != deep:
            here.rmdir()
            here = here.parent


def test_memory_refused_in_other_words_is_said_as_out_of_memory():
    """mmap's ENOMEM, a thread that cannot start, a library that cannot be mapped: "unexpected ... please report
    it" under `ulimit -v` (auditor)."""
    for exc in (OSError(errno.ENOMEM, "Cannot allocate memory"), RuntimeError("can't start new thread"),
                ImportError("libtorch_python.so: failed to map segment from shared object"),
                OSError("libgomp.so.1: failed to map segment from shared object")):
        said = explain(exc)
        assert said is not None and str(said).startswith("out of memory, or a limit reached ("), exc
    assert explain(RuntimeError("something else")) is None
    assert "mounted without exec" in str(explain(OSError("x.so: failed to map segment from shared object")))
    assert "mounted without exec" not in str(explain(RuntimeError("can't start new thread")))


def test_a_long_json_output_cut_short_by_its_reader_fails_as_any_output_does(tmp_path):
    """`ckpt show --json | head -c1` exited 0 (and `> small-disk/out.json` left half a document, exit 0): CPython
    drops the rest of one large write the OS takes in part, without an error (text/time auditor)."""
    with Repository.init(tmp_path) as repo:
        repo.commit({f"layer{i}.w": torch.zeros(2) for i in range(3000)})  # about 0.8 MB of JSON
    cut = subprocess.run(f"{sys.executable} -m ckptstore show --json | head -c1 > /dev/null; "
                         'echo "rc=${PIPESTATUS[0]}"', shell=True, executable="/bin/bash", cwd=tmp_path, text=True,
                         capture_output=True, env=ckpt_env(), timeout=120)
    assert cut.stdout == "rc=141\n" and cut.stderr == "", (cut.stdout, cut.stderr)
    whole = run(tmp_path, "show", "--json")
    assert whole.returncode == 0 and len(json.loads(whole.stdout)["tensors"]) == 3000
    # 80 KB in 40,000 characters, the whole output (a piece cut by characters was one write, its end dropped): pieces
    # are cut to what they encode to (reader)
    with Repository.init(tmp_path / "long") as repo:
        repo.commit({"w": torch.ones(2)}, message="\u00e9" * 40_000)
    cut = subprocess.run(f"{sys.executable} -m ckptstore log | (sleep 1; head -c1 > /dev/null); "
                         'echo "rc=${PIPESTATUS[0]}"', shell=True, executable="/bin/bash", cwd=tmp_path / "long",
                         text=True, capture_output=True, env=ckpt_env(PYTHONIOENCODING="utf-8"), timeout=120)
    assert cut.stdout == "rc=141\n" and cut.stderr == "", (cut.stdout, cut.stderr)


def test_a_usage_error_points_at_the_help_of_the_command_that_has_the_option(tmp_path):
    """`ckpt commit --step 1.5` said to see `ckpt --help`, which lists only commands (docs auditor)."""
    for args, hint in ((["commit", "x.pt", "--step", "1.5"], "(see `ckpt commit --help`)"),
                       (["remote", "add"], "(see `ckpt remote add --help`)"), (["nosuch"], "(see `ckpt --help`)"),
                       (["commit", "x.pt", "--lossy"], "(see `ckpt commit --help`)"),  # no context made (reader)
                       (["--repo", "log", "commit", "x.pt", "--lossy"], "(see `ckpt commit --help`)")):
        out = run(tmp_path, *args)
        assert out.returncode == 2 and out.stderr.rstrip().endswith(hint), out.stderr


def test_a_knob_is_a_lossy_knob_given_once_and_nothing_is_committed_otherwise(tmp_path):
    """`--knob blocking=false` committed, then failed with a TypeError's words; `--knob step=5` was an "unexpected
    TypeError"; `--knob buffer_budget=1` was taken without a word; a repeated knob's last value won (reviewer)."""
    torch.save({"w": torch.randn(5000)}, tmp_path / "c.pt")
    assert run(tmp_path, "init").returncode == 0
    for knob, said in (("blocking=false", "unknown lossy knob 'blocking'"), ("step=5", "unknown lossy knob 'step'"),
                       ("buffer_budget=1", "unknown lossy knob 'buffer_budget'")):
        out = run(tmp_path, "commit", "c.pt", "--lossy", "balanced", "--knob", knob)
        assert out.returncode != 0 and said in out.stderr and "unexpected" not in out.stderr, out.stderr
    twice = run(tmp_path, "commit", "c.pt", "--lossy", "balanced", "--knob", "prune=0", "--knob", "prune=0.1")
    assert twice.returncode == 2 and "'prune' is given twice" in twice.stderr, twice.stderr
    assert "commit " not in run(tmp_path, "log").stdout
    assert run(tmp_path, "commit", "c.pt", "--lossy", "balanced", "--knob", "prune=0.1").returncode == 0


def test_every_error_writes_a_names_bytes_that_are_not_utf8_as_the_reference_says(tmp_path):
    """Errors quoting a name with repr() showed \\udcff (a missing file, a tag name, a -m message) where the
    reference says names print \\xff (reader)."""
    assert run(tmp_path, "init").returncode == 0
    env = ckpt_env()
    for args, said in (([b"commit", b"nope\xff.pt"], "nope\\xff.pt does not exist"),
                       ([b"commit", b"run\\udc80.pt"], "run\\udc80.pt does not exist"),  # that text typed: as it is
                       ([b"tag", b"t\xff"], "'t\\xff' is not a valid"),
                       ([b"commit", b"x", b"-m", b"bad \xff msg"], "'bad \\xff msg' holds")):
        out = subprocess.run([sys.executable.encode(), b"-m", b"ckptstore", *args], cwd=tmp_path, env=env,
                             capture_output=True, timeout=120)
        stderr = out.stderr.decode()
        assert out.returncode != 0 and said in stderr and ("udc" not in stderr or b"udc" in args[1]), stderr


def test_a_ref_holding_bytes_not_utf8_is_an_unknown_ref_not_a_file_to_rename(tmp_path):
    """`ckpt show $'v\\xff'` said "rename the file, or pass the text in UTF-8": there is no file, and no ref can
    have that name (auditor helper 279)."""
    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(2)})
    ref = os.fsdecode(b"v\xff")
    for args, detail in ((["show", ref], ""), (["checkout", ref], ""), (["diff", "HEAD", ref], ""),
                         (["log", f"HEAD..{ref}"], ""), (["tag", "t", ref], ""),
                         (["branch", "-d", ref], " (no such branch)")):
        out = ckpt_here(tmp_path, *args)
        assert (out.returncode, out.stderr) == (1, f"error: unknown ref 'v\\xff'{detail}.\n"), (args, out.stderr)


@pytest.mark.parametrize("typed, said", [
    (["switch", "main"], "No such command 'switch': `ckpt checkout BRANCH` switches branch"),
    (["remote", "rename", "a", "b"], "No such command 'rename': `ckpt remote add NEW URL`, then `ckpt remote remove"),
    (["gc", "--dry-run"], "No such option '--dry-run'. (see `ckpt gc --help`)"),
    (["stash"], "No such command 'stash': commit the files on a branch of their own"),
    (["remote", "remov", "x"], "No such command 'remov'. Did you mean 'remove'?"),
    (["gc", "--prun"], "No such option '--prun'. Did you mean '--prune'?"),
])
def test_git_words_get_what_ckpt_offers_and_no_destructive_guess(tmp_path, typed, said):
    """Click's nearest spelling sent `gc --dry-run` to `--prune` (which deletes commits), `remote rename` to
    `remote remove` and `switch` to `watch` (git-habits auditor); a near typo of a destructive word keeps its guess."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    out = ckpt_here(tmp_path, *typed)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {said}"), out.stderr


def test_a_knob_or_a_loss_bound_with_nothing_to_tune_is_a_usage_error_and_commits_nothing(tmp_path):
    """`commit --knob` at a lossless level and `--max-loss-change` without `--calibration` exited 1, as a failure
    does; they are usage errors: exit 2 naming the missing option. A repository whose default level is lossy takes
    `--knob` alone (auditor's CLI gaps, fixer helper 327)."""
    torch.save({"w": torch.randn(5000)}, tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    for args, said in ((["--knob", "prune=0.1"], "--knob tunes a lossy level, and this commit is lossless (the "
                        "repository's default level): give --lossy LEVEL"),
                       (["--lossy", "none", "--knob", "prune=0.1"], "lossless (--lossy none): give --lossy LEVEL"),
                       (["--lossy", "balanced", "--max-loss-change", "0.1%"], "--max-loss-change bounds the loss "
                        "that --calibration measures: give --calibration MODULE:FUNCTION too"),
                       (["--calibration", "no_such_module:f", "--max-loss-change", "0%"],
                        "--max-loss-change tunes a lossy level")):
        out = ckpt_here(tmp_path, "commit", "c.pt", *args)
        assert out.returncode == 2, (args, out.stderr)
        one_error_line(out, said)
    assert "commit " not in ckpt_here(tmp_path, "log").stdout
    assert ckpt_here(tmp_path, "init", "lossy", "--lossy", "balanced").returncode == 0
    out = ckpt_here(tmp_path, "--repo", "lossy", "commit", "c.pt", "--knob", "prune=0.1")
    assert out.returncode == 0 and "lossy:balanced" in out.stdout, out.stderr


def test_metadata_for_a_folder_remote_is_refused_not_recorded_unused(tmp_path):
    """`clone --metadata URL SRC DIR` with SRC a repository folder recorded the URL and never read it (a folder names
    its own database), as `remote add` and `set-url` did: exit 2 saying when --metadata applies, nothing made."""
    assert ckpt_here(tmp_path, "init", "src").returncode == 0
    assert ckpt_here(tmp_path, "init", "work").returncode == 0
    db = f"sqlite:///{tmp_path / 'other.db'}"
    for cwd, args in ((tmp_path, ["clone", "--metadata", db, "src", "dst"]),
                      (tmp_path / "work", ["remote", "add", "hub", "../src", "--metadata", db])):
        out = ckpt_here(cwd, *args)
        assert out.returncode == 2, (args, out.stderr)
        one_error_line(out, "--metadata names the database of a remote whose objects are at a URL (s3://, file://)",
                       "is a repository folder, which names its own: leave --metadata out")
    assert not (tmp_path / "dst").exists() and not (tmp_path / "other.db").exists()
    assert ckpt_here(tmp_path / "work", "remote", "add", "hub", "../src").returncode == 0
    out = ckpt_here(tmp_path / "work", "remote", "set-url", "hub", "../src", "--metadata", db)
    assert out.returncode == 2 and "leave --metadata out" in out.stderr, out.stderr
    with Repository.open(tmp_path / "work") as work:
        assert work.config.remotes["hub"].metadata_url == ""  # not recorded by the refused set-url
    assert ckpt_here(tmp_path, "clone", "src", "dst").returncode == 0  # without --metadata, as ever


def test_a_file_path_given_to_diff_is_said_to_be_a_file_not_a_range(tmp_path):
    """`ckpt diff HEAD ../x.pt` said "'../x.pt' is a range, which names both commits" (auditor helper 368)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "x.pt")
    (tmp_path / "r").mkdir()
    assert ckpt_here(tmp_path / "r", "init").returncode == 0
    assert ckpt_here(tmp_path / "r", "commit", "../x.pt").returncode == 0
    for args in (("HEAD", "../x.pt"), ("../x.pt",)):
        out = ckpt_here(tmp_path / "r", "diff", *args)
        assert out.returncode == 2, out.stderr
        one_error_line(out, "'../x.pt' is a file: `ckpt diff` compares commits; commit it first")
    assert ckpt_here(tmp_path / "r", "diff", "..").returncode == 0  # HEAD..HEAD, though `..` is a folder here
    (tmp_path / "run").mkdir()  # a checkpoint folder, by path: said as one (reviewer helper 378)
    one_error_line(ckpt_here(tmp_path / "r", "diff", "HEAD", "../run"), "'../run' is a folder: `ckpt diff` compares")
    for parent in ("../", "./..", "../.."):  # only dots and slashes, still a folder (reviewer helper 379)
        one_error_line(ckpt_here(tmp_path / "r", "diff", parent), f"{parent!r} is a folder: `ckpt diff` compares")
    for missing in ("../nope.pt", "./nope.pt", "/nope/x.pt", "sub/../gone.pt"):  # not ranges (reviewers 380, 381)
        one_error_line(ckpt_here(tmp_path / "r", "diff", "HEAD", missing), f"{missing!r} is neither a commit")


def test_a_range_and_a_commit_a_device_as_database_and_a_symlink_loop_are_each_said_as_what_they_are(tmp_path):
    """`diff A..B C` said "unknown ref 'A..B'" (exit 1), `init --metadata sqlite:////dev/zero` that the repository's
    database held no schema, `watch LOOP` that the folder did not exist, and a loop inside a checkpoint folder was
    "a symlink to a, which does not exist" (auditor's CLI gaps, fixer helper 327)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    out = ckpt_here(tmp_path, "diff", "HEAD..HEAD", "HEAD")
    assert out.returncode == 2
    one_error_line(out, "'HEAD..HEAD' is a range, which names both commits: give it alone (`ckpt diff A..B`) or two "
                        "commits (`ckpt diff A B`)")
    out = ckpt_here(tmp_path, "diff", "HEAD")  # exit 1 before, where the docs say 2 (auditor 417)
    assert out.returncode == 2
    one_error_line(out, "diff compares two commits: give `HEAD B` or `HEAD..B`, not 'HEAD' alone")
    out = ckpt_here(tmp_path, "init", "z", "--metadata", "sqlite:////dev/zero")
    assert out.returncode == 1 and not (tmp_path / "z").exists()
    one_error_line(out, "the metadata URL names /dev/zero, which is not a file (a device, FIFO or socket)")
    (tmp_path / "loop").symlink_to("loop")
    out = ckpt_here(tmp_path, "watch", "loop", "--once")
    assert out.returncode == 2
    one_error_line(out, "'loop' is or passes through a symlink that leads back to itself (a loop)")
    save = tmp_path / "runs" / "checkpoint-2"
    save.mkdir(parents=True)
    (save / "trainer_state.json").write_text('{"global_step": 2}')
    (save / "a").symlink_to("a")
    out = ckpt_here(tmp_path, "watch", "runs", "--once", "--interval", "0.1")
    assert out.returncode == 0 and "checkpoint-2: not committed: " in out.stdout, out.stdout + out.stderr
    assert "/checkpoint-2/a is a symlink that leads back to itself (a loop): remove or repoint it" in out.stdout
