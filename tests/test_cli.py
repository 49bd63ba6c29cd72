"""The CLI as a user runs it: real subprocesses for exit codes and messages, CliRunner for flows."""

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptstore.cli import cli
from tests.conftest import Trainer, ckpt_env, ckpt_here, held_while

ROOT = Path(__file__).resolve().parents[1]


def ckpt(cwd, *args):
    env = ckpt_env()
    return subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    result = ckpt(tmp_path, "log")
    assert result.returncode == 1 and "no ckptstore repository" in result.stderr and "Traceback" not in result.stderr
    assert ckpt(tmp_path, "init").returncode == 0
    (tmp_path / "x.txt").write_text("hello")
    result = ckpt(tmp_path, "commit", "x.txt")
    assert result.returncode == 1 and "is not a checkpoint" in result.stderr
    result = ckpt(tmp_path, "checkout", "mian")
    assert result.returncode == 1 and "unknown ref 'mian'" in result.stderr


def test_json_outputs_and_diff_stats(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    run("init")
    trainer = Trainer()
    for step in (2, 4):
        trainer.train(2)
        torch.save(trainer.state(), "ckpt.pt")
        run("commit", "ckpt.pt", "--step", str(step), "-m", f"s{step}")
    log = json.loads(run("log", "--json").output)
    assert [c["step"] for c in log] == [4, 2]
    show = json.loads(run("show", "--json").output)
    assert show["id"] == log[0]["id"] and any(t["path"] == "model/fc1.weight" for t in show["tensors"])
    diff = json.loads(run("diff", "HEAD~1", "HEAD", "--json").output)
    weight = next(d for d in diff if d["path"] == "model/fc1.weight")
    assert weight["status"] == "changed" and 0 < weight["relative_l2"] < 1
    stats = json.loads(run("stats", "--json").output)
    assert len(stats["commits"]) == 2 and stats["raw_bytes"] > stats["objects_bytes"]
    assert "total: 2 commits" in run("stats").output
    assert "ok" in run("fsck").output
    refused = CliRunner().invoke(cli, ["branch", "-d", "main"])
    assert refused.exit_code != 0 and "HEAD is on it" in str(refused.exception)


def test_checkout_of_a_relative_ref_reports_the_commit_it_restored(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    run("init")
    for value in (1.0, 2.0):
        torch.save({"w": torch.full((4,), value)}, "ckpt.pt")
        run("commit", "ckpt.pt")
    first = json.loads(run("log", "--json").output)[1]["id"]
    assert f"Restored {first[:12]}" in run("checkout", "HEAD~1").output
    assert torch.load("ckpt.pt")["w"][0] == 1.0
    Path("ckpt.pt").unlink()
    Path("ckpt.pt").mkdir()  # where the file was committed from is a folder now
    in_place = CliRunner().invoke(cli, ["checkout", "main"])
    assert in_place.exit_code == 1 and "made from the file" in str(in_place.exception) and "-o PATH" in str(
        in_place.exception)
    Path("ckpt.pt").rmdir()
    run("checkout", "main")
    for ref in ("HEAD", " main "):  # restoring the current checkpoint leaves HEAD on its branch, as in git
        run("checkout", ref)
        assert "On branch main" in run("status").output
    overflow = CliRunner().invoke(cli, ["show", "HEAD^99999999999999999999999"])
    assert overflow.exit_code == 1 and "unknown ref" in str(overflow.exception)


def test_checkout_names_the_commit_it_wrote_when_another_lands_on_the_branch_meanwhile(tmp_path, monkeypatch):
    """`checkout HEAD~1 -o` resolved HEAD~1 once to print and once to write: a commit landing in between had it
    print one commit and write the next, 'byte for byte' (auditor 432)."""
    from ckptstore.repo import integrity
    from ckptstore.repo.repository import Repository

    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    run("init")
    for step in (1, 2):
        torch.save({"step": step}, "c.pt")
        run("commit", "c.pt")
    torch.save({"step": 3}, "other.pt")
    reads = {"manifests": 0}
    read = integrity.kept_manifest

    def another_commit_lands_first(repo, info):  # as a training job's commit would, at the first manifest read
        reads["manifests"] += 1
        if reads["manifests"] == 1:
            with Repository.open(tmp_path) as other:
                other.commit(tmp_path / "other.pt")
        return read(repo, info)

    monkeypatch.setattr(integrity, "kept_manifest", another_commit_lands_first)
    said = run("checkout", "HEAD~1", "-o", "out.pt").output
    newest_first = [entry["id"][:12] for entry in json.loads(run("log", "--json").output)]
    written = torch.load("out.pt")["step"]  # the file of commit 1 or 2, the third landing as the checkout ran
    assert reads["manifests"] >= 1 and len(newest_first) == 3, newest_first
    assert f"Restored {newest_first[3 - written]} " in said, (said, newest_first, written)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_ends_a_checkout_as_ctrl_c_does_and_leaves_no_temporary_file(tmp_path, signum):
    """SIGTERM (timeout, systemd, scancel) killed `checkout -o` at once, leaving its temporary file, as large as
    the checkpoint, beside the output where no gc looks (auditor 432). It ends as Ctrl-C does now: undone, then
    dead of the signal, as a supervisor expects (exit 143 is a failure to systemd: reviewer 435)."""
    from tests.conftest import wait_until_held

    torch.save({"w": torch.arange(1000.0)}, tmp_path / "c.pt")
    for args in (("init",), ("commit", "c.pt")):
        assert ckpt_here(tmp_path, *args).returncode == 0
    (tmp_path / "out").mkdir()
    release = tmp_path / "release"
    checkout = subprocess.Popen([sys.executable, "-m", "ckptstore", "checkout", "HEAD", "-o", "out/c.pt"],
                                cwd=tmp_path, env=ckpt_env(CKPT_WAIT_AT=f"checkout:staged={release}"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until_held(release, checkout)
    assert len(list((tmp_path / "out").iterdir())) >= 1  # the temporary file, whole
    checkout.send_signal(signum)
    _, err = checkout.communicate(timeout=120)
    assert checkout.returncode == -signum and "interrupted" in err and "Traceback" not in err, err
    assert list((tmp_path / "out").iterdir()) == []
    assert ckpt_here(tmp_path, "fsck").returncode == 0


def test_a_program_calling_main_gets_the_default_sigterm_back_once_the_command_ends(tmp_path):
    """main() left its SIGTERM handler installed: a program going on after it raised Terminated, a traceback,
    from a later SIGTERM, where the default ends it (reviewer 435)."""
    program = ("import os, signal; from ckptstore.cli import main\n"
               "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
               "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\nos.kill(os.getpid(), signal.SIGTERM)\n")
    ran = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=ckpt_env(), capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == -signal.SIGTERM and "Traceback" not in ran.stderr, ran.stderr


def test_stats_counts_the_database_on_disk(tmp_path):
    torch.save({"w": torch.arange(64.0)}, tmp_path / "c.pt")
    assert CliRunner().invoke(cli, ["init", str(tmp_path)]).exit_code == 0
    assert CliRunner().invoke(cli, ["--repo", str(tmp_path), "commit", str(tmp_path / "c.pt")]).exit_code == 0
    ckpt_dir = tmp_path / ".ckpt"
    stats = json.loads(CliRunner().invoke(cli, ["--repo", str(tmp_path), "stats", "--json"]).output)
    objects = sum(p.stat().st_size for p in (ckpt_dir / "objects").rglob("*") if p.is_file())
    database = sum(p.stat().st_size for p in ckpt_dir.glob("ckpt.db*") if not p.name.endswith("-shm"))
    assert stats["objects_bytes"] == objects and stats["metadata_bytes"] == database > 0
    assert stats["stored_bytes"] == objects + database
    assert f"{stats['raw_bytes'] / stats['stored_bytes']:.2f}x" in CliRunner().invoke(
        cli, ["--repo", str(tmp_path), "stats"]).output


def test_numbers_outside_what_is_stored_are_usage_errors(tmp_path):
    """A step past SQLite's integers, or a NaN or infinite idle time or watch interval, is refused at parsing."""
    assert CliRunner().invoke(cli, ["init", str(tmp_path)]).exit_code == 0
    torch.save({"w": torch.arange(8.0)}, tmp_path / "c.pt")
    step = CliRunner().invoke(cli, ["--repo", str(tmp_path), "commit", str(tmp_path / "c.pt"), "--step", "9" * 20])
    assert step.exit_code == 2 and "--step" in step.output
    for idle in ("nan", "-5", "inf"):
        refused = CliRunner().invoke(cli, ["--repo", str(tmp_path), "daemon", "start", "--idle", idle])
        assert refused.exit_code == 2 and "--idle" in refused.output, refused.output
    (tmp_path / "out").mkdir()
    torch.save({"w": torch.ones(4)}, tmp_path / "out" / "model_step1.pt")
    for interval in ("nan", "inf", "-1"):  # inf overflowed the wait; nan committed without the two-scan wait
        refused = ckpt(tmp_path, "watch", "out", "--once", "--interval", interval)
        assert refused.returncode == 2 and "--interval" in refused.stderr, refused.stderr
        assert "unexpected" not in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    assert not [p for p in (tmp_path / ".ckpt" / "objects").rglob("*") if p.is_file()]  # the commit stored nothing


def test_messages_name_what_the_user_gave(tmp_path):
    run = lambda *args: CliRunner().invoke(cli, ["--repo", str(tmp_path), *args])
    assert CliRunner().invoke(cli, ["init", str(tmp_path)]).exit_code == 0
    torch.save({"w": torch.arange(8.0)}, tmp_path / "c.pt")
    assert run("commit", str(tmp_path / "c.pt"), "--metric", " loss = 1 ").exit_code == 0
    assert json.loads(run("log", "--json").output)[0]["metrics"] == {"loss": 1.0}  # what --keep-best loss finds
    assert run("tag", "v1").exit_code == 0 and run("branch", "dev").exit_code == 0
    wrong_kind = run("branch", "-d", "v1")
    assert wrong_kind.exit_code == 1 and "'v1' is a tag, not a branch: delete it with `ckpt tag -d v1`" in str(
        wrong_kind.exception)
    both = run("branch", "foo", "-d", "dev")  # foo is no branch: dev is not deleted either
    assert both.exit_code == 1 and "unknown ref 'foo'" in str(both.exception) and "dev" in run("branch").output
    bad = run("remote", "add", "bad name", str(tmp_path))
    assert bad.exit_code == 1 and "not a valid remote name" in str(bad.exception)


def _files_of(folder: Path) -> dict[str, bytes]:
    """{path: bytes} under `folder`, without SQLite's -wal/-shm (any reader of the database makes them)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def test_every_writing_command_refuses_up_front_under_read_only(tmp_path):
    """`ckpt --read-only` writes nothing to the repository, nor to a remote: each writing command fails first."""
    for name in ("hub", "work"):
        assert ckpt_here(tmp_path, "init", name).returncode == 0
    work = tmp_path / "work"
    torch.save({"w": torch.ones(64)}, work / "x.pt")
    assert ckpt_here(work, "commit", "x.pt").returncode == 0
    assert ckpt_here(work, "remote", "add", "origin", "../hub").returncode == 0
    torch.save({"w": torch.zeros(64)}, work / "x.pt")
    assert ckpt_here(work, "commit", "x.pt").returncode == 0  # a commit the hub lacks: a push would send it
    (work / "out").mkdir()
    torch.save({"w": torch.ones(4)}, work / "out" / "model_step1.pt")
    before, hub = _files_of(work / ".ckpt"), _files_of(tmp_path / "hub" / ".ckpt")
    try:
        for args in (["commit", "x.pt", "--allow-empty"], ["checkout", "HEAD~1"], ["branch", "b"], ["tag", "t"],
                     ["gc"], ["prune", "--keep-last", "1"], ["watch", "out", "--once", "--interval", "0.05"],
                     ["remote", "add", "o2", "../hub"], ["remote", "remove", "origin"], ["push"], ["fetch"],
                     ["pull"], ["daemon", "start", "--idle", "30"]):
            result = ckpt_here(work, "--read-only", *args)
            assert result.returncode == 1 and "read-only here" in result.stderr, (args, result.stderr)
            assert result.stderr.count("\n") == 1, result.stderr
            assert _files_of(work / ".ckpt") == before and _files_of(tmp_path / "hub" / ".ckpt") == hub, args
    finally:
        ckpt_here(work, "daemon", "stop")


def test_a_multi_line_message_is_indented_line_by_line_in_log_and_show(tmp_path, monkeypatch):
    """As git shows it: a message's later lines must not read as log's own header lines."""
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args))
    assert run("init").exit_code == 0
    torch.save({"w": torch.ones(3)}, tmp_path / "c.pt")
    assert run("commit", "c.pt", "-m", "first line\nStep:   999\n\nafter a blank").exit_code == 0
    for command in ("log", "show"):
        out = run(command).output.splitlines()
        at = out.index("    first line")
        assert out[at : at + 4] == ["    first line", "    Step:   999", "    ", "    after a blank"], command
    refused = run("branch", "héllo")
    assert refused.exit_code == 1 and "ASCII letters" in str(refused.exception)


@pytest.mark.parametrize("message", ["", "   ", "\n \n\t\n"])
def test_an_empty_message_prints_no_line_of_spaces(tmp_path, monkeypatch, message):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    run("init")
    torch.save({"w": torch.ones(3)}, tmp_path / "c.pt")
    made = run("commit", "c.pt", "-m", message)
    made_id = json.loads(run("log", "-n", "1", "--json").output)[0]["id"][:12]
    assert made.exit_code == 0 and made.output.startswith(f"[{made_id}]  ("), made.output  # reviewer 421: as typed
    for command in ("log", "show"):
        out = run(command).output
        assert "file . [torch]" in out or command == "log"
        assert not [line for line in out.splitlines() if line and not line.strip()], (command, out)



def test_show_of_a_lossy_commit_without_optimizer_state_says_no_importance_was_estimated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = lambda *args: CliRunner().invoke(cli, list(args), catch_exceptions=False)
    run("init")
    torch.save({"w": torch.randn(256, 256) * 0.02}, tmp_path / "c.pt")
    assert run("commit", "c.pt", "--lossy", "balanced").exit_code == 0
    shown = run("show").output
    assert "importance: none: no optimizer state" in shown and "estimated from the optimizer state" not in shown


def test_show_of_an_in_memory_commit_lists_no_file(tmp_path):
    """It printed `file . [torch] 0 B` for a state that never was a file (auditor), and `source None`, `step None`,
    `Step:   None` where stats prints `-` (auditor helper 279)."""
    from ckptstore import Repository

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(3)})
    torch.save({"w": torch.zeros(3)}, tmp_path / "c.pt")
    shown = ckpt_here(tmp_path, "show").stdout
    assert "step -  metrics {}  source -\n" in shown and "\nfile " not in shown and "w  torch.float32 (3,)" in shown
    assert "\nStep:   -\n" in ckpt_here(tmp_path, "log").stdout and "None" not in shown
    assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    assert "\nfile . [torch] " in ckpt_here(tmp_path, "show").stdout  # a file's commit still lists it


def test_commits_on_a_detached_head_are_said_so_and_leaving_them_behind_warns(tmp_path):
    """As git: a commit on a detached HEAD says it is on no branch; moving HEAD off such commits names them."""
    run = lambda *args: ckpt_here(tmp_path, *args)
    run("init")
    for value, then in ((0.0, ("tag", "best")), (1.0, None)):
        torch.save({"w": torch.full((4,), value)}, tmp_path / "ck.pt")
        assert "detached" not in run("commit", "ck.pt").stdout  # on main
        if then:
            run(*then)
    detached = run("checkout", "best")
    assert "HEAD is detached at" in detached.stdout and "HEAD is detached" not in run("checkout", "main").stdout
    assert "HEAD is detached" not in run("checkout", "best", "-o", "copy.pt").stdout  # HEAD did not move
    assert run("branch").stdout.startswith("* main ")  # on its branch: no detached line
    run("checkout", "best")
    assert run("branch").stdout.startswith("* (HEAD detached at ")  # as git lists it
    torch.save({"w": torch.full((4,), 9.0)}, tmp_path / "ck.pt")
    made = run("commit", "ck.pt")
    assert "HEAD is detached" in made.stdout and "ckpt branch NAME" in made.stdout
    kept_id = made.stdout[1:13]
    moved = run("checkout", "main")
    assert moved.returncode == 0 and "leaves 1 commit behind" in moved.stderr and kept_id in moved.stderr
    assert "leaves" not in run("checkout", "best").stderr  # detached again, but nothing is left behind this time
    run("branch", "kept", kept_id)
    run("checkout", kept_id)
    assert "leaves" not in run("checkout", "main").stderr  # a branch reaches it now


def test_deleting_the_only_branch_or_tag_that_reaches_commits_warns_of_them(tmp_path):
    """`ckpt branch -d exp` said only "Deleted branch exp", and the next `gc --prune` deleted its checkpoint for
    good; git refuses an unmerged branch (git-habits auditor)."""
    run = lambda *args: ckpt_here(tmp_path, *args)
    run("init")
    torch.save({"w": torch.zeros(4)}, tmp_path / "ck.pt")
    run("commit", "ck.pt")
    run("branch", "exp")
    run("checkout", "exp")
    torch.save({"w": torch.ones(4)}, tmp_path / "ck.pt")
    tip = run("commit", "ck.pt").stdout[1:13]
    run("tag", "v1", tip)
    run("checkout", "main")
    kept = run("branch", "-d", "exp")  # v1 still reaches it
    assert kept.returncode == 0 and "leaves" not in kept.stderr
    gone = run("tag", "-d", "v1")
    assert gone.returncode == 0, gone.stderr
    assert f"deleting tag v1 leaves 1 commit behind that no branch or tag reaches, up to {tip}" in gone.stderr
    assert f"ckpt branch NAME {tip}" in gone.stderr
    run("branch", "exp", tip)
    again = run("branch", "-d", "exp")
    assert again.returncode == 0 and "deleting branch exp leaves 1 commit behind" in again.stderr
    assert "leaves" not in run("branch", "-d", "exp2").stderr  # an unknown branch: its own error only


def test_control_characters_in_commit_text_reach_the_terminal_written_out(tmp_path):
    """A fetched commit's message or metric name could retitle, clear or overwrite the terminal of whoever runs log."""
    from ckptstore import Repository

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(4)}, "title\x1b]0;owned\x07 and\x1b[2J\rgone\nsecond line\tx",
                    metrics={"loss\x1b[31m": 1.0})
    for args in (("log",), ("log", "--graph"), ("show", "HEAD"), ("stats",)):
        out = ckpt_here(tmp_path, *args)
        assert out.returncode == 0 and "\x1b" not in out.stdout + out.stderr and "\r" not in out.stdout, args
    assert "\\x1b]0;owned\\x07" in ckpt_here(tmp_path, "log").stdout
    shown = ckpt_here(tmp_path, "show", "HEAD").stdout
    assert "\\x1b[2J\\x0dgone" in shown and "second line\tx" in shown and "loss\\x1b[31m" in shown


def test_a_newline_in_a_file_or_tensor_name_stays_on_its_line(tmp_path):
    """A name holding a newline broke show, status and diff listings into lines that looked like entries."""
    (tmp_path / "a\nmodified: b.pt").mkdir()
    source = tmp_path / "a\nmodified: b.pt" / "ck.pt"
    torch.save({"w\nx": torch.ones(4)}, source)
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", str(source), "-m", "one").returncode == 0
    torch.save({"w\nx": torch.zeros(4)}, source)
    assert ckpt_here(tmp_path, "commit", str(source), "-m", "two").returncode == 0
    torch.save({"w\nx": torch.full((4,), 2.0)}, source)
    shown = ckpt_here(tmp_path, "show", "HEAD").stdout.splitlines()
    assert any(line.startswith("  w\\nx  ") for line in shown), shown
    assert any(line.endswith("source a\\nmodified: b.pt/ck.pt") for line in shown), shown
    assert not any(line.startswith(("x ", "modified: b.pt")) for line in shown), shown
    status = ckpt_here(tmp_path, "status").stdout.splitlines()
    assert status[1:] == ["    modified: a\\nmodified: b.pt/ck.pt"], status
    diff = ckpt_here(tmp_path, "diff", "HEAD~1", "HEAD").stdout.splitlines()
    assert any(line.startswith("  changed w\\nx torch.float32 (4,) rel_l2=1.000e+00") for line in diff), diff
    back = ckpt_here(tmp_path, "checkout", "HEAD~1", "--force").stdout.splitlines()  # in place: the recorded path
    assert back[0].startswith("Restored ") and back[0].endswith("/a\\nmodified: b.pt/ck.pt"), back
    assert not any(line.startswith("modified: b.pt") for line in back), back


def test_init_export_remote_and_clone_write_out_a_newline_and_bytes_not_utf8_in_paths(tmp_path):
    """init, export -o, remote add/set-url/list and clone printed their folder or URL raw: a newline split the line,
    a byte not UTF-8 showed as \\udcfd where the reference says \\xfd (auditor helper 279)."""
    odd, hub = os.fsdecode(b"in\xfd"), "nl\nhub"
    lines = lambda out: (out.returncode, out.stdout.splitlines())
    assert lines(ckpt_here(tmp_path, "init", odd)) == (0, [f"Initialized empty ckptstore repository in {tmp_path}/in"
                                                          "\\xfd/.ckpt"])
    assert lines(ckpt_here(tmp_path, "init", hub)) == (0, [f"Initialized empty ckptstore repository in {tmp_path}/nl"
                                                          "\\nhub/.ckpt"])
    torch.save({"w": torch.ones(2)}, tmp_path / hub / "c.pt")
    assert ckpt_here(tmp_path / hub, "commit", "c.pt").returncode == 0
    for name, shown in (("a\nb.pt", "a\\nb.pt"), (os.fsdecode(b"e\xfd.pt"), "e\\xfd.pt")):
        code, said = lines(ckpt_here(tmp_path / hub, "export", "HEAD", "-o", name))
        assert code == 0 and len(said) == 1 and f" to {shown}: 1 tensors (torch)" in said[0], said
    for verb in ("add", "set-url"):
        assert lines(ckpt_here(tmp_path / odd, "remote", verb, "o", f"../{hub}")) == (0, ["remote o: ../nl\\nhub"])
    assert lines(ckpt_here(tmp_path / odd, "remote", "list")) == (0, ["o\t../nl\\nhub"])
    for folder, shown in (("cl\nx", "cl\\nx"), (os.fsdecode(b"cl\xfe"), "cl\\xfe")):
        assert lines(ckpt_here(tmp_path, "clone", hub, folder)) == (0, [f"Cloned nl\\nhub into {tmp_path}/{shown}"])


def test_an_empty_path_or_option_value_is_refused_not_taken_for_the_folder_or_for_none(tmp_path):
    """`ckpt commit ""` committed the whole folder, `checkout -o ""` wrote into it, `fsck --remote ""` checked the
    local repository and `--calibration ""` dropped the calibration without a word (auditor)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    for args, said in ((("commit", ""), "is empty"), (("checkout", "HEAD", "-o", ""), "is empty"),
                       (("export", "HEAD", "-o", ""), "is empty"), (("clone", ".", ""), "is empty"),
                       (("clone", ""), "is empty"),
                       (("fsck", "--remote", ""), "no remote named ''"),
                       (("commit", "c.pt", "--lossy", "balanced", "--calibration", ""), "MODULE:FUNCTION")):
        out = ckpt_here(tmp_path, *args)
        assert out.returncode != 0 and said in out.stderr, (args, out.stderr)
    assert ckpt_here(tmp_path, "log").stdout.count("\ncommit ") == 0  # the first commit alone


def test_debug_is_the_groups_flag_and_read_only_refuses_a_clone(tmp_path):
    """`commit -m --debug` printed a traceback; `--read-only clone` made a repository; `init --lossy none` said
    "commits are lossy: none" (auditors)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    said = ckpt_here(tmp_path, "init", "--lossy", "none").stdout
    assert "Initialized" in said and "lossy" not in said
    ckpt_here(tmp_path, "commit", "c.pt")
    quiet = ckpt_here(tmp_path, "commit", "c.pt", "-m", "--debug")
    assert quiet.returncode != 0 and "Traceback" not in quiet.stderr and quiet.stderr.count("\n") == 1
    loud = ckpt_here(tmp_path, "--repo", str(tmp_path), "--debug", "commit", "c.pt")
    assert loud.returncode != 0 and "Traceback" in loud.stderr
    out = ckpt_here(tmp_path, "--read-only", "clone", ".", "copy")
    assert out.returncode != 0 and "--read-only refuses every write" in out.stderr and not (tmp_path / "copy").exists()


def test_checkout_and_export_notes_write_out_a_newline_and_a_backslash_in_names(tmp_path):
    """A name holding a newline split checkout's torch.save note and export's left-out note into forged lines."""
    folder = tmp_path / "f"
    folder.mkdir()
    torch.save({"w": torch.ones(3)}, folder / "l\n[0123456789ab] y.pt", _use_new_zipfile_serialization=False)
    (folder / "n\\n\nb.txt").write_text("not a tensor")  # a backslash and an n, then a newline
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "f", "-m", "one").returncode == 0
    restored = ckpt_here(tmp_path, "checkout", "HEAD", "-o", "out").stdout.splitlines()
    assert "note: l\\n[0123456789ab] y.pt written with torch.save" in restored[-1], restored
    assert not any(line.startswith("[0123456789ab]") for line in restored), restored
    exported = ckpt_here(tmp_path, "export", "HEAD", "--all", "-o", "e.safetensors").stdout.splitlines()
    assert exported[-1].startswith("note: left out 1 item (n\\\\n\\nb.txt/%25blob): "), exported


def test_a_metric_given_twice_or_graph_with_json_is_refused_and_an_empty_remote_name_is_spelt_out(tmp_path):
    """`--metric loss=1 --metric loss=2` kept the last, `log --graph --json` dropped --graph, and `push ""` advised
    `ckpt remote add  URL` (auditor)."""
    torch.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    ckpt_here(tmp_path, "init")
    twice = ckpt_here(tmp_path, "commit", "c.pt", "--metric", "loss=1", "--metric", " loss=2")
    assert twice.returncode == 2 and "'loss' is given twice" in twice.stderr
    ckpt_here(tmp_path, "commit", "c.pt")
    both = ckpt_here(tmp_path, "log", "--graph", "--json")
    assert both.returncode == 2 and "choose one" in both.stderr
    assert "`ckpt remote add NAME URL`" in ckpt_here(tmp_path, "push", "").stderr


def test_clone_takes_a_folder_it_may_enter_but_not_list(tmp_path):
    """The URL was a click.Path, which wants to read the folder: a 0711 repository was 'not readable' (reader)."""
    import os
    import shutil

    if shutil.which("capsh") is None or os.geteuid() != 0:
        pytest.skip("needs root and capsh to drop root's right to read any folder")
    origin = tmp_path / "origin"
    origin.mkdir()
    os.chown(origin, 65534, 65534)
    origin.chmod(0o711)
    check = ("from ckptstore.cli import UrlGiven; import sys; "
             f"print(UrlGiven().convert({str(origin)!r}, None, None))")
    out = subprocess.run(["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
                          f"{sys.executable} -c {shlex.quote(check)}"], capture_output=True, text=True,
                         timeout=60, env=ckpt_env())
    assert out.returncode == 0 and out.stdout.strip() == str(origin), out.stderr
    said = ckpt_here(tmp_path, "clone", "")
    assert said.returncode == 2 and "is empty (a variable not set?): pass a URL or a folder" in said.stderr


def test_log_of_an_unborn_head_names_the_branches_that_have_commits(tmp_path):
    """After a sharded save to its own branch in a new repository, `ckpt log` printed nothing (sharded auditor)."""
    import torch.distributed.checkpoint as dcp

    from ckptstore import Repository
    from ckptstore.dcp import CkptStorageWriter

    with Repository.init(tmp_path) as repo:
        dcp.save({"w": torch.ones(4)}, storage_writer=CkptStorageWriter(repo, branch="run"))
    for args in (["log"], ["log", "--graph"]):
        result = ckpt_here(tmp_path, *args)
        assert result.returncode == 0 and result.stdout == (
            "note: HEAD's branch 'main' has no commits yet; run has: `ckpt log --all` lists them\n"), result.stdout
    assert ckpt_here(tmp_path, "log", "--json").stdout.strip() == "[]"


def test_log_shows_names_from_rows_escaped_and_dates_with_their_offset(tmp_path, monkeypatch):
    """A metric name or a ref row holding a newline forged a whole commit entry in `log`, `branch` and `tag`
    (a shared database's other client, a Trainer's metric key); a time past year 9999 stopped the log; dates had
    no zone, so two machines' logs of one repository disagreed (auditor)."""
    import contextlib
    import datetime
    import sqlite3

    from ckptstore.repo import Repository
    from ckptstore.repo.maintenance import fsck

    forged = "\ncommit " + "0" * 64 + "\nDate:   2020-01-01T00:00:00\n\n    verified\n\nloss"
    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.ones(3)}, metrics={forged: 1.0})
        monkeypatch.setattr("ckptstore.repo.commit.time.time", lambda: 1e12)
        repo.commit({"w": torch.zeros(3)}, message="from a clock far ahead")
    with contextlib.closing(sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES (?, 'branch', ?)", ("x\n* release", first))
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES (?, 'tag', ?)", ("t\nv1.0-verified", first))
        # what ckptstore writes, or wrote before names had a limit: no damage (reader)
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('remotes/remotes/main', 'remote', ?)", (first,))
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES (?, 'branch', ?)", ("b" * 230, first))
        db.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('remotes/origin/main', 'branch', ?)", (first,))
    log = ckpt_here(tmp_path, "log")
    lines = log.stdout.splitlines()
    assert log.returncode == 0 and sum(line.startswith("commit ") for line in lines) == 2, log.stdout
    assert "Date:   @1000000000000.0" in lines, lines
    assert "x\\n* release, " in log.stdout and "tag: t\\nv1.0-verified)" in log.stdout
    assert "Metrics: \\ncommit 000" in log.stdout
    local = datetime.datetime.now().astimezone().isoformat()[-6:]  # this machine's offset now, +00:00 here
    assert any(line.startswith("Date:   ") and line.endswith(local) for line in lines), lines
    assert "* release" not in ckpt_here(tmp_path, "branch").stdout.splitlines()
    assert "v1.0-verified " + first[:12] not in ckpt_here(tmp_path, "tag").stdout.splitlines()
    with Repository.open(tmp_path) as repo:
        damaged = fsck(repo).damaged_records
    assert "is not a valid branch or tag name" in damaged["ref x\n* release"], damaged
    assert "ref t\nv1.0-verified" in damaged, damaged
    assert "ref remotes/remotes/main" not in damaged and f"ref {'b' * 230}" not in damaged, damaged
    assert "starts with 'remotes/'" in damaged["ref remotes/origin/main"], damaged  # a branch no ckpt makes (reader)


def test_messages_given_twice_are_paragraphs_of_one_as_in_git(tmp_path):
    """`-m "lr sweep" -m "warmup 500"` stored the second alone: the first was lost unsaid (git-habits auditor)."""
    from ckptstore import Repository

    assert ckpt_here(tmp_path, "init").returncode == 0
    torch.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    made = ckpt_here(tmp_path, "commit", "c.pt", "-m", "lr sweep 3e-4", "-m", "warmup 500, grad clip 1.0")
    assert made.returncode == 0 and "lr sweep 3e-4" in made.stdout
    with Repository.open(tmp_path) as repo:
        assert repo.log()[0].message == "lr sweep 3e-4\n\nwarmup 500, grad clip 1.0"


def test_a_value_given_twice_is_refused_and_d_given_twice_deletes_both_as_in_git(tmp_path):
    """`--step 100 --step 200` recorded 200 and `--branch a --branch b` committed to b, unsaid; `branch -d a -d b`
    deleted b alone and `tag -d t1 t2` was refused (git-habits auditor, left since stop 55)."""
    from ckptstore import Repository

    assert ckpt_here(tmp_path, "init").returncode == 0
    torch.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    for option, values in (("--step", ("100", "200")), ("--branch", ("a", "b")), ("--lossy", ("balanced", "none"))):
        refused = ckpt_here(tmp_path, "commit", "c.pt", option, values[0], option, values[1])
        assert refused.returncode == 2 and f"given 2 times ({', '.join(values)})" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert ckpt_here(tmp_path, "commit", "c.pt", "--step", "7").returncode == 0
    with Repository.open(tmp_path) as repo:
        assert [c.step for c in repo.log()] == [7]  # the refusals recorded nothing
    for name in "abcdef":
        assert ckpt_here(tmp_path, "branch", name).returncode == 0
        assert ckpt_here(tmp_path, "tag", f"t{name}").returncode == 0
    deleted = ckpt_here(tmp_path, "branch", "-d", "a", "-d", "b", "-d", "b")  # b once
    assert deleted.returncode == 0 and deleted.stdout.count("Deleted branch") == 2, deleted.stderr
    for refused, why in ((("tag", "-d", "tc", "tz"), "'tz'"), (("branch", "-d", "c", "main"), "HEAD is on it")):
        result = ckpt_here(tmp_path, *refused)  # one that cannot go: none deleted
        assert result.returncode == 1 and why in result.stderr, result.stderr
    assert ckpt_here(tmp_path, "tag", "-d", "ta", "tb", "tc", "td").returncode == 0  # four after -d (reader 39)
    assert ckpt_here(tmp_path, "branch", "-d", "c", "d", "e").returncode == 0
    three = ckpt_here(tmp_path, "branch", "g", "HEAD", "extra")
    assert three.returncode == 2 and "at most START" in three.stderr
    with Repository.open(tmp_path) as repo:
        assert set(repo.branches()) == {"main", "f"} and set(repo.tags()) == {"te", "tf"}


def test_a_command_run_in_a_subfolder_of_the_work_tree_finds_the_repository_above(tmp_path):
    """Like git, `ckpt` walks up from the cwd to the folder holding `.ckpt` (mutation audit)."""
    from ckptstore import Repository

    assert ckpt_here(tmp_path, "init").returncode == 0
    sub = tmp_path / "runs" / "exp1"
    sub.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, sub / "a.pt")
    made = ckpt_here(sub, "commit", "a.pt", "-m", "from a subfolder")
    assert made.returncode == 0, made.stderr
    assert not (sub / ".ckpt").exists() and not (tmp_path / "runs" / ".ckpt").exists()
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["from a subfolder"]
        assert torch.equal(repo.checkout("HEAD")["w"], torch.ones(4))


