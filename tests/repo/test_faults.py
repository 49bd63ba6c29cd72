"""Bad input and faults: each gives a clear error and loses nothing."""

import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import (
    CheckpointFormatError,
    ConflictError,
    CorruptObjectError,
    DirtyWorktreeError,
    NothingToCommitError,
    RefNotFoundError,
)
from ckptstore.repo import fsck, gc
from tests.conftest import Trainer, assert_same, ckpt_env

pytestmark = pytest.mark.both_backends


def _commit_run(repo, tmp_path, n=3, steps=3):
    trainer, commits, states = Trainer(), [], []
    for i in range(n):
        trainer.train(steps)
        torch.save(trainer.state(), tmp_path / "ckpt.pt")
        states.append(repo.checkout(cid := repo.commit(tmp_path / "ckpt.pt", step=trainer.step, message=f"c{i}")))
        commits.append(cid)
    return commits, states


def _an_object_of(repo, cid, min_size=1000):
    show = repo.show(cid)
    biggest = max(show["tensors"], key=lambda t: t["stored_bytes"])
    with repo.db.read() as tx:
        from ckptstore.metadata import tensors as tensor_rows

        record = tensor_rows.load_records(tx, [biggest["tensor"]], with_bases=False)[biggest["tensor"]]
    return record.chunks[0].object_id


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_object_names_object_and_commits_and_spares_others(repo, tmp_path, damage):
    commits, states = _commit_run(repo, tmp_path)
    oid = _an_object_of(repo, commits[0])
    path = repo.store.path_of(oid)
    data = bytearray(path.read_bytes())
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObjectError) as info:
        repo.checkout(commits[0])
    assert oid in str(info.value) and commits[0][:12] in str(info.value)
    report = fsck(repo)
    assert not report.ok and oid in report.damaged_objects
    assert commits[0] in report.broken_commits
    for cid, state in zip(commits, states):
        if cid not in report.broken_commits:
            assert_same(state, repo.checkout(cid))


def test_missing_object_is_reported_by_fsck(repo, tmp_path):
    commits, _ = _commit_run(repo, tmp_path, n=1)
    oid = _an_object_of(repo, commits[0])
    repo.store.delete(oid)
    report = fsck(repo)
    assert report.damaged_objects == {oid: "missing"} and list(report.broken_commits) == [commits[0]]


def test_bad_inputs_give_clear_errors_and_no_commit(repo, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        repo.commit(tmp_path / "notes.txt")
    with pytest.raises(CheckpointFormatError, match="does not exist"):
        repo.commit(tmp_path / "missing.pt")
    torch.save({"w": torch.randn(5000)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) - 300])
    with pytest.raises(CheckpointFormatError):
        repo.commit(tmp_path / "cut.pt")
    assert repo.log() == []


def test_unknown_ref_suggests_close_names(repo, tmp_path):
    _commit_run(repo, tmp_path, n=1)
    repo.branch("experiment-lr")
    with pytest.raises(RefNotFoundError, match="experiment-lr"):
        repo.checkout("experimnt-lr")
    with pytest.raises(RefNotFoundError, match="shorter"):
        repo.resolve("HEAD~5")


def test_nothing_changed_makes_no_commit_unless_allowed(repo, tmp_path):
    commits, _ = _commit_run(repo, tmp_path, n=1)
    with pytest.raises(NothingToCommitError, match="nothing changed"):
        repo.commit(tmp_path / "ckpt.pt")
    assert [c.id for c in repo.log()] == commits
    forced = repo.commit(tmp_path / "ckpt.pt", allow_empty=True, message="again")
    info = repo.commit_info(forced)
    assert info.parents == commits and info.stored_bytes < 0.05 * info.raw_bytes


def test_checkout_refuses_to_overwrite_unsaved_work(repo, tmp_path):
    commits, states = _commit_run(repo, tmp_path, n=2)
    torch.save({"unsaved": torch.randn(10)}, tmp_path / "ckpt.pt")
    with pytest.raises(DirtyWorktreeError, match="not in the store"):
        repo.checkout_to(commits[0])
    assert "unsaved" in torch.load(tmp_path / "ckpt.pt", weights_only=True)
    repo.checkout_to(commits[0], force=True)
    repo.checkout_to(commits[1])  # the restored file's content is known, so this is allowed
    assert repo.head() == (None, commits[1])


