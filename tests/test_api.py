"""The module-level API (ckptstore/api.py): values as torch.save takes them, and in a torch.distributed job."""

import atexit
import contextlib
import os
import socket
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import ckptstore
from ckptstore import Repository, faults
from ckptstore.errors import BackgroundCommitError
from ckptstore.repo.background import BackgroundCommitWarning
from tests.conftest import assert_same


def _save_on(rank: int, root: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            ckptstore.save({"w": torch.ones(4)}, repo=Path(root) / "repo", step=1)
        else:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                dist.barrier()  # rank 0's commit first: this one's would race it
                try:
                    ckptstore.save({"w": torch.ones(4)}, repo=Path(root) / "repo", step=1)
                except ckptstore.errors.CkptError:  # "nothing changed": the commit rank 0 made
                    pass
            (Path(root) / "rank1.txt").write_text("\n".join(str(w.message) for w in said))
        if rank == 0:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_save_off_rank_zero_of_a_distributed_job_is_warned_of(tmp_path):
    """`ckptstore.save` on every rank raced for the branch: one rank's commit failed, or each committed, and the
    docs never said rank 0 only (DDP integrations auditor)."""
    Repository.init(tmp_path / "repo").close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_save_on, args=(str(tmp_path), port), nprocs=2, join=True)
    said = (tmp_path / "rank1.txt").read_text()
    assert said.startswith("ckptstore.save on rank 1 of 2: where every rank commits to one branch"), said
    with Repository.open(tmp_path / "repo") as repo:
        assert len(repo.log()) == 1


def test_save_stores_a_str_as_its_value_not_as_a_path(repo, tmp_path, monkeypatch):
    """save("") committed the current folder's files and save("step 5") failed with "step 5 does not exist":
    Repository.commit's path reading took the object (auditor helper 300)."""
    (tmp_path / "notes.txt").write_text("unrelated file\n")
    monkeypatch.chdir(tmp_path)
    for text in ("", "step 5", "notes.txt"):
        assert ckptstore.load(ckptstore.save(text, repo=repo), repo=repo) == text
    handle = ckptstore.save(".", repo=repo, message="in the background", blocking=False)
    assert ckptstore.load(handle.result(), repo=repo) == "."
    with pytest.raises(ckptstore.errors.CkptError, match=r"no value ckptstore stores; to commit the file or folder"):
        ckptstore.save(tmp_path / "notes.txt", repo=repo)


def _stale_of(root: Path) -> list:
    """The repositories of the folder at `root` kept as made anew and not closed yet (other tests keep their own)."""
    from ckptstore import api

    return [repo for repo, _ in api._STALE.values() if repo.root == root.resolve()]


