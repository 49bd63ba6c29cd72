"""Checkouts to disk: exactly the commit's files, nothing written outside the destination, modes kept,
concurrent writers never tear a file, and a commit never takes in the repository itself."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import CheckpointFormatError, CkptError, DirtyWorktreeError
from ckptstore.repo import remote
from ckptstore.repo.config import RepoConfig
from tests.conftest import assert_same, ckpt_env, ckpt_here, machine_settings
from tests.formats.test_formats import make_trainer_folder

ROOT = Path(__file__).resolve().parents[2]
# pairs of concurrent `ckpt checkout -o` runs: one in the default run, 22 (the count) in the long mode
TRIALS = 22 if os.environ.get("CKPT_HYPOTHESIS_PROFILE") == "long" else 1


def _files(folder):
    """{name: bytes} of every file under `folder` (links followed), and nothing else."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _ckpt(cwd, *args):
    env = ckpt_env()
    return subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_folder_checkout_holds_exactly_the_commits_files(repo):
    run = make_trainer_folder(repo.root / "run")
    first = repo.commit(run, message="first")
    old = _files(run)
    (run / "extra.json").write_text("{}")
    (run / "tokenizer" / "merges.txt").write_text("a b\n")
    (run / "deeper" / "still").mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, run / "deeper" / "still" / "ema.pt")
    repo.commit(run, message="second")
    repo.checkout_to(first)
    now = _files(run)
    assert sorted(now) == sorted(old)
    assert all(now[name] == old[name] for name in old if not name.endswith((".pt", ".pth")))  # torch files: re-saved
    assert not (run / "deeper").exists() and repo.head() == (None, first)
    again = repo.commit(run, allow_empty=True)  # the next commit does not pick up the newer commit's files
    assert [f.name for f in repo.manifest(again).files] == [f.name for f in repo.manifest(first).files]
    assert repo.manifest(again).entries == repo.manifest(first).entries


def test_deleting_a_file_the_store_cannot_give_back_is_refused_unless_forced(repo):
    run = make_trainer_folder(repo.root / "run")
    first = repo.commit(run)
    (run / "notes.txt").write_text("my only copy")
    same_size = bytes(b ^ 1 for b in (run / "config.json").read_bytes())  # a known size, unknown content
    (run / "copy.json").write_bytes(same_size)
    with pytest.raises(DirtyWorktreeError, match=r"delete .*copy.json, .*notes.txt \(not in the commit\)"):
        repo.checkout_to(first)
    assert (run / "notes.txt").read_text() == "my only copy" and (run / "copy.json").read_bytes() == same_size
    shutil.copy(run / "config.json", run / "copy.json")  # now the store can give it back: deleted
    with pytest.raises(DirtyWorktreeError, match="not in the store") as info:
        repo.checkout_to(first)
    assert "copy.json" not in str(info.value)
    repo.checkout_to(first, force=True)
    assert not (run / "notes.txt").exists() and not (run / "copy.json").exists()


def test_a_temporary_file_an_interrupted_write_left_in_a_committed_folder_never_stops_a_checkout(repo):
    """`.NAME.<16 hex>.ckpt-tmp` is an atomic writer's, never the user's work: removed, not refused (mutation audit)."""
    run = repo.root / "run"
    run.mkdir()
    torch.save({"w": torch.ones(8)}, run / "a.pt")
    first = repo.commit(run, message="one")
    torch.save({"w": torch.zeros(8)}, run / "a.pt")
    repo.commit(run, message="two")
    leftover = run / ".a.pt.0123456789abcdef.ckpt-tmp"  # what a killed atomic write leaves
    leftover.write_bytes(os.urandom(777))
    repo.checkout_to(first)
    assert sorted(p.name for p in run.iterdir()) == ["a.pt"]
    assert torch.equal(torch.load(run / "a.pt", weights_only=True)["w"], torch.ones(8))
    assert repo.head() == (None, first)  # checked out by id: detached there


def test_a_named_pipe_in_the_folder_stops_a_checkout_unless_forced(repo):
    """A FIFO (a run's control pipe) is nothing the store can give back: deleted by an exact checkout where the
    check of special files is gone (mutation audit: no test held it)."""
    run = make_trainer_folder(repo.root / "run")
    first = repo.commit(run)
    os.mkfifo(run / "control.fifo")
    with pytest.raises(DirtyWorktreeError, match=r"delete .*control.fifo \(not in the commit\)"):
        repo.checkout_to(first)
    assert stat.S_ISFIFO((run / "control.fifo").lstat().st_mode)
    repo.checkout_to(first, force=True)
    assert not (run / "control.fifo").exists()


def test_checkout_never_writes_through_a_symlink_leading_out_of_the_destination(repo, tmp_path):
    run = make_trainer_folder(repo.root / "run")
    first = repo.commit(run)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "vocab.txt").write_text("theirs")
    shutil.rmtree(run / "tokenizer")
    os.symlink(outside, run / "tokenizer")
    for output in (None, run):
        with pytest.raises(CkptError, match="is a symlink to .*outside"):
            repo.checkout_to(first, output=output, force=True)
    assert (outside / "vocab.txt").read_text() == "theirs" and list(outside.iterdir()) == [outside / "vocab.txt"]


def test_links_in_the_destination_are_replaced_not_written_through(repo, tmp_path):
    run = make_trainer_folder(repo.root / "run")
    first = repo.commit(run)
    victim = tmp_path / "victim.json"
    victim.write_text("untouched")
    (run / "config.json").unlink()
    os.symlink(victim, run / "config.json")  # a file link: the checkout replaces the link itself
    os.symlink(tmp_path, run / "stray")  # a link the commit does not have: removed, its target kept
    repo.checkout_to(first)
    assert victim.read_text() == "untouched" and tmp_path.is_dir()
    assert not (run / "config.json").is_symlink() and not os.path.lexists(run / "stray")


def test_permission_bits_come_back_at_checkout(repo, tmp_path):
    run = make_trainer_folder(repo.root / "run")
    os.chmod(run / "optimizer.pt", 0o600)
    os.chmod(run / "tokenizer" / "vocab.txt", 0o750)
    torch.save({"w": torch.ones(2)}, repo.root / "lone.pt")
    os.chmod(repo.root / "lone.pt", 0o640)
    folder, lone = repo.commit(run), repo.commit(repo.root / "lone.pt")
    repo.checkout_to(folder, output=tmp_path / "out")
    repo.checkout_to(lone, output=tmp_path / "lone.pt")
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    assert mode(tmp_path / "out" / "optimizer.pt") == 0o600
    assert mode(tmp_path / "out" / "tokenizer" / "vocab.txt") == 0o750
    assert mode(tmp_path / "out" / "config.json") == mode(run / "config.json") and mode(tmp_path / "lone.pt") == 0o640


def test_a_commit_of_the_repository_root_leaves_out_the_repository(repo):
    torch.save({"w": torch.arange(5.0)}, repo.root / "model.pt")
    (repo.root / "notes.json").write_text("{}")
    cid = repo.commit(repo.root)
    assert sorted(f.name for f in repo.manifest(cid).files) == ["model.pt", "notes.json"]
    (repo.root / "notes.json").unlink()
    assert repo.checkout_to(cid) == repo.root
    assert (repo.root / "notes.json").read_text() == "{}" and repo.log()[0].id == cid  # .ckpt/ untouched
    os.symlink(".ckpt/config.toml", repo.root / "cfg")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint folder"):
        repo.commit(repo.root)