def _then_hang(monkeypatch, owner, name: str, proxy) -> None:
    """Make `owner.name` do its work, then stop the database answering: what the command reads after it fails."""
    real = getattr(owner, name)

    def work_then_hang(*args, **kwargs):
        done = real(*args, **kwargs)
        proxy.stalled = True
        return done

    monkeypatch.setattr(owner, name, work_then_hang)


def test_a_checkout_done_before_the_database_hung_exits_0_and_warns_what_it_could_not_report(stalling,
                                                                                             tmp_path, monkeypatch):
    """The reads for the report (HEAD detached? files rewritten?) ran after HEAD had moved and the file was written:
    their error exited 1 saying nothing was changed, under "Restored" (auditor 364)."""
    from ckptstore import Repository

    proxy, url = stalling
    assert ckpt_here(tmp_path, "init", "--metadata", url).returncode == 0
    torch.save({"w": torch.zeros(4)}, tmp_path / "a.pt")
    assert ckpt_here(tmp_path, "commit", "a.pt", "-m", "on main").returncode == 0
    main_bytes = (tmp_path / "a.pt").read_bytes()
    for args in (("branch", "side"), ("checkout", "side")):
        assert ckpt_here(tmp_path, *args).returncode == 0
    torch.save({"w": torch.ones(4)}, tmp_path / "a.pt")
    assert ckpt_here(tmp_path, "commit", "a.pt", "-m", "on side").returncode == 0
    _then_hang(monkeypatch, Repository, "checkout_to", proxy)
    result = ckpt_here(tmp_path, "checkout", "main")
    assert result.returncode == 0 and result.stdout.startswith("Restored "), result.stderr
    assert result.stderr == ("warning: the checkout is done, but whether HEAD is detached could not be read: "
                             "`ckpt status` says so once the metadata answers\n")
    assert "Files are byte for byte as committed." in result.stdout  # read before the checkout (auditor 419)
    proxy.stalled = False
    assert (tmp_path / "a.pt").read_bytes() == main_bytes
    assert ckpt_here(tmp_path, "status").stdout.startswith("On branch main at ")