def test_equal_tensors_at_two_paths_come_back_as_separate_tensors(repo):
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    back = repo.checkout(repo.commit(state))
    back["a"] += 1
    assert back["b"].sum() == 0


def test_conflicting_writer_gets_clear_error_and_loses_nothing(repo, tmp_path):
    commits, states = _commit_run(repo, tmp_path, n=1)
    torch.save({"w": torch.randn(100)}, tmp_path / "other.pt")
    from ckptstore.repo import target

    with repo.db.read() as tx:
        started = target.commit_target(tx, None)
    repo.commit(tmp_path / "other.pt", message="the other writer")
    with pytest.raises(ConflictError, match="moved"), repo.db.write() as tx:
        target.move_ref(tx, started, "f" * 64)
    assert len(repo.log()) == 2
    assert_same(states[0], repo.checkout(commits[0]))


def test_a_branch_deleted_while_a_commit_to_it_is_written_stays_deleted(repo, tmp_path, monkeypatch):
    from ckptstore import faults

    repo.commit({"w": torch.zeros(8)}, branch="exp")
    passing = faults.point

    def delete_exp(name):  # another process's `ckpt branch -d exp`, between the commit's start and its record
        if name == "commit:manifest-written":
            repo.delete_branch("exp")
        passing(name)

    monkeypatch.setattr(faults, "point", delete_exp)
    with pytest.raises(ConflictError, match="exp was deleted while this commit was being written") as refused:
        repo.commit({"w": torch.ones(8)}, branch="exp")
    assert "Another commit" not in str(refused.value)  # none went there: the advice is to make it anew
    assert "exp" not in repo.branches()
    monkeypatch.setattr(faults, "point", passing)
    repo.commit({"w": torch.ones(8)}, branch="fresh")  # a new branch is still made by its first commit
    assert "fresh" in repo.branches()


def test_a_new_branch_made_meanwhile_where_the_commit_started_takes_the_commit(repo, monkeypatch):
    """Another shell's `ckpt branch exp` at HEAD while a commit to the new branch exp runs: a fast-forward."""
    from ckptstore import faults

    base = repo.commit({"w": torch.zeros(8)})
    passing = faults.point

    def branch_exp(name):
        if name == "commit:manifest-written":
            repo.branch("exp")
        passing(name)

    monkeypatch.setattr(faults, "point", branch_exp)
    made = repo.commit({"w": torch.ones(8)}, branch="exp")
    assert repo.branches()["exp"] == made and repo.commit_info(made).parents == [base]


COMMIT_SCRIPT = """
import sys, torch
from ckptstore import Repository
from ckptstore.errors import ConflictError
repo = Repository.open(sys.argv[1])
torch.manual_seed(int(sys.argv[3]))
torch.save({"w": torch.randn(int(sys.argv[4]))}, sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
try:
    print("committed", repo.commit(sys.argv[2], message=sys.argv[2]), flush=True)
except ConflictError as exc:
    print("conflict", exc, flush=True)
"""