def test_output_into_a_missing_directory_is_a_one_line_error(repo, tmp_path):
    torch.save({"w": torch.ones(2)}, repo.root / "a.pt")
    repo.commit(repo.root / "a.pt")
    proc = _ckpt(repo.root, "checkout", "HEAD", "-o", str(tmp_path / "missing" / "x.pt"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err.strip().count("\n") == 0
    assert err.startswith(f"error: directory {tmp_path / 'missing'} does not exist"), err
    assert not (tmp_path / "missing").exists()
    (tmp_path / "ck.pt").write_bytes(b"a file")  # not a folder: it was said not to exist (auditor helper 279)
    for output in (tmp_path / "ck.pt" / "x.pt", tmp_path / "ck.pt" / "sub" / "x.pt"):
        said = ckpt_here(repo.root, "checkout", "HEAD", "-o", str(output))
        assert said.returncode == 1 and said.stderr == f"error: {tmp_path / 'ck.pt'} is a file, not a folder; pass " \
            "another -o path\n", said.stderr
    assert (tmp_path / "ck.pt").read_bytes() == b"a file"
    (tmp_path / "later").symlink_to(tmp_path / "not-made-yet")  # a link to a folder not made yet (helper 291)
    said = ckpt_here(repo.root, "checkout", "HEAD", "-o", str(tmp_path / "later" / "x.pt"))
    assert said.returncode == 1 and f"{tmp_path / 'later'} is a symlink to {tmp_path / 'not-made-yet'}, which does " \
        "not exist; create it first" in said.stderr, said.stderr


def test_output_inside_the_repositorys_own_folders_is_refused_up_front(repo, tmp_path):
    """`checkout -o .ckpt/x.pt` (with --read-only too), --only, export, and a store kept beside .ckpt/."""
    torch.save({"w": torch.ones(2)}, repo.root / "a.pt")
    repo.commit(repo.root / "a.pt")
    for args in (["checkout", "HEAD", "-o", ".ckpt/x.pt"], ["--read-only", "checkout", "HEAD", "-o", ".ckpt/x.pt"],
                 ["checkout", "HEAD", "-o", ".ckpt"], ["checkout", "HEAD", "-o", ".ckpt/objects/x.pt", "--only", "w"],
                 ["export", "HEAD", "-o", str(repo.dir / "x.safetensors")]):
        out, err = _ckpt(repo.root, *args).communicate(timeout=120)
        assert err.count("\n") == 1 and err.startswith("error: ") and "inside the repository's own .ckpt/" in err, (
            args, err)
    assert not [p for p in repo.dir.rglob("x.*")]  # nothing written there
    from ckptstore import Repository

    with Repository.init(tmp_path / "r", objects_url="../objects") as beside:  # <root>/objects, beside .ckpt/
        beside.commit({"w": torch.ones(2)})
        with pytest.raises(CkptError, match="inside the repository's own objects/"):
            beside.checkout_to("HEAD", beside.root / "objects" / "x.pt")
        stored = next(p for p in (beside.root / "objects").rglob("*") if p.is_file())
        with pytest.raises(CkptError, match="inside the repository's own objects/"):  # nor commits the store's files
            beside.commit(stored.parent)
    assert not (tmp_path / "r" / "objects" / "x.pt").exists()


def test_concurrent_cli_checkouts_to_one_path_each_leave_one_whole_commit(repo, tmp_path):
    states = [{"w": torch.full((1 << 20,), float(i)), "b": torch.full((1 << 18,), -float(i))} for i in (1, 2)]
    ids = []
    for state in states:
        torch.save(state, repo.root / "ckpt.pt")
        ids.append(repo.commit(repo.root / "ckpt.pt"))
    target = tmp_path / "out" / "x.pt"
    target.parent.mkdir()
    for trial in range(TRIALS):
        procs = [_ckpt(repo.root, "checkout", ids[(i + trial) % 2], "-o", str(target)) for i in range(2)]
        errors = [p.communicate(timeout=180)[1] for p in procs]
        assert [p.returncode for p in procs] == [0] * 2, (trial, errors)
        back = torch.load(target, weights_only=True)
        assert any(back["w"].equal(s["w"]) and back["b"].equal(s["b"]) for s in states), f"trial {trial}: torn"
        assert [p.name for p in target.parent.iterdir()] == ["x.pt"]  # no temporaries left behind


def test_config_is_replaced_atomically(repo):
    path = repo.dir / "config.toml"
    before = path.stat().st_ino
    config = RepoConfig.load(path)
    config.threads = 3
    config.save(path)
    assert path.stat().st_ino != before  # a new file renamed into place, never truncated and rewritten
    assert RepoConfig.load(path).threads == 3 and sorted(p.name for p in repo.dir.glob("*config*")) == ["config.toml"]


@pytest.mark.parametrize("edit, words", [
    (("threads = 0", 'threads = "x"'), "threads must be a count"), (("threads = 0", "threads = -3"), "threads must"),
    (('metadata_url = ""', "metadata_url = 5"), "metadata_url must be a string"),
    (("[core]", "core = 1\n[corex]"), "[core] must be a table"),
    (("chunk_bytes = 4194304", "chunk_bytes = 0"), "chunk_bytes must be an integer from 1"),
    (("zstd_level = 1", "zstd_level = 99"), "zstd_level must be an integer from -131072 to 22"),
])
def test_a_hand_edited_config_of_the_wrong_type_is_one_clear_error(repo, edit, words):
    path = repo.dir / "config.toml"
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(CkptError, match="cannot read .*config.toml") as caught:
        RepoConfig.load(path)
    assert words in str(caught.value)


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def test_diff_of_trainer_folders_reports_every_kind_of_entry(repo, monkeypatch):
    run = make_trainer_folder(repo.root / "run")
    torch.save({"zero": torch.zeros(4), "steps": torch.tensor([1, 2])}, run / "extra.pt")
    repo.commit(run)
    shutil.rmtree(run)
    make_trainer_folder(run, seed=1)
    torch.save({"zero": torch.ones(4), "steps": torch.tensor([3, 4])}, run / "extra.pt")
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 123456, "log_history": [1, 2]}))
    repo.commit(run)
    monkeypatch.chdir(repo.root)
    result = CliRunner().invoke(cli, ["diff", "HEAD~1", "HEAD", "--json"], catch_exceptions=False)
    rows = {r["path"]: r for r in json.loads(result.output, parse_constant=_no_constants)}
    assert rows["extra.pt/zero"]["relative_l2"] == "inf" and rows["extra.pt/steps"]["relative_l2"] is None
    assert rows["trainer_state.json/%25blob"]["status"] == "changed"
    assert rows["model.safetensors/%header"]["status"] == "unchanged"
    assert 0 < rows["model.safetensors/bert.weight"]["relative_l2"] < 10
    text = CliRunner().invoke(cli, ["diff", "HEAD~1", "HEAD"], catch_exceptions=False).output
    assert "rel_l2=inf" in text and "trainer_state.json" in text


@pytest.mark.parametrize("before, after", [(b"hello world\n", b"hello again\n"), (b"a,b,c\n", b"a,b,d\n"),
                                           (b"J\x01", b"J\x02"), (b"\x80\xfc", b"\x80\xfd")])
def test_diff_of_a_changed_text_file_in_a_folder_says_changed(repo, before, after, monkeypatch):
    """Any bytes entry went to torch's restricted unpickler to be compared by value: KeyError, "please report it"."""
    run = repo.root / "run"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "model.pt")
    for text in (before, after):
        (run / "notes.txt").write_bytes(text)
        repo.commit(run)
    monkeypatch.chdir(repo.root)
    result = CliRunner().invoke(cli, ["diff", "HEAD~1", "HEAD"])
    assert result.exit_code == 0 and "changed notes.txt/%25blob" in result.output, result.output
    assert "warning" not in result.output


def test_diff_of_safetensors_whose_metadata_changed(repo):
    from safetensors.torch import save_file

    path = repo.root / "m.safetensors"
    for meta in ({"format": "pt"}, {"format": "pt", "note": "a much longer metadata value" * 3}):
        save_file({"w": torch.ones(3)}, path, metadata=meta)
        repo.commit(path)
    rows = {r.path: r for r in repo.diff("HEAD~1", "HEAD")}
    assert rows["%header"].status == "changed" and rows["%header"].relative_l2 is None
    assert rows["w"].status == "unchanged"
    assert_same(repo.checkout("HEAD")["w"], torch.ones(3))


@pytest.mark.parametrize("name, message", [("../escape.json", "outside its folder"), ("/etc/x", "outside its folder"),
                                           (".ckpt/ckpt.db", "repository's own .ckpt/"),
                                           (".git/config", "one of git's own files"),  # a remote's: hooks ran
                                           ("sub/.GIT/hooks/post-checkout", "one of git's own files")])
def test_file_names_a_commit_may_not_write(repo, name, message):
    """A manifest from elsewhere (or from before commits left out .ckpt/) never writes outside its folder."""
    from ckptstore.formats import CheckpointFile
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.worktree import plan_checkout

    manifest = Manifest("folder", [CheckpointFile("ok.json", "blob", ["blob", "a"]),
                                   CheckpointFile(name, "blob", ["blob", "b"])], {}, {})
    with pytest.raises(CkptError, match=message):
        plan_checkout(repo, manifest, repo.root, force=True, output=False)
    if "git" in message:  # with -o too (auditor helper 308: a clone's `checkout -o DIR` wrote a working .git/)
        with pytest.raises(CkptError, match=message):
            plan_checkout(repo, manifest, repo.root / "out", force=False, output=True)


def test_a_path_inside_a_git_folder_is_refused_at_commit_not_called_forged_at_checkout(repo):
    """`ckpt commit f/.git/m.pt` was recorded, then its checkout in place refused as "forged" (docs audit 320)."""
    (repo.root / "f" / ".Git").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, repo.root / "f" / ".Git" / "m.pt")
    for path in (repo.root / "f" / ".Git" / "m.pt", repo.root / "f" / ".Git"):
        with pytest.raises(CheckpointFormatError, match="is inside a .git folder, git's own files"):
            repo.commit(path)
    assert repo.head()[1] is None  # nothing was recorded


def _hub_clone_committed(repo) -> str:
    """A Trainer folder holding git's files (a model cloned from a hub, a worktree pointer below), committed."""
    make_trainer_folder(repo.root / "ck")
    (repo.root / "ck" / ".git" / "hooks").mkdir(parents=True)
    (repo.root / "ck" / ".git" / "config").write_text("[core]\n")
    (repo.root / "ck" / "sub").mkdir()
    (repo.root / "ck" / "sub" / ".Git").write_text("gitdir: elsewhere\n")
    with pytest.warns(RuntimeWarning, match="git.s own files are no checkpoint"):
        return repo.commit(repo.root / "ck")


def test_a_folder_commit_leaves_git_s_own_files_out_and_says_so(repo):
    """A folder holding a git clone (a model from a hub) committed its .git/; no checkout writes one back."""
    cid = _hub_clone_committed(repo)
    names = [record.name for record in repo.manifest(cid).files]
    assert names and not [name for name in names if ".git" in name.lower()]


def test_a_checkout_in_place_neither_counts_nor_deletes_the_git_files_a_commit_left_out(repo):
    """`checkout --force` deleted a hub clone's .git/ as untracked, and status listed its files (auditor 417)."""
    cid = _hub_clone_committed(repo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # status commits nothing: no "left out of the commit"
        assert [f for f in repo.status()["files"] if f["state"] != "unchanged"] == []
    repo.checkout_to(cid)  # refused before: it would delete .git's files
    repo.checkout_to(cid, force=True)
    assert (repo.root / "ck" / ".git" / "config").read_text() == "[core]\n"
    assert (repo.root / "ck" / "sub" / ".Git").read_text() == "gitdir: elsewhere\n"


_NAMES = st.lists(st.sampled_from("abc"), min_size=1, max_size=3).map("/".join)


def _layouts():
    """{name: (bytes, mode)} with no name both a file and a folder."""
    files = st.dictionaries(_NAMES, st.tuples(st.binary(max_size=40), st.sampled_from([0o600, 0o644, 0o755])),
                            min_size=1, max_size=6)
    return files.filter(lambda d: not any(b.startswith(a + "/") for a in d for b in d))


def _write_layout(folder, layout):
    if folder.exists():
        shutil.rmtree(folder)
    for name, (data, mode) in layout.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        os.chmod(folder / name, mode)


@machine_settings(scale=0.4)
@given(first=_layouts(), second=_layouts())
def test_checkouts_between_any_two_layouts_give_exactly_each(first, second):
    from ckptstore import Repository

    with tempfile.TemporaryDirectory() as tmp, Repository.init(tmp) as repo:
        run = repo.root / "run"
        ids = []
        for layout in (first, second):
            _write_layout(run, layout)
            ids.append(repo.commit(run, allow_empty=True))
        for cid, layout in [(ids[0], first), (ids[1], second), (ids[0], first)]:
            repo.checkout_to(cid)
            on_disk = {p.relative_to(run).as_posix(): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
                       for p in run.rglob("*") if p.is_file()}
            assert on_disk == layout
            assert all(any(f.startswith(p.relative_to(run).as_posix() + "/") for f in layout)
                       for p in run.rglob("*") if p.is_dir())  # no folder left that the commit lacks


@pytest.mark.parametrize("force", [False, True])
def test_checkout_with_output_writes_the_commits_files_and_deletes_nothing(repo, tmp_path, force):
    run = make_trainer_folder(repo.root / "run")
    cid = repo.commit(run)
    wanted = _files(run)
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)
    (out / "mine.txt").write_text("my only copy")
    (out / "tokenizer" / "extra.txt").write_text("also mine")
    args = ["checkout", cid, "-o", str(out)] + (["--force"] if force else [])
    proc = _ckpt(repo.root, *args)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 0 and err.startswith("warning: ") and err.count("\n") == 1, err
    assert "also holds files this commit does not (mine.txt, tokenizer/extra.txt): left as they were" in err
    got = _files(out)
    assert got.pop("mine.txt") == b"my only copy" and got.pop("tokenizer/extra.txt") == b"also mine"
    assert got == wanted  # bit-exact: a lossless commit writes its files back byte for byte