def _in_thread(fn, *args):
    """Run `fn(*args)` on a thread; the returned list gets its result or exception once the thread ends."""
    outcome: list = []

    def run():
        try:
            outcome.append(fn(*args))
        except Exception as exc:  # noqa: BLE001 - what the test reports
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_load_on_another_thread_does_not_close_the_repository_a_background_save_by_path_is_using(
        tmp_path, monkeypatch):
    """A load that found the folder's kept repository idle closed it while a save on another thread was about to
    commit on it: "saves 30, commits recorded 6", the rest failed on a closed database (auditor helper 334)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    first = ckptstore.save({"w": torch.zeros(4)}, root, message="first", blocking=False).result()  # kept, now idle
    taken, loaded = threading.Event(), threading.Event()
    commit = Repository.commit

    def commit_once_loaded(self, *args, **kwargs):
        taken.set()  # the race widened: the save holds the kept repository while the other thread loads
        loaded.wait(20)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(Repository, "commit", commit_once_loaded)
    saver, saved = _in_thread(lambda: ckptstore.save({"w": torch.ones(4)}, root, message="second", blocking=False))
    assert taken.wait(20)
    assert_same(ckptstore.load("HEAD", root), {"w": torch.zeros(4)})
    loaded.set()
    saver.join(60)
    monkeypatch.undo()
    assert not isinstance(saved[0], Exception), saved
    second = saved[0].result()
    with Repository.open(root) as repo:
        assert [(c.id, c.message) for c in repo.log()] == [(second, "second"), (first, "first")]
    assert_same(ckptstore.load("HEAD", root), {"w": torch.ones(4)})


def test_a_save_by_path_into_a_folder_made_anew_while_another_thread_loads_lands_in_the_new_repository(
        tmp_path, monkeypatch):
    """A load in progress kept the folder's repository; the folder was deleted and made anew by init, and a save
    by path was handed the old object: it returned an id, wrote into the deleted database and warned of a damaged
    parent, and the new repository held nothing (reviewer helper 348, of a260ee9)."""
    import shutil

    root = tmp_path / "repo"
    Repository.init(root).close()
    ckptstore.save({"old": torch.ones(3)}, root)
    loading, remade = threading.Event(), threading.Event()
    checkout = Repository.checkout

    def checkout_once_remade(self, *args, **kwargs):
        loading.set()  # the race widened: the load holds the folder's repository while the folder is made anew
        remade.wait(20)
        return checkout(self, *args, **kwargs)

    monkeypatch.setattr(Repository, "checkout", checkout_once_remade)
    loader, _ = _in_thread(lambda: ckptstore.load(repo=root))
    assert loading.wait(20)
    monkeypatch.undo()
    shutil.rmtree(root)
    Repository.init(root).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the parent commit's manifest is damaged"
        cid = ckptstore.save({"new": torch.arange(5.0)}, root, message="after init")
    remade.set()
    loader.join(60)
    with Repository.open(root) as repo:
        assert [c.id for c in repo.log()] == [cid]
    assert_same(ckptstore.load(repo=root), {"new": torch.arange(5.0)})


def _eventually(condition, seconds: float = 30.0) -> bool:
    """Whether `condition()` holds within `seconds`, asked every 20 ms (a background commit's thread goes its way)."""
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _failed_save_beside_a_remade_folder(root: Path, monkeypatch, warning_action: str):
    """A background save by path held at its start while the folder is made anew and saved to by path, then failing.

    Returns its handle, the repository it was kept in, and the commit the new folder got. `warning_action` is the
    filter its BackgroundCommitWarning meets ("ignore", or "error": a filter that swallows it).
    """
    import shutil

    from ckptstore import api

    Repository.init(root).close()
    release = root.parent / "release"
    monkeypatch.setenv("CKPT_WAIT_AT", f"background:start={release}")
    monkeypatch.setenv("CKPT_FAIL_AT", "background:start")
    with warnings.catch_warnings():
        warnings.simplefilter(warning_action, BackgroundCommitWarning)
        handle = ckptstore.save({"w": torch.ones(4)}, root, blocking=False)
        kept = api._KEPT[root.resolve()]  # this test's: other tests of the process may keep theirs
        assert _eventually(Path(f"{release}.reached").exists)
        shutil.rmtree(root / ".ckpt")
        Repository.init(root).close()
        monkeypatch.delenv("CKPT_WAIT_AT")
        cid = ckptstore.save({"w": torch.full((4,), 2.0)}, root)  # a blocking commit passes no background:start
        release.touch()
        handle.wait()  # its failure is told (or left to the exit) before the handle resolves
        monkeypatch.delenv("CKPT_FAIL_AT")
    return handle, kept, cid


def test_a_repository_of_a_folder_made_anew_is_closed_when_its_failed_background_commit_ends(tmp_path, monkeypatch):
    """Its background commit failed (warned of) after the folder was made anew: the old repository stayed open
    on the deleted database until the exit, which then told the failure a second time (reviewer helper 349)."""
    import gc

    root = tmp_path / "repo"
    handle, _, cid = _failed_save_beside_a_remade_folder(root, monkeypatch, "ignore")
    assert handle.failure() is not None and _eventually(lambda: not _stale_of(root))

    def deleted_files_held() -> list[str]:
        gc.collect()  # a closed database's last connection goes with its cycle
        held = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [name for name in held if str(root) in name and "(deleted)" in name]

    # the commit's thread lets its connection go once its transaction has ended
    assert _eventually(lambda: not deleted_files_held())
    with Repository.open(root) as repo:
        assert [c.id for c in repo.log()] == [cid]


def test_a_folder_made_anew_with_another_postgresql_database_is_another_repository_though_its_inode_came_back(
        tmp_path, postgres_server):
    """On PostgreSQL only the `.ckpt` folder's inode told the old repository from the new, and ext4 gives it back
    at once after an rmtree: a save by path went into the old database (reviewer helper 351, of 6a1e331). The
    inode coming back is made certain here by writing the new config in place."""
    from ckptstore import api

    root = tmp_path / "repo"
    with Repository.init(root, metadata_url=postgres_server.new_database()) as old:
        before = api._identity(old)
        config = root / ".ckpt" / "config.toml"
        config.write_text(config.read_text().replace(old.config.metadata_url, postgres_server.new_database()))
        assert api._identity(old) != before


def test_a_config_rewritten_with_its_default_urls_spelt_out_is_the_same_repository(tmp_path):
    """A config leaving out metadata_url and objects_url (their defaults) was read as None, and `ckpt remote add`
    writes them as "": the folder's repository was taken for one made anew under a commit in flight, and a second
    lane raced it for the branch (reviewer helper 352, of 42097e8)."""
    from ckptstore import api

    root = tmp_path / "repo"
    Repository.init(root).close()
    config = root / ".ckpt" / "config.toml"
    config.write_text('[core]\nlossy = ""\n')
    with Repository.open(root) as repo:
        before = api._identity(repo)
        config.write_text('[core]\nlossy = ""\nmetadata_url = ""\nobjects_url = ""\n')
        assert api._identity(repo) == before


def test_a_failure_a_warnings_filter_swallowed_is_not_forgotten_with_its_remade_folder(tmp_path, monkeypatch):
    """An error filter on BackgroundCommitWarning swallowed the warning; forgetting the failure of the folder's old
    repository then left the exit nothing to say of the lost checkpoint (reviewer helper 351, of 6a1e331)."""
    root = tmp_path / "repo"
    handle, old, _ = _failed_save_beside_a_remade_folder(root, monkeypatch, "error")
    # the commit's thread tells its failure after the handle resolves
    _eventually(lambda: not _stale_of(root) and old._background.failed is not None)
    assert not handle.warned and old._background.failed is handle  # left for the exit to tell
    old._background.failed = None  # told here instead: the test's own process exits quietly


def test_two_threads_first_background_saves_by_path_go_through_one_repository(tmp_path, monkeypatch):
    """Neither found a kept repository, each opened one and the later replaced the earlier: two lanes raced for the
    branch (8 of 10 saves landed) and one repository was never closed (auditor helper 334)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    both_opening = threading.Barrier(2, timeout=20)
    open_repository, commit = Repository.open.__func__, Repository.commit
    committed_on = []

    def open_with_the_other(cls, *args, **kwargs):
        both_opening.wait()  # the race widened: each thread opens the folder before either keeps it
        return open_repository(cls, *args, **kwargs)

    def commit_recording(self, *args, **kwargs):
        committed_on.append(self)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(Repository, "open", classmethod(open_with_the_other))
    monkeypatch.setattr(Repository, "commit", commit_recording)
    values = (1.0, 2.0)
    savers = [_in_thread(lambda v: ckptstore.save({"w": torch.full((4,), v)}, root, message=str(v), blocking=False),
                         value) for value in values]
    for thread, _ in savers:
        thread.join(60)
    monkeypatch.undo()
    ids = [saved[0].result() for _, saved in savers]
    assert committed_on[0] is committed_on[1]  # one object, one lane: the second commit waited for the first
    with Repository.open(root) as repo:
        assert sorted(c.message for c in repo.log()) == ["1.0", "2.0"]
        for value, cid in zip(values, ids, strict=True):
            assert_same(repo.checkout(cid), {"w": torch.full((4,), value)})


def test_a_failed_background_save_by_path_is_raised_by_the_next_save_while_another_thread_loads(
        tmp_path, monkeypatch):
    """The warning says the next commit call raises the failure: it did not where a load on another thread had
    closed the repository the failure was kept in (auditor helper 334)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    ckptstore.save({"w": torch.zeros(4)}, root)
    stop = threading.Event()

    def load_until_stopped():
        loads = 0
        while not stop.is_set():
            ckptstore.load("HEAD", root)
            loads += 1
        return loads

    loader, loaded = _in_thread(load_until_stopped)
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    with pytest.warns(BackgroundCommitWarning, match="the next commit call raises it"):
        handle = ckptstore.save({"w": torch.ones(4)}, root, message="fails", blocking=False)
        handle.wait()
    monkeypatch.delenv("CKPT_FAIL_AT")
    try:
        with pytest.raises(BackgroundCommitError, match="disk is full"):
            ckptstore.save({"w": torch.full((4,), 2.0)}, root, message="after")
    finally:
        stop.set()
        loader.join(60)
    assert isinstance(loaded[0], int), loaded
    assert_same(ckptstore.load("HEAD", root), {"w": torch.zeros(4)})



def test_a_blocking_save_and_a_background_save_by_path_on_two_threads_both_land(tmp_path, monkeypatch):
    """A blocking save that found no kept repository opened its own beside the one the other thread's background save
    kept: two lanes, one branch, and one of the saves failed with ConflictError ("47 of 50", reviewer helper 343)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    commit, point = Repository.commit, faults.point
    blocking_holds, background_entered, background_started = threading.Event(), threading.Event(), threading.Event()
    committed_on: dict[bool, Repository] = {}
    started: list = []  # the background save's handle

    def commit_recording(self, *args, **kwargs):
        blocking = kwargs.get("blocking", True)
        committed_on[blocking] = self
        if blocking:
            return commit(self, *args, **kwargs)
        background_entered.set()
        started.append(commit(self, *args, **kwargs))
        background_started.set()
        return started[0]

    def hold_the_blocking_save(name):
        if name == "commit:manifest-written" and threading.current_thread() is saver:
            # the race widened: the blocking commit has read main's tip when the background save starts
            blocking_holds.set()
            assert background_entered.wait(20)
            if committed_on[False] is not committed_on[True]:  # another lane: it moves main first (one lane: it waits)
                assert background_started.wait(20)
                started[0].wait()
        point(name)

    monkeypatch.setattr(Repository, "commit", commit_recording)
    monkeypatch.setattr(faults, "point", hold_the_blocking_save)
    saver, saved = _in_thread(lambda: ckptstore.save({"v": torch.full((4,), 2.0)}, root, message="blocking"))
    assert blocking_holds.wait(20)
    background = ckptstore.save({"w": torch.full((4,), 1.0)}, root, message="background", blocking=False).result()
    saver.join(60)
    monkeypatch.undo()
    assert not isinstance(saved[0], Exception), saved
    assert committed_on[False] is committed_on[True]  # one object, one lane: the background commit waited
    with Repository.open(root) as repo:
        assert sorted(c.message for c in repo.log()) == ["background", "blocking"]
        assert_same(repo.checkout(background), {"w": torch.full((4,), 1.0)})
        assert_same(repo.checkout(saved[0]), {"v": torch.full((4,), 2.0)})


def test_background_saves_by_path_register_the_exit_hook_once(tmp_path):
    """Each background save after the folder's kept repository went idle registered _close_kept with atexit again:
    20 saves, 20 more exit callbacks (reviewer helper 343)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    before = atexit._ncallbacks()
    for step in range(5):  # each waited on: the next save finds the kept repository idle, closes it, keeps a new one
        ckptstore.save({"w": torch.full((4,), float(step))}, root, step=step, blocking=False).result()
    assert atexit._ncallbacks() - before <= 1  # one where no earlier test's save registered it
    assert_same(ckptstore.load("HEAD", root), {"w": torch.full((4,), 4.0)})


def test_a_save_of_an_unchanged_state_says_how_python_records_it_anyway_and_allow_empty_does(tmp_path):
    """From Python, "nothing changed" advised the CLI's --allow-empty only (docs auditor 396); save takes
    allow_empty=True, which reference.md said only repo.commit did."""
    from ckptstore.errors import NothingToCommitError

    Repository.init(tmp_path).close()
    state = {"w": torch.arange(8.0)}
    first = ckptstore.save(state, repo=tmp_path)
    with pytest.raises(NothingToCommitError, match=r"allow_empty=True from Python"):
        ckptstore.save(state, repo=tmp_path)
    second = ckptstore.save(state, repo=tmp_path, allow_empty=True)
    with Repository.open(tmp_path) as repo:
        assert second != first and repo.commit_info(second).parents == [first]


def test_a_missing_database_says_no_command_runs_not_gc_alone(tmp_path):
    """Every command, `ckpt log` too, said "gc will not run until it is back" (docs auditor 396)."""
    from tests.conftest import ckpt_here

    Repository.init(tmp_path).close()
    (tmp_path / ".ckpt" / "ckpt.db").unlink()
    result = ckpt_here(tmp_path, "log")
    assert result.returncode == 1 and "no command runs until it is back" in result.stderr, result.stderr
    assert "gc will not run" not in result.stderr