@pytest.mark.parametrize("hung_after", ["pull", "_update_worktree"])
def test_a_pull_done_before_the_database_hung_exits_0(stalling, tmp_path, monkeypatch, hung_after):
    """HEAD's branch was read for the report after the branch had moved: a hung server then exited 1 saying
    nothing was changed (auditor 364). It is read before; so is whether the commits are sharded, which the pull
    itself read once the files were written (reviewer 373)."""
    from ckptstore.repo import remote

    proxy, url = stalling
    hub, here = tmp_path / "hub", tmp_path / "here"
    hub.mkdir()
    assert ckpt_here(hub, "init").returncode == 0
    torch.save({"w": torch.ones(4)}, hub / "a.pt")
    assert ckpt_here(hub, "commit", "a.pt", "-m", "at the hub").returncode == 0
    here.mkdir()
    for args in (("init", "--metadata", url), ("remote", "add", "origin", str(hub))):
        assert ckpt_here(here, *args).returncode == 0
    _then_hang(monkeypatch, remote, hung_after, proxy)
    result = ckpt_here(here, "pull", "origin", "main")
    assert result.returncode == 0 and result.stdout.splitlines()[-1].startswith("fast-forwarded main to "), (
        result.stderr)
    proxy.stalled = False
    assert json.loads(ckpt_here(here, "log", "--json").stdout)[0]["message"] == "at the hub"


def test_a_checkout_whose_commit_a_prune_removes_once_its_file_is_written_reports_without_a_warning(tmp_path):
    """The report's second read of the manifest met the prune: 'could not be read ... once the metadata answers',
    at every `checkout -o` beside a training job with a retention policy (auditor 419)."""
    assert ckpt_here(tmp_path, "init").returncode == 0
    for value in (1.0, 2.0):
        torch.save({"w": torch.full((4,), value)}, tmp_path / "c.pt")
        assert ckpt_here(tmp_path, "commit", "c.pt").returncode == 0
    done = held_while(tmp_path, ["checkout", "main~1", "-o", "out.pt"], "checkout:renamed",
                      lambda: ckpt_here(tmp_path, "prune", "--keep-last", "1").check_returncode())
    assert done.returncode == 0 and done.stderr == "" and "Files are byte for byte as committed." in done.stdout, done
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.full((4,), 1.0))