def test_a_checkout_of_the_branch_elsewhere_does_not_end_a_pull_killed_before_it_wrote_its_files(tmp_path):
    """`checkout BRANCH -o ELSEWHERE` after a pull killed before it wrote its files ended that pull as an in-place
    checkout does: the files in place kept the old commit, and the next pull found nothing to do
    (mutation audit round 8)."""
    with Repository.init(tmp_path / "work") as work:
        torch.save({"w": torch.zeros(8)}, tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
        with remote.clone(str(tmp_path / "work"), tmp_path / "copy") as copy:
            copy.checkout_to("main")
        torch.save({"w": torch.ones(8)}, tmp_path / "work" / "c.pt")
        work.commit(tmp_path / "work" / "c.pt")
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "pull"], cwd=tmp_path / "copy",
                            env=ckpt_env(CKPT_CRASH_AT="checkout:records-read"), timeout=120)
    assert killed.returncode == -9  # the branch moved, c.pt not yet written
    load = lambda path: torch.load(path, weights_only=True)["w"]
    with Repository.open(tmp_path / "copy") as copy:
        copy.checkout_to("main", tmp_path / "elsewhere.pt")
        assert_same(torch.ones(8), load(tmp_path / "elsewhere.pt"))
        assert_same(torch.zeros(8), load(tmp_path / "copy" / "c.pt"))
        assert (copy.dir / remote.PULLING).exists()  # still the pull's to finish
        remote.pull(copy, "origin")
        assert not (copy.dir / remote.PULLING).exists()
    assert_same(torch.ones(8), load(tmp_path / "copy" / "c.pt"))


def test_an_in_place_checkout_never_deletes_an_object_store_kept_outside_the_repository(tmp_path):
    from ckptstore import Repository

    with Repository.init(tmp_path / "r", objects_url="../objects") as repo:  # <root>/objects, beside .ckpt/
        torch.save({"w": torch.arange(1000.0)}, repo.root / "model.pt")
        first = repo.commit(repo.root)
        torch.save({"w": torch.arange(2000.0)}, repo.root / "model.pt")
        repo.commit(repo.root)
        assert [f.name for f in repo.manifest(first).files] == ["model.pt"]  # the store is never committed
        stored = sorted(p for p in (repo.root / "objects").rglob("*") if p.is_file())
        repo.checkout_to(first, force=True)
        assert sorted(p for p in (repo.root / "objects").rglob("*") if p.is_file()) == stored
        assert torch.load(repo.root / "model.pt", weights_only=True)["w"].equal(torch.arange(1000.0))
        assert repo.checkout("main")["model.pt"]["w"].equal(torch.arange(2000.0))  # every object still readable


def test_a_lossy_commit_does_not_make_its_full_precision_source_count_as_saved(repo):
    path = repo.root / "model.pt"
    weight = lambda seed: {"model": {"fc.weight": torch.randn(300, 100, generator=torch.Generator().manual_seed(seed))}}
    torch.save(weight(0), path)
    first = repo.commit(path)
    torch.save(weight(1), path)
    original = path.read_bytes()
    lossy = repo.commit(path, lossy="balanced")
    assert not repo.checkout(lossy)["model"]["fc.weight"].equal(weight(1)["model"]["fc.weight"])  # stored lossily
    with pytest.raises(DirtyWorktreeError, match="overwrite .*model.pt, whose content is not in the store"):
        repo.checkout_to(first)
    assert path.read_bytes() == original
    repo.checkout_to(first, force=True)
    assert path.read_bytes() != original and torch.load(path, weights_only=True)["model"]["fc.weight"].equal(
        weight(0)["model"]["fc.weight"])
    repo.checkout_to(lossy)  # c1's bytes are known: no refusal; the lossy file written is recorded
    repo.checkout_to(first)


def test_a_lossy_folder_checked_out_over_itself_names_only_its_lossy_originals(repo):
    """The files a lossy commit keeps exact were listed as 'not in the store', with the advice to commit them,
    which said 'nothing changed': now they count as saved, and the originals are named as the commit's (auditor)."""
    from safetensors.torch import save_file

    folder = repo.root / "out" / "checkpoint-10"
    folder.mkdir(parents=True)
    save_file({"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(0))}, folder / "model.safetensors")
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")  # integers only: stored exactly
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    lossy = repo.commit(folder, lossy="balanced", step=10)
    for output in (folder, None):
        with pytest.raises(DirtyWorktreeError) as info:
            repo.checkout_to(lossy, output=output)
        said = str(info.value)
        assert f"model.safetensors: the files lossy commit {lossy[:12]} was made from" in said, said
        assert "rng_state" not in said and "trainer_state" not in said and "commit it first" not in said
        assert "--force to write its lossy reconstruction over them" in said
    repo.checkout_to(lossy, output=folder, force=True)  # its reconstruction, now known: no refusal next time
    repo.checkout_to(lossy)


def test_checkout_with_output_refuses_a_file_where_the_commit_has_a_folder(repo, tmp_path):
    cid = repo.commit(make_trainer_folder(repo.root / "run"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer").write_text("mine")  # -o deletes nothing: an error, not a loss
    with pytest.raises(CkptError, match="tokenizer is a file where the commit has a folder"):
        repo.checkout_to(cid, output=tmp_path / "out", force=True)
    assert (tmp_path / "out" / "tokenizer").read_text() == "mine"



def test_a_folder_checkout_that_fails_part_way_leaves_the_folder_as_it_was(repo, monkeypatch):
    """Every file is written beside its target before any is replaced or deleted: never one file of each commit."""
    from ckptstore import formats

    run = repo.root / "run"
    run.mkdir()
    torch.save({"w": torch.zeros(4)}, run / "a_model.pt")
    torch.save({"m": torch.zeros(4)}, run / "b_optimizer.pt")
    first = repo.commit(run, message="first")
    torch.save({"w": torch.ones(4)}, run / "a_model.pt")
    torch.save({"m": torch.ones(4)}, run / "b_optimizer.pt")
    (run / "c_extra.json").write_text("{}")
    repo.commit(run, message="second")
    before = _files(run)
    written = []
    write_file = formats.write_file

    def fills_the_disk_at_the_second_file(record, path, *args):  # a unit's fault: the disk fills mid-checkout
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        return write_file(record, path, *args)

    monkeypatch.setattr(formats, "write_file", fills_the_disk_at_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        repo.checkout_to(first)
    assert _files(run) == before  # both files of the second commit, its extra file, no temporary file
    monkeypatch.setattr(formats, "write_file", write_file)
    repo.checkout_to(first)
    assert torch.equal(torch.load(run / "a_model.pt", weights_only=True)["w"], torch.zeros(4))
    assert sorted(p.name for p in run.iterdir()) == ["a_model.pt", "b_optimizer.pt"]


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_a_file_written_while_the_checkout_reads_the_commit_is_never_overwritten(repo, monkeypatch, partial):
    """The unsaved-file check comes before decoding (seconds on a large checkpoint): each target is checked again.

    A partial checkout (`--only`) onto the file did not check again, and replaced it.
    """
    import threading

    path = repo.root / "ckpt.pt"
    torch.save({"w": torch.zeros(4)}, path)
    first = repo.commit(path)
    torch.save({"w": torch.ones(4)}, path)
    repo.commit(path)
    gate = repo.root / "gate"
    monkeypatch.setenv("CKPT_WAIT_AT", f"checkout:records-read={gate}")
    failures = []
    how = {"output": path, "keys": ["w"]} if partial else {}
    checking_out = threading.Thread(target=lambda: _record_failure(failures, lambda: repo.checkout_to(first, **how)))
    checking_out.start()
    while not Path(f"{gate}.reached").exists():
        assert checking_out.is_alive()
        time.sleep(0.02)
    torch.save({"w": torch.full((4,), 7.0)}, path)  # the training job saves meanwhile: in no commit yet
    gate.touch()
    checking_out.join(timeout=60)
    assert len(failures) == 1 and isinstance(failures[0], DirtyWorktreeError), failures
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((4,), 7.0))
    assert [p.name for p in repo.root.iterdir() if p.name.startswith(".ckpt.pt")] == []  # no staging file left


def test_a_file_the_commit_lacks_written_while_the_checkout_reads_the_commit_is_never_deleted(repo, monkeypatch):
    """A file the target commit lacks is re-checked before its deletion, as targets are (mutation audit)."""
    import threading

    run = repo.root / "run"
    run.mkdir()
    torch.save({"w": torch.ones(8)}, run / "a.pt")
    first = repo.commit(run, message="one")
    torch.save({"w": torch.zeros(8)}, run / "a.pt")
    (run / "notes.txt").write_text("committed notes\n")
    second = repo.commit(run, message="two")
    gate = repo.root / "gate"
    monkeypatch.setenv("CKPT_WAIT_AT", f"checkout:records-read={gate}")
    failures = []
    checking_out = threading.Thread(target=lambda: _record_failure(failures, lambda: repo.checkout_to(first)))
    checking_out.start()
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{gate}.reached").exists():
            assert checking_out.is_alive() and time.monotonic() < deadline, failures
            time.sleep(0.02)
        (run / "notes.txt").write_text("new notes, in no commit\n")  # the user writes meanwhile
    finally:
        gate.touch()
        checking_out.join(timeout=60)
    assert not checking_out.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], DirtyWorktreeError), failures
    assert "notes.txt" in str(failures[0]) and "changed while the checkout read" in str(failures[0])
    assert (run / "notes.txt").read_text() == "new notes, in no commit\n"
    assert torch.equal(torch.load(run / "a.pt", weights_only=True)["w"], torch.zeros(8))  # nothing replaced
    assert repo.head()[1] == second


def _record_failure(failures, fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        failures.append(exc)


def _two_folder_commits(tmp_path):
    """A folder of three files committed twice (the second adds a file); returns the folder and the first commit."""
    from ckptstore import Repository

    folder = tmp_path / "run"
    folder.mkdir()
    for name, seed in _SEEDS.items():
        torch.save({"w": torch.full((8,), float(seed))}, folder / name)
    with Repository.init(tmp_path) as repo:
        first = repo.commit(folder)
        for name, seed in _SEEDS.items():
            torch.save({"w": torch.full((8,), float(seed + 10))}, folder / name)
        (folder / "only-in-second.txt").write_text("x")
        repo.commit(folder)
    return folder, first


_SEEDS = {"a.pt": 1, "b.pt": 2, "c.pt": 3}


def _values(folder):
    return {p.name: torch.load(p, weights_only=True)["w"][0].item() for p in folder.glob("*.pt")}


def _at_first_commit(tmp_path, folder, first):
    """The files, HEAD and status all say the first commit (HEAD detached there: it was checked out by id)."""
    from ckptstore import Repository

    with Repository.open(tmp_path) as repo:  # any command that opens the repository for writing
        assert _values(folder) == {name: float(seed) for name, seed in _SEEDS.items()}
        assert not (folder / "only-in-second.txt").exists() and not list(folder.glob(".*"))
        assert not list((tmp_path / ".ckpt" / "journals").iterdir())
        assert repo.head() == (None, first)  # it stayed at the second commit: the files read as changes
        assert {f["state"] for f in repo.status()["files"]} == {"unchanged"}


def test_a_folder_checkout_killed_among_its_renames_is_finished_by_the_next_command(tmp_path):
    folder, first = _two_folder_commits(tmp_path)
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "checkout", first[:12]], cwd=tmp_path,
                            env=ckpt_env(CKPT_CRASH_AT="checkout:renamed"),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert sorted(_values(folder).values()) == [1.0, 12.0, 13.0]  # one file of the first commit, two of the second
    _at_first_commit(tmp_path, folder, first)


def test_a_folder_checkout_killed_after_its_renames_makes_the_commits_empty_folders_when_finished(tmp_path):
    """A checkout in place killed among its renames was finished by the next command, but the commit's empty folders
    (a trainer's runs/) were not made: the journal did not name them. It does, and the finishing step makes them."""
    from ckptstore import Repository

    folder = tmp_path / "run"
    for empty in ("runs", "optimizer/shards"):
        (folder / empty).mkdir(parents=True)
    for name, seed in _SEEDS.items():
        torch.save({"w": torch.full((8,), float(seed))}, folder / name)
    with Repository.init(tmp_path) as repo:
        first = repo.commit(folder)
        shutil.rmtree(folder / "runs")
        shutil.rmtree(folder / "optimizer")
        for name, seed in _SEEDS.items():
            torch.save({"w": torch.full((8,), float(seed + 10))}, folder / name)
        repo.commit(folder)
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "checkout", first[:12]], cwd=tmp_path,
                            env=ckpt_env(CKPT_CRASH_AT="checkout:renamed"),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert not (folder / "runs").exists() and not (folder / "optimizer").exists()  # killed before it made them
    with Repository.open(tmp_path) as repo:  # any command that opens the repository for writing finishes it
        assert repo.head() == (None, first)
    assert _values(folder) == {name: float(seed) for name, seed in _SEEDS.items()}
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_dir()) == \
        ["optimizer", "optimizer/shards", "runs"]
    assert not any((folder / "runs").iterdir()) and not list((tmp_path / ".ckpt" / "journals").iterdir())