def _python(*args, **kwargs):
    env = ckpt_env()
    return subprocess.Popen([sys.executable, "-c", COMMIT_SCRIPT, *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kwargs)


def test_two_processes_committing_at_once(tmp_path, metadata_url):
    Repository.init(tmp_path, metadata_url=metadata_url).close()
    writers = [_python(str(tmp_path), str(tmp_path / f"w{i}.pt"), str(i), "200000") for i in range(2)]
    for w in writers:
        assert w.stdout.readline().startswith("ready")
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    outputs = [w.communicate(timeout=120)[0] for w in writers]
    committed = [o.split()[1] for o in outputs if o.startswith("committed")]
    assert committed and all(o.startswith(("committed", "conflict")) for o in outputs), outputs
    with Repository.open(tmp_path) as repo:
        log = [c.id for c in repo.log()]
        assert sorted(log) == sorted(committed)
        if len(committed) == 2:
            assert repo.commit_info(log[0]).parents == [log[1]]
        assert fsck(repo).ok
        for cid in log:
            repo.checkout(cid)


def test_sigkill_mid_commit_leaves_a_consistent_repository(tmp_path, metadata_url):
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        torch.save({"w": torch.randn(1000)}, tmp_path / "small.pt")
        first = repo.commit(tmp_path / "small.pt")
        expected = repo.checkout(first)
    victim = _python(str(tmp_path), str(tmp_path / "big.pt"), "7", "40000000")
    assert victim.stdout.readline().startswith("ready")
    objects = tmp_path / ".ckpt" / "objects"
    before = sum(1 for _ in objects.rglob("*") if _.is_file())
    victim.stdin.write("go\n")
    victim.stdin.flush()
    deadline = time.time() + 60
    while sum(1 for _ in objects.rglob("*") if _.is_file()) < before + 3 and time.time() < deadline:
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    with Repository.open(tmp_path) as repo:
        assert [c.id for c in repo.log()] == [first]
        report = fsck(repo)
        assert report.ok and report.unreferenced_objects > 0
        assert_same(expected, repo.checkout(first))
        collected = gc(repo)
        assert collected.objects_removed == report.unreferenced_objects
        assert fsck(repo).unreferenced_objects == 0
        assert_same(expected, repo.checkout(first))


@pytest.mark.parametrize("enabled", [True, False])
def test_commit_holds_off_cyclic_gc_and_restores_it_even_on_error(repo, monkeypatch, enabled):
    import gc

    from ckptstore.repo import commit as commit_module

    seen = []
    real_encode = commit_module.encode_jobs

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(commit_module, "encode_jobs", spy)
    (gc.enable if enabled else gc.disable)()
    try:
        repo.commit({"w": torch.ones(3)})
        with pytest.raises(NothingToCommitError):
            repo.commit({"w": torch.ones(3)})
        assert seen == [False, False] and gc.isenabled() == enabled
    finally:
        gc.enable()


def test_one_tensor_recorded_at_once_by_two_writers_that_chunk_it_differently_keeps_one_record(repo, monkeypatch):
    from ckptstore import faults
    from ckptstore.policy import EncodingSettings

    state = {"w": torch.randn(300_000)}
    repo.config.encoding = EncodingSettings(chunk_bytes=1 << 18)  # this machine cuts it in five chunks
    passing, first = faults.point, []

    def another_machine_records_it_first(name):  # its default cuts the same tensor in one chunk
        if name == "commit:manifest-written":
            monkeypatch.setattr(faults, "point", passing)
            with Repository.open(repo.root) as other:
                first.append(other.commit(state, branch="a"))
        passing(name)

    monkeypatch.setattr(faults, "point", another_machine_records_it_first)
    second = repo.commit(state, branch="b")
    assert fsck(repo).ok
    for commit in (first[0], second):
        assert_same(state, repo.checkout(commit))


def test_a_file_rewritten_while_it_is_committed_is_refused_and_stays_unsaved(repo, tmp_path, monkeypatch):
    from ckptstore import formats

    path = tmp_path / "ckpt.pt"
    torch.save({"step": 100, "w": torch.zeros(1000)}, path)
    first = repo.commit(path)
    torch.save({"step": 150, "w": torch.full((1000,), 0.5)}, path)
    reading = formats.read_checkpoint

    def the_trainer_saves_again_meanwhile(*args, **kwargs):  # torch.save writes in place
        checkpoint = reading(*args, **kwargs)
        torch.save({"step": 200, "w": torch.ones(1000)}, path)
        return checkpoint

    monkeypatch.setattr(formats, "read_checkpoint", the_trainer_saves_again_meanwhile)
    with pytest.raises(CheckpointFormatError, match="changed while it was being committed"):
        repo.commit(path)
    assert [c.id for c in repo.log()] == [first]
    with pytest.raises(DirtyWorktreeError):  # step 200 is in no commit: checking out over it is refused
        repo.checkout_to(first)
    assert torch.load(path, weights_only=True)["step"] == 200


def test_a_branch_that_moves_while_it_is_checked_out_leaves_head_detached_at_the_files_written(repo, tmp_path,
                                                                                              monkeypatch):
    from ckptstore import faults

    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(8)}, path)
    first = repo.commit(path, branch="exp")
    passing = faults.point

    def another_process_commits(name):
        if name == "checkout:records-read":
            monkeypatch.setattr(faults, "point", passing)
            repo.commit({"w": torch.ones(8)}, branch="exp")
        passing(name)

    monkeypatch.setattr(faults, "point", another_process_commits)
    with pytest.warns(RuntimeWarning, match="exp moved to .* HEAD is detached at"):
        repo.checkout_to("exp")  # in place: the files of `first`
    assert repo.head() == (None, first)


def test_a_log_appended_to_while_its_folder_is_committed_keeps_the_bytes_read(repo, tmp_path, monkeypatch):
    from ckptstore import formats

    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.ones(4)}, folder / "model.pt")
    (folder / "train.log").write_text("step 1\n")
    reading = formats.read_checkpoint

    def the_run_logs_meanwhile(*args, **kwargs):
        checkpoint = reading(*args, **kwargs)
        with open(folder / "train.log", "a") as log:
            log.write("step 2\n")
        return checkpoint

    monkeypatch.setattr(formats, "read_checkpoint", the_run_logs_meanwhile)
    cid = repo.commit(folder)
    monkeypatch.setattr(formats, "read_checkpoint", reading)
    out = tmp_path / "out"
    repo.checkout_to(cid, out)
    assert (out / "train.log").read_text() == "step 1\n"
    with pytest.raises(DirtyWorktreeError):  # "step 2" is in no commit: checking out over it is refused
        repo.checkout_to(cid)


@pytest.mark.parametrize("change", ["rewritten in place", "cut shorter"])
def test_a_plain_file_rewritten_or_cut_while_its_folder_is_committed_is_refused(repo, tmp_path, monkeypatch, change):
    from ckptstore import faults

    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"w": torch.ones(4)}, folder / "model.pt")
    (folder / "status.txt").write_bytes(b"A" * 100_000)
    passing = faults.point

    def the_run_changes_it_meanwhile(name):  # once the commit has hashed and encoded it
        if name == "commit:objects-written":
            if change == "rewritten in place":
                with open(folder / "status.txt", "r+b") as status:
                    status.write(b"B" * 100_000)
            else:  # reading its memory map past the new end would end the process (SIGBUS)
                (folder / "status.txt").write_bytes(b"short\n")
        passing(name)

    monkeypatch.setattr(faults, "point", the_run_changes_it_meanwhile)
    with pytest.raises(CheckpointFormatError, match="status.txt changed while it was being committed"):
        repo.commit(folder)
    assert repo.log() == []


@pytest.mark.parametrize("failure", ["lock lost", "disk full"])
def test_a_gc_that_fails_before_deleting_says_that_and_what_helps_not_a_commits_words(tmp_path, monkeypatch, failure):
    """A gc whose lock was lost blamed 'a gc elsewhere' removing 'what it wrote' (auditor 433), and one on a nearly
    full disk advised running `ckpt gc`, itself, never saying its database write needs room first (auditor 434)."""
    from ckptstore.errors import DiskFullError, LostLockError, disk_full
    from ckptstore.repo import maintenance

    def fails(repo, prune_unreachable=False):
        if failure == "lock lost":
            raise LostLockError("lost the repository lock ...; a gc elsewhere may have removed what it wrote, so "
                                "nothing was recorded: run the command again", "its session ended")
        raise disk_full("database or disk is full")

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(4)})
        monkeypatch.setattr(maintenance, "collect", fails)
        with pytest.raises((LostLockError, DiskFullError)) as said:
            maintenance.gc(repo)
    text = str(said.value)
    assert "gc elsewhere" not in text and "`ckpt gc` removes" not in text, text
    assert ("nothing was deleted or changed" if failure == "lock lost" else "its database write needs room") in text