def test_a_journal_of_an_earlier_version_naming_no_folders_to_make_is_still_finished(tmp_path):
    """Journals written before they named the empty folders to make are carried out as before."""
    from ckptstore.repo import journal

    (tmp_path / "journals").mkdir()
    (tmp_path / "run").mkdir()
    staged, target = tmp_path / "run" / ".a.pt.tmp", tmp_path / "run" / "a.pt"
    staged.write_bytes(b"new")
    plan = {"root": str(tmp_path), "renames": [[str(staged), str(target), None]], "deletions": [], "head": None}
    (tmp_path / "journals" / "0123.json").write_text(json.dumps(plan))
    assert journal.finish_interrupted(tmp_path) == 1
    assert target.read_bytes() == b"new" and not staged.exists() and not list((tmp_path / "journals").iterdir())


def test_a_folder_checkout_that_fails_among_its_renames_keeps_its_journal_for_the_next_command(tmp_path):
    """A failure (a full disk) after the first rename left files of both commits, deleted the journal and the staged
    files, and said "the interrupted write is undone": the journal now stays, and the next command finishes it."""
    folder, first = _two_folder_commits(tmp_path)
    failed = subprocess.run([sys.executable, "-m", "ckptstore", "checkout", first[:12]], cwd=tmp_path,
                            env=ckpt_env(CKPT_FAIL_AT="checkout:renamed"), capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert "undone" not in failed.stderr and "run any ckpt command" in failed.stderr, failed.stderr
    assert sorted(_values(folder).values()) == [1.0, 12.0, 13.0]  # one file of the first commit, two of the second
    assert len(list((tmp_path / ".ckpt" / "journals").glob("*.json"))) == 1
    _at_first_commit(tmp_path, folder, first)


def test_a_file_where_the_journals_folder_belongs_is_one_clear_error_and_the_checkout_touches_nothing(tmp_path):
    """It was "unexpected NotADirectoryError" (the temporary journal's cleanup failed as the write had)."""
    from ckptstore import Repository

    folder, first = _two_folder_commits(tmp_path)
    second = _second_commit(tmp_path)
    shutil.rmtree(tmp_path / ".ckpt" / "journals", ignore_errors=True)
    (tmp_path / ".ckpt" / "journals").write_text("x")
    before = _files(folder)
    with Repository.open(tmp_path) as repo:
        with pytest.raises(CkptError, match=r"journals is not a folder .*move it away"):
            repo.checkout_to(first)
        assert repo.head() == ("main", second)
    assert _files(folder) == before  # no file replaced, no staged file left


def _checkout_held_after_its_first_rename(root, commit: str, release) -> subprocess.Popen:
    """`ckpt checkout COMMIT` in a process of its own, held after its first rename until `release` exists."""
    return subprocess.Popen([sys.executable, "-m", "ckptstore", "checkout", commit[:12]], cwd=root,
                            env=ckpt_env(CKPT_WAIT_AT=f"checkout:renamed={release}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_folder_checkout_interrupted_among_its_renames_finishes_them_and_moves_head(tmp_path):
    from tests.conftest import wait_until_held

    folder, first = _two_folder_commits(tmp_path)
    release = tmp_path / "release"
    checkout = _checkout_held_after_its_first_rename(tmp_path, first, release)
    wait_until_held(release, checkout)
    checkout.send_signal(signal.SIGINT)
    _, err = checkout.communicate(timeout=120)
    assert checkout.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    _at_first_commit(tmp_path, folder, first)


def _second_commit(tmp_path):
    from ckptstore import Repository

    with Repository.open(tmp_path) as repo:
        branch, second = repo.head()
    assert branch == "main"
    return second


def _user_saves_the_files_not_yet_renamed(folder):
    """The training job saves anew the files still at the second commit (a new size: a new stamp); returns them."""
    later = sorted(name for name, value in _values(folder).items() if value != _SEEDS[name])
    assert len(later) == 2, _values(folder)  # one rename was done
    for name in later:
        torch.save({"w": torch.full((16,), 99.0)}, folder / name)
    return later


def test_a_command_run_while_a_checkout_is_among_its_renames_never_carries_out_that_checkouts_journal(tmp_path):
    """A journal's flock says its checkout is alive: another process leaves it alone, and the checkout ends
    as it would have (mutation audit)."""
    from tests.conftest import wait_until_held

    folder, first = _two_folder_commits(tmp_path)
    journals = tmp_path / ".ckpt" / "journals"
    release = tmp_path / "release"
    checkout = _checkout_held_after_its_first_rename(tmp_path, first, release)
    try:
        wait_until_held(release, checkout)
        meanwhile = ckpt_here(tmp_path, "log", timeout=120)  # opens the repository: finishes dead checkouts' journals
        assert meanwhile.returncode == 0, meanwhile.stderr
        assert len(list(journals.glob("*.json"))) == 1  # the live checkout's, left to it
        assert sorted(_values(folder).values()) == [1.0, 12.0, 13.0]  # no rename done for it
        release.touch()
        _, err = checkout.communicate(timeout=120)
        assert checkout.returncode == 0 and "Traceback" not in err, err
    finally:
        release.touch()
        if checkout.poll() is None:
            checkout.kill()
            checkout.communicate()
    _at_first_commit(tmp_path, folder, first)


def test_a_checkout_killed_among_its_renames_leaves_head_where_it_was_if_the_user_saved_meanwhile(tmp_path):
    """HEAD moves only after every rename: a kill among them, then a new save of a target not yet renamed,
    leaves HEAD at the commit the files mostly are (mutation audit)."""
    from ckptstore import Repository

    folder, first = _two_folder_commits(tmp_path)
    second = _second_commit(tmp_path)
    killed = subprocess.run([sys.executable, "-m", "ckptstore", "checkout", first[:12]], cwd=tmp_path,
                            env=ckpt_env(CKPT_CRASH_AT="checkout:renamed"),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    later = _user_saves_the_files_not_yet_renamed(folder)
    with Repository.open(tmp_path) as repo:  # finishes the journal: the user's files stay
        assert repo.head() == ("main", second)
    assert {name: value for name, value in _values(folder).items() if name in later} == dict.fromkeys(later, 99.0)
    assert not list((tmp_path / ".ckpt" / "journals").iterdir())


def test_a_checkout_interrupted_among_its_renames_leaves_head_where_it_was_if_the_user_saved_meanwhile(tmp_path):
    """Ctrl-C finishes the renames it may; one left undone (the user saved that target anew) leaves HEAD
    where it was (mutation audit)."""
    from ckptstore import Repository
    from tests.conftest import wait_until_held

    folder, first = _two_folder_commits(tmp_path)
    second = _second_commit(tmp_path)
    release = tmp_path / "release"
    checkout = _checkout_held_after_its_first_rename(tmp_path, first, release)
    try:
        wait_until_held(release, checkout)
        later = _user_saves_the_files_not_yet_renamed(folder)
        checkout.send_signal(signal.SIGINT)
        _, err = checkout.communicate(timeout=120)
        assert checkout.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    finally:
        release.touch()
        if checkout.poll() is None:
            checkout.kill()
            checkout.communicate()
    assert {name: value for name, value in _values(folder).items() if name in later} == dict.fromkeys(later, 99.0)
    with Repository.open(tmp_path) as repo:
        assert repo.head() == ("main", second)
    assert not list((tmp_path / ".ckpt" / "journals").iterdir())


def test_a_finished_journal_leaves_files_the_user_wrote_since_the_crash(tmp_path):
    from ckptstore.repo import journal

    (tmp_path / ".ckpt").mkdir()
    old, extra, staged = tmp_path / "w.pt", tmp_path / "extra.txt", tmp_path / ".w.pt.new-1.ckpt-tmp"
    old.write_text("old")
    extra.write_text("extra")
    staged.write_text("new")
    plan = {"root": str(tmp_path / ".ckpt"), "renames": [[str(staged), str(old), journal._stamp(old)]],
            "deletions": [[str(extra), journal._stamp(extra)]]}
    (tmp_path / ".ckpt" / "journals").mkdir()
    (tmp_path / ".ckpt" / "journals" / "a.json").write_text(json.dumps(plan))  # as a killed checkout left it
    time.sleep(0.01)
    old.write_text("the user's")  # written after the crash, before the next command
    extra.write_text("the user's too")
    assert journal.finish_interrupted(tmp_path / ".ckpt") == 1
    assert old.read_text() == "the user's" and extra.read_text() == "the user's too" and not staged.exists()


def test_a_journal_of_forged_nesting_is_a_warning_and_the_repository_opens(tmp_path):
    from ckptstore import Repository

    Repository.init(tmp_path).close()
    (tmp_path / ".ckpt" / "journals").mkdir()
    (tmp_path / ".ckpt" / "journals" / "a.json").write_text("[" * 100_000)
    with pytest.warns(RuntimeWarning, match="could not be finished"), Repository.open(tmp_path) as repo:
        assert repo.log() == []


def test_a_journal_that_cannot_be_finished_is_one_warning_and_the_command_goes_on(tmp_path):
    from ckptstore import Repository

    with Repository.init(tmp_path):
        pass
    (tmp_path / "afile").write_text("a file where the journal wants a folder")
    staged = tmp_path / ".x.new-1.ckpt-tmp"
    staged.write_text("new")
    plan = {"root": str(tmp_path / ".ckpt"), "renames": [[str(staged), str(tmp_path / "afile" / "x"), None]],
            "deletions": []}
    (tmp_path / ".ckpt" / "journals").mkdir()
    (tmp_path / ".ckpt" / "journals" / "a.json").write_text(json.dumps(plan))
    with pytest.warns(RuntimeWarning, match="an interrupted checkout's journal .* could not be finished"):
        with Repository.open(tmp_path) as repo:
            assert repo.log() == []
    with Repository.open(tmp_path):  # said once: the journal is gone
        assert not list((tmp_path / ".ckpt" / "journals").iterdir())


def test_temporary_files_that_killed_checkouts_left_beside_a_target_are_removed_after_an_hour(tmp_path):
    from ckptstore import Repository

    torch.save({"w": torch.ones(4)}, tmp_path / "w.pt")
    stale = [tmp_path / ".w.pt.new-0123456789abcdef.ckpt-tmp",
             tmp_path / "..w.pt.new-0123456789abcdef.ckpt-tmp.fedcba9876543210.ckpt-tmp"]
    kept = [tmp_path / ".w.pt.new-1111111111111111.ckpt-tmp",  # an hour has not passed: maybe a checkout at work
            tmp_path / ".w.pt.notes"]  # not a name ckptstore gives
    for path in stale + kept:
        path.write_bytes(b"x" * 100)
    old = time.time() - 2 * 3600
    for path in stale + kept[1:]:
        os.utime(path, (old, old))
    with Repository.init(tmp_path) as repo:
        repo.checkout_to(repo.commit(tmp_path / "w.pt"))
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_a_journal_from_another_place_or_unreadable_is_one_warning_and_touches_nothing(tmp_path):
    from ckptstore import Repository
    from ckptstore.repo import journal

    with Repository.init(tmp_path / "a"):
        pass
    (tmp_path / "a" / "w.pt").write_text("old")
    staged = tmp_path / "a" / ".w.pt.new-0123456789abcdef.ckpt-tmp"
    staged.write_text("new")
    plan = {"root": str(tmp_path / "a" / ".ckpt"), "deletions": [],
            "renames": [[str(staged), str(tmp_path / "a" / "w.pt"), journal._stamp(tmp_path / "a" / "w.pt")]]}
    (tmp_path / "a" / ".ckpt" / "journals").mkdir()
    (tmp_path / "a" / ".ckpt" / "journals" / "j.json").write_text(json.dumps(plan))
    (tmp_path / "a" / ".ckpt" / "journals" / "k.json").mkdir()  # cannot be read at all
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)  # a copy of the repository, journal and all
    with pytest.warns(RuntimeWarning, match="copied or moved since"):
        Repository.open(tmp_path / "b").close()
    assert (tmp_path / "a" / "w.pt").read_text() == "old" and staged.exists()  # the original's files untouched
    with pytest.warns(RuntimeWarning, match="k.json could not be finished"):
        Repository.open(tmp_path / "a").close()
    assert (tmp_path / "a" / "w.pt").read_text() == "new"  # its own journal, finished where it was written


def _clone_of_forged(tmp_path, source_path):
    """A clone of a repository whose one commit names its file `source_path` (a valid id over a forged record)."""
    import dataclasses
    import sqlite3

    from ckptstore import Repository
    from ckptstore.repo import remote

    origin = tmp_path / "origin"
    with Repository.init(origin) as repo:
        torch.save({"w": torch.ones(3)}, origin / "ck.pt")
        cid = repo.commit(origin / "ck.pt")
        forged = dataclasses.replace(repo.commit_info(cid), source_path=source_path)
    db = sqlite3.connect(origin / ".ckpt" / "ckpt.db")
    for table, column in [("commits", "id"), ("refs", "commit_id"), ("commit_tensors", "commit_id"),
                          ("known_files", "commit_id")]:
        db.execute(f"update {table} set {column} = ? where {column} = ?", (forged.computed_id(), cid))
    db.execute("update commits set source_path = ?", (source_path,))
    db.commit()
    db.close()
    return remote.clone(str(origin), tmp_path / "mine")


def test_a_cloned_commit_whose_path_climbs_out_of_the_work_tree_is_never_written_there(tmp_path):
    """A hostile remote's commit (a valid id over a forged `../x.pt`) wrote outside the clone at checkout."""
    with _clone_of_forged(tmp_path, "../escaped.pt") as copy:
        for step in (lambda: copy.checkout_to("main"), lambda: copy.status()):
            with pytest.raises(CkptError, match=r"'\.\./escaped\.pt', outside this work tree"):
                step()
        assert torch.equal(copy.checkout("main")["w"], torch.ones(3))  # in memory, and with -o, it still restores
    assert not (tmp_path / "escaped.pt").exists()


@pytest.mark.parametrize("source_path, message", [
    (".ckpt/objects/evil.pt", "inside the repository's own .ckpt/"),
    (".git/hooks/post-checkout", "inside a .git folder"),  # git would run it at its next checkout
    ("ck\0x.pt", "outside this work tree"),
])
def test_a_cloned_commit_never_writes_into_the_store_or_gits_files_in_place(tmp_path, source_path, message):
    with _clone_of_forged(tmp_path, source_path) as copy:
        with pytest.raises(CkptError, match=message):
            copy.checkout_to("main")
        copy.checkout_to("main", tmp_path / "out.pt")  # with -o it restores, where the user says
        assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.ones(3))
        assert not (copy.root / ".ckpt" / "objects" / "evil.pt").exists() and not (copy.root / ".git").exists()


@pytest.mark.parametrize("only", [None, ["run.sh"]], ids=["whole", "only"])
def test_a_files_recorded_mode_never_sets_setuid_setgid_or_sticky_bits(repo, tmp_path, monkeypatch, only):
    """Commits record only the permission bits; a manifest from elsewhere with 0o6777 made a setuid file."""
    from ckptstore.formats import CheckpointFile

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.sh").write_bytes(b"#!x")
    (run / "model.pt").write_bytes(b"weights")
    cid = repo.commit(run)
    parsed = CheckpointFile.from_json

    def with_setuid(record):  # the forged manifest's reading, as a crafted remote's would be read
        made = parsed(record)
        made.mode = None if made.mode is None else made.mode | 0o6000
        return made

    monkeypatch.setattr(CheckpointFile, "from_json", with_setuid)
    repo.checkout_to(cid, tmp_path / "out", keys=only)
    assert (tmp_path / "out" / "run.sh").read_bytes() == b"#!x"
    assert stat.S_IMODE((tmp_path / "out" / "run.sh").stat().st_mode) & 0o7000 == 0


def test_files_outside_the_work_tree_are_written_in_place_only_for_commits_made_here(tmp_path):
    """A fetched commit names a path another machine chose: in place, a clone wrote wherever a remote named."""
    from ckptstore import Repository
    from ckptstore.repo import remote

    outside = tmp_path / "scratch" / "model.pt"
    outside.parent.mkdir()
    torch.save({"w": torch.ones(2)}, outside)
    with Repository.init(tmp_path / "origin") as origin:
        first = origin.commit(outside, lossy="balanced")  # lossy: no file digests are kept
        torch.save({"w": torch.zeros(2)}, outside)
        origin.commit(outside)
        origin.checkout_to(first)  # made here: in place, and HEAD follows
        assert torch.equal(torch.load(outside, weights_only=True)["w"], torch.ones(2))
        assert origin.head() == (None, first) and origin.status()["files"][0]["state"] == "unchanged"
    outside.unlink()
    with remote.clone(str(tmp_path / "origin"), tmp_path / "clone") as clone:
        with pytest.raises(CkptError, match=f"made from {outside}, outside this work tree: it came from another "
                                            "repository, .* with -o PATH"):
            clone.checkout_to("main")
        assert not outside.exists()
        clone.checkout_to("main", tmp_path / "here.pt")
        assert torch.equal(torch.load(tmp_path / "here.pt", weights_only=True)["w"], torch.zeros(2))
        with pytest.raises(CkptError, match="came from another repository"):  # still, after the -o it advises
            clone.checkout_to("main")
        assert not outside.exists()


@pytest.mark.both_backends
def test_a_shared_repositorys_commit_of_files_outside_the_work_tree_is_written_in_place_by_no_machine(
        repo, tmp_path, metadata_url):
    """Every machine's commits meet in a shared database: one's `/home/x/.bashrc` commit was written on another's."""
    outside = tmp_path.parent / f"{tmp_path.name}-scratch" / "model.pt"  # the work tree is tmp_path
    outside.parent.mkdir()
    torch.save({"w": torch.ones(2)}, outside)
    first = repo.commit(outside)
    outside.unlink()
    if metadata_url:  # shared: the commit may be any machine's
        with pytest.raises(CkptError, match="outside this work tree: in a shared repository, .* with -o PATH"):
            repo.checkout_to(first)
        assert not outside.exists()
    else:  # this repository's own: in place, where it was committed from
        repo.checkout_to(first)
        assert torch.equal(torch.load(outside, weights_only=True)["w"], torch.ones(2))


def test_a_journal_finishes_heads_move_only_when_every_rename_was_done(tmp_path):
    """A checkout killed after its renames: the next process moves HEAD; a skipped rename or an older journal
    (no "head") moves nothing."""
    from ckptstore.repo import journal

    (tmp_path / ".ckpt" / "journals").mkdir(parents=True)
    target, staged = tmp_path / "w.pt", tmp_path / ".w.pt.new-1.ckpt-tmp"
    moves = []
    target.write_text("new")  # renamed already, as a kill after the renames leaves it
    plan = {"root": str(tmp_path / ".ckpt"), "renames": [[str(staged), str(target), None]], "deletions": [],
            "head": ["c1", "main"]}
    (tmp_path / ".ckpt" / "journals" / "a.json").write_text(json.dumps(plan))
    assert journal.finish_interrupted(tmp_path / ".ckpt", lambda *head: moves.append(head)) == 1
    assert moves == [("c1", "main")] and target.read_text() == "new"
    for head, user_wrote_since in ((["c2", None], True), (None, False)):
        staged.write_text("newer")
        plan = {"root": str(tmp_path / ".ckpt"), "renames": [[str(staged), str(target), journal._stamp(target)]],
                "deletions": [], **({"head": head} if head else {})}
        (tmp_path / ".ckpt" / "journals" / "a.json").write_text(json.dumps(plan))
        if user_wrote_since:
            time.sleep(0.01)
            target.write_text("the user's")
        assert journal.finish_interrupted(tmp_path / ".ckpt", lambda *head: moves.append(head)) == 1
        assert moves == [("c1", "main")]  # no other move: a rename was left undone, or the journal names none
    assert target.read_text() == "newer"


def test_status_of_a_lossy_heads_file_says_head_restores_only_an_approximation(tmp_path):
    """'unchanged' alone invites deleting the only full-precision copy of a lossy commit's file."""
    torch.save({"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02}, tmp_path / "c.pt")
    with Repository.init(tmp_path) as repo:
        repo.commit(tmp_path / "c.pt")
        assert [f["state"] for f in repo.status()["files"]] == ["unchanged"]
        repo.commit(tmp_path / "c.pt", lossy="balanced", allow_empty=True)
        (item,) = repo.status()["files"]
        assert item["state"] == "unchanged" and "lossy level balanced" in item["note"]
        assert "approximation" in item["note"]


def test_checkout_o_never_writes_two_files_onto_one_nor_into_the_repository_through_a_link(repo, tmp_path):
    """-o follows links inside its folder (in place they are replaced): where they lead is checked, not the names."""
    run = repo.root / "run"
    for name, text in (("a/b", "one"), ("c/b", "two"), ("x/config.toml", "[not a config]")):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    cid = repo.commit(run)
    out = tmp_path / "out"
    (out / "c").mkdir(parents=True)
    (out / "a").symlink_to("c")  # inside out/: a/b and c/b would both land on out/c/b
    with pytest.raises(CkptError, match="a/b and c/b would both be written to"):
        repo.checkout_to(cid, out)
    assert not (out / "c" / "b").exists()
    config = (repo.dir / "config.toml").read_bytes()
    (repo.root / "x").symlink_to(".ckpt")  # -o the repository's folder, a link inside it into .ckpt/, and --force
    with pytest.raises(CkptError, match=r"x/config.toml, which would be written inside the repository's own \.ckpt/"):
        repo.checkout_to(cid, repo.root, force=True)
    assert (repo.dir / "config.toml").read_bytes() == config


def test_a_one_file_output_spelled_as_a_folder_is_refused(repo, tmp_path):
    """`-o newdir/` made a file called newdir: the slash says a folder, and one file is written."""
    torch.save({"w": torch.ones(3)}, repo.root / "m.pt")
    repo.commit(repo.root / "m.pt")
    for args in (["checkout", "HEAD", "-o", "newdir/"], ["checkout", "HEAD", "-o", "newdir/", "--only", "w"],
                 ["export", "HEAD", "--format", "torch", "-o", "newdir/"]):
        said = ckpt_here(repo.root, *args)
        assert said.returncode == 1 and "names a folder (it ends with a slash)" in said.stderr, (args, said.stderr)
    assert not (repo.root / "newdir").exists()


def test_a_ckpt_folder_moved_elsewhere_and_linked_back_is_never_content_of_a_folder_commit(tmp_path):
    """A checkout of a commit of "." took the `.ckpt` link for a file the commit lacks and deleted it:
    the repository was gone from the work tree; committing "." refused the link (auditor)."""
    work, elsewhere = tmp_path / "work", tmp_path / "disk2"
    work.mkdir()
    elsewhere.mkdir()
    assert ckpt_here(work, "init").returncode == 0
    (work / "notes.txt").write_text("one")
    assert ckpt_here(work, "commit", ".", "-m", "one").returncode == 0
    shutil.move(work / ".ckpt", elsewhere / ".ckpt")
    (work / ".ckpt").symlink_to(elsewhere / ".ckpt")
    (work / "notes.txt").write_text("two")
    committed = ckpt_here(work, "commit", ".", "-m", "two")
    assert committed.returncode == 0, committed.stderr
    back = ckpt_here(work, "checkout", "HEAD~1")
    assert back.returncode == 0, back.stderr
    assert (work / ".ckpt").is_symlink() and (work / "notes.txt").read_text() == "one"
    assert sorted(p.name for p in work.iterdir()) == [".ckpt", "notes.txt"]
    assert [c["message"] for c in json.loads(ckpt_here(work, "log", "--all", "--json").stdout)] == ["two", "one"]


def test_names_near_name_max_in_multi_byte_characters_check_out(tmp_path):
    """Temporary names were cut at 120 characters, not bytes: a 225-byte name of "é"s committed and could never
    be written back, in place or with -o (auditor)."""
    folder = tmp_path / "ck"
    folder.mkdir()
    long_name = "é" * 110 + ".json"  # 225 bytes
    (folder / long_name).write_text("{}")
    assert ckpt_here(tmp_path, "init").returncode == 0
    assert ckpt_here(tmp_path, "commit", "ck").returncode == 0
    out = ckpt_here(tmp_path, "checkout", "HEAD", "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / long_name).read_text() == "{}"
    (folder / long_name).unlink()
    back = ckpt_here(tmp_path, "checkout", "HEAD")
    assert back.returncode == 0, back.stderr
    assert (folder / long_name).read_text() == "{}"


def test_status_lists_a_file_it_may_not_read_and_goes_on(tmp_path, monkeypatch):
    """A restored file of mode 000 stopped `ckpt status` at it, listing nothing (auditor). The OS's refusal is
    stood in for here: this machine's tests run as root, whom file modes do not stop."""
    from ckptstore.repo import worktree

    folder = tmp_path / "ck"
    folder.mkdir()
    for name in ("a.txt", "secret.txt", "z.txt"):
        (folder / name).write_text(name)
    with Repository.init(tmp_path) as repo:
        repo.commit(folder)
        real = worktree.file_digest

        def refusing(path):
            if path.endswith("secret.txt"):
                raise PermissionError(13, "Permission denied", path)
            return real(path)

        monkeypatch.setattr(worktree, "file_digest", refusing)
        states = {f["path"]: f["state"] for f in repo.status()["files"]}
        assert states == {"ck/a.txt": "unchanged", "ck/secret.txt": "unreadable (permission denied)",
                          "ck/z.txt": "unchanged"}
        real_is_file = Path.is_file  # a folder of mode 000 above it: even asking whether it is a file fails

        def refusing_is_file(path):
            if path.name == "a.txt":
                raise PermissionError(13, "Permission denied", str(path))
            return real_is_file(path)

        monkeypatch.setattr(Path, "is_file", refusing_is_file)
        assert repo.status()["files"][0]["state"] == "unreadable (permission denied)"


def test_a_folder_holding_another_repository_is_committed_without_that_repositorys_own_folder(tmp_path):
    """runs/exp1's .ckpt/ went into the outer commit: checking out an older one rolled exp1's database and objects
    back, and its later commits were gone from its log (auditor)."""
    import warnings

    inner = tmp_path / "runs" / "exp1"
    with Repository.init(tmp_path) as outer, Repository.init(inner) as nested:
        torch.save({"w": torch.ones(4)}, inner / "c.pt")
        first = nested.commit(inner / "c.pt")
        with pytest.warns(RuntimeWarning, match=r"other repositories' own folders or object stores inside .*runs are "
                                                r"left out of the commit \(.*exp1/\.ckpt\): commit in those"):
            outer.commit(tmp_path / "runs")
        assert [f["name"] for f in outer.show("HEAD")["files"]] == ["exp1/c.pt"]
        torch.save({"w": torch.zeros(4)}, inner / "c.pt")
        second = nested.commit(inner / "c.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outer.commit(tmp_path / "runs")
        outer.checkout_to("HEAD~1", force=True)
        assert torch.equal(torch.load(inner / "c.pt")["w"], torch.ones(4))
    with Repository.open(inner) as again:
        assert [c.id for c in again.log()] == [second, first]
    with Repository.open(tmp_path) as outer:
        with warnings.catch_warnings():  # the repository's own folder is no other repository
            warnings.simplefilter("error")
            outer.commit(tmp_path / "runs" / "exp1" / "c.pt")


@pytest.mark.parametrize("layout", ["store beside", "linked .ckpt"])
def test_another_repositorys_store_or_linked_folder_inside_a_committed_folder_survives_checkouts(tmp_path, layout):
    """Its object store beside its .ckpt/ was committed, then deleted by a checkout; a .ckpt/ linked in from
    another disk was deleted with its folder; `ckpt commit sub/.ckpt` rolled it back (reader)."""
    import warnings

    from ckptstore.repo import fsck

    inner = tmp_path / "run" / "sub"
    inner.mkdir(parents=True)
    if layout == "store beside":
        Repository.init(inner, objects_url="../sub/objs").close()
    else:
        Repository.init(tmp_path / "elsewhere").close()
        (inner / ".ckpt").symlink_to(tmp_path / "elsewhere" / ".ckpt")
    with Repository.open(inner) as nested:
        first = nested.commit({"w": torch.ones(4)})
    with Repository.init(tmp_path / "top") as outer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (tmp_path / "run" / "notes.txt").write_text("a")
        outer.commit(tmp_path / "run")
        assert [f["name"] for f in outer.show("HEAD")["files"]] == ["notes.txt"]
        (tmp_path / "run" / "notes.txt").write_text("b")
        outer.commit(tmp_path / "run")
        with Repository.open(inner) as nested:
            second = nested.commit({"w": torch.zeros(4)})
        outer.checkout_to("HEAD~1", force=True)  # in place: what deletes
        with pytest.raises(CkptError, match=r"another repository's own folder or object store: a repository is no"):
            outer.commit(inner / ".ckpt")
    assert (tmp_path / "run" / "notes.txt").read_text() == "a"
    with Repository.open(inner) as nested:
        assert [c.id for c in nested.log()] == [second, first] and fsck(nested).ok


@pytest.mark.parametrize("layout", ["store named", "store of a repository elsewhere", "link named otherwise"])
def test_another_repositorys_store_or_folder_committed_by_any_name_is_refused_or_left_out(tmp_path, layout):
    """Its store named directly, a store whose .ckpt/ lives elsewhere, and a .ckpt linked to `disk/meta` named as
    such were committed, and a checkout of the older commit rolled that repository back (reader)."""
    import warnings

    from ckptstore.repo import fsck

    run = tmp_path / "run"
    run.mkdir()
    if layout == "store named":
        Repository.init(run / "sub", objects_url=str(run / "sub" / "objs")).close()
        named, inner = run / "sub" / "objs", run / "sub"
    elif layout == "store of a repository elsewhere":
        Repository.init(tmp_path / "proj", objects_url=f"file://{run / 'objs'}").close()
        named, inner = None, tmp_path / "proj"
    else:
        Repository.init(tmp_path / "disk").close()
        (tmp_path / "disk" / ".ckpt").rename(tmp_path / "disk" / "meta")
        (run / "sub").mkdir()
        (run / "sub" / ".ckpt").symlink_to(tmp_path / "disk" / "meta")
        named, inner = tmp_path / "disk" / "meta", run / "sub"
    with Repository.open(inner) as nested:
        first = nested.commit({"w": torch.ones(4)})
    (run / "notes.txt").write_text("a")
    with Repository.init(tmp_path / "top") as outer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if named is not None:
            with pytest.raises(CkptError, match="another repository's own folder or object store"):
                outer.commit(named)
        outer.commit(run)
        assert [f["name"] for f in outer.show("HEAD")["files"]] == ["notes.txt"]
        (run / "notes.txt").write_text("b")
        outer.commit(run)
        with Repository.open(inner) as nested:
            second = nested.commit({"w": torch.zeros(4)})
        outer.checkout_to("HEAD~1", force=True)  # in place: what deletes
    assert (run / "notes.txt").read_text() == "a"
    with Repository.open(inner) as nested:
        assert [c.id for c in nested.log()] == [second, first] and fsck(nested).ok


def test_a_joined_repositorys_config_alone_is_another_repository_and_project_configs_are_not(tmp_path):
    """A shared repository joined on another machine keeps only config.toml in its .ckpt/: 691c420 asked for a
    database, store or lock beside it, so it was committed and deleted by a checkout; and a project's own
    config.toml beside an objects/ folder made every commit refused as "another repository's" (reader)."""
    import warnings

    from ckptstore.repo.config import RepoConfig

    run = tmp_path / "run"
    (run / "sub" / ".ckpt").mkdir(parents=True)
    RepoConfig(metadata_url="postgresql://ml@db/runs", objects_url="s3://bucket/runs").save(
        run / "sub" / ".ckpt" / "config.toml")
    (run / "exp1" / "objects").mkdir(parents=True)  # a project of the user's: a config and meshes
    (run / "exp1" / "config.toml").write_text("[model]\nlayers = 4\n")
    torch.save({"w": torch.ones(4)}, run / "exp1" / "model.pt")
    with Repository.init(tmp_path / "top") as outer:
        with pytest.warns(RuntimeWarning, match=r"left out of the commit \(.*sub/\.ckpt\)"):
            outer.commit(run)
        assert [f["name"] for f in outer.show("HEAD")["files"]] == ["exp1/config.toml", "exp1/model.pt"]
        with pytest.raises(CkptError, match="another repository's own folder or object store"):
            outer.commit(run / "sub" / ".ckpt")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the project's folder is no repository
            outer.commit(run / "exp1" / "model.pt")
        torch.save({"w": torch.zeros(4)}, run / "exp1" / "model.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outer.commit(run)
        outer.checkout_to("HEAD~2", force=True)  # in place: what deletes
    assert (run / "sub" / ".ckpt" / "config.toml").is_file()
    assert torch.equal(torch.load(run / "exp1" / "model.pt")["w"], torch.ones(4))


def test_older_configs_unowned_stores_and_outputs_spelt_otherwise_are_still_another_repositorys(tmp_path, monkeypatch):
    """A linked `meta` whose older config lacks the URL keys, a store made before owner files, a relative -o
    reaching another repository's store through a link, and one-file or DCP outputs inside another .ckpt/ were
    written into or committed; a copy of a local config in a run folder was refused (reader)."""
    import warnings

    from ckptstore.repo.config import RepoConfig

    with Repository.init(tmp_path / "disk") as other:
        other.commit({"w": torch.ones(4)})
    (tmp_path / "disk" / ".ckpt" / "config.toml").write_text("[core]\nthreads = 0\n")  # an older, shorter config
    with Repository.init(tmp_path / "proj", objects_url=str(tmp_path / "data" / "store")) as proj:
        proj.commit({"w": torch.ones(4)})
    (tmp_path / "data" / "store.owner").unlink()  # a store made before owner files
    (tmp_path / "data" / "numbered" / "00").mkdir(parents=True)  # a user's numbered folders are no store
    torch.save({"w": torch.ones(2)}, tmp_path / "data" / "numbered" / "00" / "m.pt")
    (tmp_path / "disk" / ".ckpt").rename(tmp_path / "disk" / "meta")
    torch.save({"w": torch.ones(2)}, tmp_path / "disk" / "m.pt")
    (tmp_path / "run").mkdir()
    RepoConfig().save(tmp_path / "run" / "config.toml")  # a record of where the run was stored
    torch.save({"w": torch.ones(2)}, tmp_path / "run" / "m.pt")
    with Repository.init(tmp_path / "top") as outer:
        with pytest.warns(RuntimeWarning, match=r"left out of the commit \(.*disk/meta"):
            outer.commit(tmp_path / "disk")
        with pytest.warns(RuntimeWarning, match=r"left out of the commit \(.*data/store\)"):
            outer.commit(tmp_path / "data")
        assert [f["name"] for f in outer.show("HEAD")["files"]] == ["numbered/00/m.pt"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outer.commit(tmp_path / "run")  # a copy of a local repository's config is no repository
        (tmp_path / "src" / "a").mkdir(parents=True)
        (tmp_path / "src" / "a" / "x.bin").write_bytes(b"x")
        cid = outer.commit(tmp_path / "src")
        Repository.init(tmp_path / "proj2", objects_url=str(tmp_path / "out" / "store")).close()
        (tmp_path / "out" / "a").symlink_to(tmp_path / "out" / "store")
        monkeypatch.chdir(tmp_path)
        with pytest.raises(CkptError, match="another repository's own folder or object store"):
            outer.checkout_to(cid, "out")  # relative, as typed
        assert not (tmp_path / "out" / "store" / "x.bin").exists()
        for output in (tmp_path / "disk" / "meta" / "ckpt.db", "disk/meta/dir"):
            with pytest.raises(CkptError, match="another repository's own folder or object store"):
                outer.checkout_to("HEAD~1", output, force=True)


def test_two_paths_a_case_blind_file_system_takes_for_one_are_refused_before_writing(repo, tmp_path, monkeypatch):
    """On exFAT, `NOTES.txt` replaced `notes.txt` at the checkout's renames and the checkout said every file was
    written (filesystems auditor). The file system's own answer decides: this machine's disk keeps both."""
    folder = repo.root / "checkpoint-2"
    folder.mkdir()
    (folder / "notes.txt").write_text("lower")
    (folder / "NOTES.txt").write_text("UPPER")
    (folder / "Café.txt").write_text("composed")  # and one that folds with nothing
    repo.commit(folder, "case")
    repo.checkout_to("HEAD", tmp_path / "kept")
    assert {p.name: p.read_text() for p in (tmp_path / "kept").iterdir()} == {
        "notes.txt": "lower", "NOTES.txt": "UPPER", "Café.txt": "composed"}
    exists = Path.exists

    def case_blind(path):  # what exFAT answers for the probe's other spelling
        if path.parent.name.startswith(".case-probe-"):
            return any(other.name.casefold() == path.name.casefold() for other in path.parent.iterdir())
        return exists(path)

    monkeypatch.setattr(Path, "exists", case_blind)
    with pytest.raises(CkptError, match=r"NOTES.txt and .*notes.txt would be one file on this file system"):
        repo.checkout_to("HEAD", tmp_path / "folded")
    with pytest.raises(CkptError, match="would be one file on this file system"):  # a part of it too (reader 9)
        repo.checkout_to("HEAD", tmp_path / "part", keys=["*"])
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "folded") and not os.path.exists(tmp_path / "part")
    assert not list(tmp_path.glob(".case-probe-*"))
    long = repo.root / "long"  # the probe asks under the names themselves: no prefix past NAME_MAX (reader 9)
    long.mkdir()
    for name in ("a" * 240, "A" * 240):
        (long / name).write_text(name[0])
    repo.commit(long, "long")
    repo.checkout_to("HEAD", tmp_path / "long")
    assert sorted(p.read_text() for p in (tmp_path / "long").iterdir()) == ["A", "a"]


def test_the_folding_probe_leaves_refused_names_to_the_write_and_names_an_unwritable_folder(repo, tmp_path,
                                                                                          monkeypatch):
    """`Run:1.pt` and `run:1.pt` on exFAT ended in "unexpected FileNotFoundError" naming the hidden probe folder, and
    an unwritable destination was named by its probe, with --read-only advice (reader 10, of 8f49957)."""
    import errno
    import tempfile

    folder = repo.root / "pair"
    folder.mkdir()
    (folder / "Run:1.txt").write_text("upper")
    (folder / "run:1.txt").write_text("lower")
    cid = repo.commit(folder, "pair")
    touch = Path.touch

    def refusing(path, *args, **kwargs):  # exFAT's answer to a name with ":" (ENOENT through FUSE)
        if ":" in path.name and path.parent.name.startswith(".case-probe-"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return touch(path, *args, **kwargs)

    monkeypatch.setattr(Path, "touch", refusing)
    repo.checkout_to(cid, tmp_path / "out")  # this disk takes both: the write, not the probe, decides
    assert sorted(p.read_text() for p in (tmp_path / "out").iterdir()) == ["lower", "upper"]
    monkeypatch.undo()

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "closed" / ".case-probe-x"))

    (tmp_path / "closed").mkdir()
    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(PermissionError) as raised:
        repo.checkout_to(cid, tmp_path / "closed" / "out")
    assert raised.value.filename == str(tmp_path / "closed")


def test_an_in_place_checkout_of_a_file_never_writes_into_another_repositorys_folder(tmp_path):
    """A committed file whose folder became another repository's own folder (linked in as its .ckpt) was restored
    into it, over what it holds (reader)."""
    import sqlite3

    from safetensors.torch import save_file

    (tmp_path / "a").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "a" / "ckpt.safetensors"))
    with Repository.init(tmp_path / "top") as outer:
        outer.commit(tmp_path / "a" / "ckpt.safetensors")
        (tmp_path / "a" / "ckpt.safetensors").unlink()
        (tmp_path / "a" / "config.toml").write_text("[retention]\nkeep_last = 5\n")
        with sqlite3.connect(tmp_path / "a" / "ckpt.db") as database:
            database.execute("CREATE TABLE t (x)")
        with pytest.raises(CkptError, match="another repository's own folder or object store"):
            outer.checkout_to("HEAD", force=True)
    assert not (tmp_path / "a" / "ckpt.safetensors").exists()


def test_an_output_folder_holding_files_the_commit_does_not_is_said(repo, tmp_path):
    """A stale model.safetensors beside a checked-out folder of sharded weights was what from_pretrained loaded, and
    the checkout said nothing (interop auditor)."""
    folder = repo.root / "checkpoint-10"
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"new")
    (folder / "config.json").write_text("{}")
    cid = repo.commit(folder, step=10)
    out = tmp_path / "out"
    repo.checkout_to(cid, out)  # a new folder: the commit alone, nothing said
    (out / "model.safetensors").write_bytes(b"another run's")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("mine")
    with pytest.warns(RuntimeWarning, match=r"out also holds files this commit does not \(model.safetensors, "
                                            r"sub/notes.txt\): left as they were"):
        repo.checkout_to(cid, out)
    assert (out / "model.safetensors").read_bytes() == b"another run's"


def test_a_lossless_files_bytes_are_checked_against_its_digest_before_they_are_placed(repo, tmp_path, monkeypatch):
    """A remote's forged manifest (its id its own bytes' hash) with a splice moved or an order swapped rebuilt other
    bytes, and the checkout said they were the committed file's (hostile-input auditor)."""
    from ckptstore.errors import CorruptRecordError
    from ckptstore.formats import torchcontainer

    torch.save({"w": torch.randn(32, 32)}, tmp_path / "a.pt")
    cid = repo.commit(tmp_path / "a.pt")
    write = torchcontainer.write

    def forged(dest, record, raw_of, exact=False):  # what a moved splice rebuilds: the container's bytes shifted
        write(dest, record, raw_of, exact)
        with open(dest, "r+b") as handle:
            handle.seek(100)
            handle.write(b"\x00\x01")

    monkeypatch.setattr(torchcontainer, "write", forged)
    with pytest.raises(CorruptRecordError, match="do not hash to the digest it records; nothing was written"):
        repo.checkout_to(cid, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob(".out.pt*"))
    monkeypatch.undo()
    repo.checkout_to(cid, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()


def test_status_lists_a_committed_folders_files_its_commit_does_not_hold(tmp_path):
    """`ckpt status` said every file was unchanged; the next checkout in place then refused to delete notes.txt,
    a file status had never named (docs auditor). Nested repositories and the repository's own are no files of it."""
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, folder / "model.pt")
    with Repository.init(tmp_path) as repo:
        repo.commit(folder)
        (folder / "notes.txt").write_text("mine")
        (folder / "sub" / "more.txt").write_text("mine too")
        Repository.init(folder / "nested").close()
        states = {f["path"]: f["state"] for f in repo.status()["files"]}
    assert states == {"run/model.pt": "unchanged", "run/notes.txt": "untracked", "run/sub/more.txt": "untracked"}


def test_a_commit_naming_a_file_and_a_file_inside_it_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A received commit naming `a` and `a/b` (no commit made here does) failed midway with an unexpected
    FileExistsError: an in-place checkout had deleted a file of HEAD's and written `a` (auditor helper 278)."""
    from ckptstore.repo import manifest as manifests

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "old.txt").write_bytes(b"HEAD's file")
    written = manifests.Manifest.to_record

    def forged(self):
        record = written(self)
        for f in record["files"]:
            f["name"] = "a/b" if f["name"] == "x/b" else f["name"]
        return record

    with Repository.init(tmp_path) as repo:
        first = repo.commit(folder)
        (folder / "old.txt").unlink()
        (folder / "x").mkdir()
        (folder / "a").write_bytes(b"file a")
        (folder / "x" / "b").write_bytes(b"file x/b")
        with monkeypatch.context() as patched:
            patched.setattr(manifests.Manifest, "to_record", forged)
            bad = repo.commit(folder)
        with pytest.raises(CkptError, match=r"names both a file a and a file a/b inside it, .* nothing was written"):
            repo.checkout_to(bad, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    shutil.rmtree(folder)
    ckpt_here(tmp_path, "checkout", first).check_returncode()
    result = ckpt_here(tmp_path, "checkout", bad)
    assert result.returncode == 1 and "nothing was written" in result.stderr, result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["old.txt"]
    assert (folder / "old.txt").read_bytes() == b"HEAD's file"
    with Repository.open(tmp_path) as repo:
        assert repo.resolve("HEAD") == first


def test_output_through_a_dangling_symlink_is_a_one_line_error_before_any_work(repo, tmp_path):
    """A folder commit's `checkout -o LINK` decoded everything, then stopped with "unexpected FileExistsError";
    export blamed /dev/fd or /proc (auditor helper 301)."""
    make_trainer_folder(repo.root / "ck")
    repo.commit(repo.root / "ck")
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere" / "x")
    said = ckpt_here(repo.root, "checkout", "HEAD", "-o", str(tmp_path / "dang"))
    assert said.returncode == 1 and said.stderr == f"error: {tmp_path / 'dang'} is a symlink to " \
        f"{tmp_path / 'nowhere' / 'x'}, which does not exist; create it first or pass another -o path\n", said.stderr
    said = ckpt_here(repo.root, "export", "HEAD", "-o", str(tmp_path / "dang"))
    assert said.returncode == 1 and said.stderr == f"error: {tmp_path / 'dang'} is a symlink to " \
        f"{tmp_path / 'nowhere' / 'x'}, whose folder {tmp_path / 'nowhere'} does not exist; create it first or pass " \
        "another -o path\n", said.stderr
    assert not (tmp_path / "nowhere").exists()


def test_a_folder_commits_empty_sub_folders_come_back_at_checkout(tmp_path):
    """A folder commit dropped its sub-folders that held no file (a trainer's `runs/`, an `optimizer/` placeholder):
    no checkout made them again, and one in place removed them (fixer helper 329)."""
    folder = tmp_path / "ck"
    for empty in ("runs", "optimizer/shards", "only_git/.git"):
        (folder / empty).mkdir(parents=True)
    torch.save({"w": torch.arange(4.0)}, folder / "model.pt")
    with Repository.init(tmp_path) as repo, pytest.warns(RuntimeWarning, match="only_git/.git out of the commit"):
        cid = repo.commit(folder)
    assert ckpt_here(tmp_path, "checkout", cid, "-o", "out").returncode == 0
    shutil.rmtree(folder / "runs")
    assert ckpt_here(tmp_path, "checkout", cid, "--force").returncode == 0  # in place
    for where, git in ((tmp_path / "out", []), (folder, ["only_git/.git"])):  # in place, .git is left alone
        made = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_dir())
        assert made == sorted(["only_git", "optimizer", "optimizer/shards", "runs", *git]), (where, made)
        assert not any((where / "runs").iterdir())
    with Repository.open(tmp_path) as repo:
        assert repo.manifest(cid).empty_folders == ["only_git", "optimizer/shards", "runs"]


def test_status_says_a_committed_empty_folder_is_gone_and_a_new_one_is_there_as_commit_sees_them(tmp_path):
    """Status said "unchanged" of a folder whose committed empty `runs/` was removed, and the next commit recorded
    a change (reviewer helper 338): empty folders are part of a folder commit's content."""
    folder = tmp_path / "run"
    (folder / "runs").mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, folder / "model.pt")
    with Repository.init(tmp_path) as repo:
        repo.commit(folder)
        assert {f["path"]: f["state"] for f in repo.status()["files"]} == {"run/model.pt": "unchanged"}
        (folder / "runs").rmdir()
        (folder / "logs" / "tb").mkdir(parents=True)
        states = {f["path"]: f["state"] for f in repo.status()["files"]}
        assert states == {"run/model.pt": "unchanged", "run/runs/": "missing", "run/logs/tb/": "untracked"}
        assert repo.commit(folder) != repo.log()[1].id  # commit sees the same change


@pytest.mark.parametrize("name, message", [("../escape", "folder '../escape' outside its folder"),
                                           ("/etc/x", "folder '/etc/x' outside its folder"),
                                           ("sub/.git/hooks", "one of git's own files"),
                                           (".ckpt/objects/zz", "made inside the repository's own .ckpt/"),
                                           ("model.pt/inside", "names both a file model.pt and a folder")])
def test_empty_folder_names_a_commit_may_not_make_are_refused(repo, name, message):
    """A received manifest's empty folders are refused as its files' names are: outside, git's, the repository's."""
    from ckptstore.formats import CheckpointFile
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.worktree import plan_checkout

    manifest = Manifest("folder", [CheckpointFile("model.pt", "blob", ["blob", "a"])], {}, {}, empty_folders=[name])
    for dest, output in ((repo.root, False), (repo.root / "out", True))[:1 if ".ckpt" in name else 2]:
        with pytest.raises(CkptError, match=message):  # with -o, out/.ckpt is no repository's own
            plan_checkout(repo, manifest, dest, force=True, output=output)
    assert not (repo.root / "out").exists()


def test_an_empty_folder_is_never_made_through_a_link_out_of_an_output_folder(repo, tmp_path):
    from ckptstore.formats import CheckpointFile
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.worktree import plan_checkout

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs").symlink_to(tmp_path / "elsewhere")
    manifest = Manifest("folder", [CheckpointFile("m.json", "blob", ["blob", "a"])], {}, {}, empty_folders=["runs/a"])
    with pytest.raises(CkptError, match="is a symlink to .*elsewhere, outside"):
        plan_checkout(repo, manifest, tmp_path / "out", force=True, output=True)
    (tmp_path / "out" / "runs").unlink()
    (tmp_path / "out" / "runs").symlink_to(tmp_path / "elsewhere")
    manifest.empty_folders = ["runs"]
    with pytest.raises(CkptError, match="is a symlink to .*elsewhere, outside"):
        plan_checkout(repo, manifest, tmp_path / "out", force=True, output=True)
