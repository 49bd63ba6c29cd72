"""Background commits (repo/background.py): the snapshot is a copy, one commit in flight, failures never silent.

The background thread is held at the `background:start` fault point (CKPT_WAIT_AT) while the test
trains on, so the state has really changed in place before anything is encoded.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore import Repository
from ckptstore.errors import BackgroundCommitError, CkptError, ConflictError, DiskFullError
from ckptstore.repo import background, fsck
from ckptstore.repo.background import BackgroundCommitWarning
from tests.conftest import Trainer, assert_same, ckpt_env, end_left_running

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hold(monkeypatch, tmp_path: Path):
    """Hold background commits at `background:start` until the returned file exists (at the latest, teardown)."""
    release = tmp_path / "release"
    monkeypatch.setenv("CKPT_WAIT_AT", f"background:start={release}")
    yield release
    release.touch()  # a failed test must not leave a commit waiting forever (the exit would wait for it)


def _wait_reached(release: Path, child: subprocess.Popen | None = None) -> None:
    """Wait for the hold point; a child that ends first fails at once, a loaded machine gets two minutes."""
    reached, deadline = Path(str(release) + ".reached"), time.monotonic() + 120
    while time.monotonic() < deadline:
        if reached.exists():
            return
        if child is not None and child.poll() is not None:
            raise AssertionError(f"the child ended with {child.returncode} before the hold point (its stderr is above)")
        time.sleep(0.01)
    raise AssertionError("the background commit never reached its hold point")


@pytest.mark.both_backends
def test_commit_holds_the_state_at_call_time(repo, trainer, hold):
    trainer.train(2)
    state = trainer.state()
    state["notes"] = {"history": [1.0, 2.0], "tag": "before"}
    expected = copy.deepcopy(state)
    release = hold
    handle = repo.commit(state, "bg", step=trainer.step, blocking=False)
    _wait_reached(release)
    trainer.train(1)  # AdamW changes weights and moments in place
    state["notes"]["history"].append(3.0)
    state["notes"]["tag"] = "after"
    assert not torch.equal(state["model"]["fc1.weight"], expected["model"]["fc1.weight"])
    release.touch()
    cid = handle.result()
    assert set(handle.timing) == {"waited_s", "snapshot_s", "commit_s"}
    assert_same(repo.checkout(cid), expected)
    assert repo.log()[0].step == 2


def test_second_commit_waits_for_the_first(repo, trainer, hold):
    release = hold
    first = repo.commit(trainer.state(), "one", blocking=False)
    _wait_reached(release)
    threading.Timer(0.2, release.touch).start()
    trainer.train(1)
    second = repo.commit(trainer.state(), "two", blocking=False)
    assert first.done()  # the call returned only once the first commit was written
    assert second.timing["waited_s"] > 0
    written = [second.result(), first.result()]
    assert [c.id for c in repo.log()] == written
    trainer.train(1)
    third = repo.commit(trainer.state(), "three")  # a blocking commit after a background one: on top
    assert repo.log()[0].id == third and repo.log()[0].parents == [second.result()]


def test_the_branch_is_the_one_head_was_on_at_the_call_though_head_moves_before_the_thread_starts(repo, hold):
    path = repo.root / "ck.pt"
    torch.save({"w": torch.zeros(64)}, path)
    base = repo.commit(path, "base")
    repo.branch("side")
    torch.save({"w": torch.ones(64)}, path)
    tip = repo.commit(path, "main's tip")
    release = hold
    handle = repo.commit({"w": torch.full((64,), 2.0)}, "on main", blocking=False)  # HEAD is on main now
    _wait_reached(release)
    repo.checkout_to("side")
    release.touch()
    made = handle.result()
    assert repo.branches()["main"] == made and repo.branches()["side"] == base
    assert repo.commit_info(made).parents == [tip] and repo.head() == ("side", base)


def test_a_branch_deleted_before_the_thread_starts_stays_deleted_and_the_commit_conflicts(repo, trainer, hold):
    repo.commit(trainer.state(), "base")
    trainer.train(1)
    repo.commit(trainer.state(), "exp's first", branch="exp")
    release = hold
    trainer.train(1)
    handle = repo.commit(trainer.state(), "exp's second", branch="exp", blocking=False)
    _wait_reached(release)
    repo.delete_branch("exp")
    release.touch()
    with pytest.raises(ConflictError, match="exp was deleted"):
        handle.result()
    assert "exp" not in repo.branches() and len(repo.log(all_refs=True)) == 1


def test_threads_committing_through_one_repository_take_turns(repo, monkeypatch, tmp_path):
    """Blocking commits from two threads on one branch: the second waits for the first, neither conflicts."""
    release = tmp_path / "release"
    monkeypatch.setenv("CKPT_WAIT_AT", f"commit:manifest-written={release}")  # the first holds after its objects
    results: dict[str, object] = {}

    def commit(name: str, value: float) -> None:
        try:
            results[name] = repo.commit({"w": torch.full((64,), value)}, name)
        except Exception as exc:  # noqa: BLE001 - what the test reports
            results[name] = exc

    first = threading.Thread(target=commit, args=("one", 1.0))
    first.start()
    _wait_reached(release)
    second = threading.Thread(target=commit, args=("two", 2.0))
    second.start()
    second.join(0.5)
    assert second.is_alive() and "two" not in results  # waiting for the first, not racing it to the branch
    release.touch()
    first.join(60)
    second.join(60)
    assert [c.message for c in repo.log()] == ["two", "one"], results
    assert repo.log()[0].parents == [results["one"]]
    assert_same(repo.checkout("main"), {"w": torch.full((64,), 2.0)})


def test_two_threads_first_commits_on_a_fresh_repository_take_turns(tmp_path, monkeypatch):
    """Both found no lane and each made one: their commits raced for the branch and one was lost as "another
    Repository object" (auditor helper 334)."""
    both_making = threading.Barrier(2, timeout=2)
    make_lane = background.Lane.__init__

    def make_lane_beside_the_other(lane):
        make_lane(lane)
        try:  # the race widened: a second thread that found no lane makes its own meanwhile (not where it waits)
            both_making.wait()
        except threading.BrokenBarrierError:
            pass

    monkeypatch.setattr(background.Lane, "__init__", make_lane_beside_the_other)
    results: dict[str, object] = {}
    start = threading.Barrier(2, timeout=20)
    with Repository.init(tmp_path / "repo") as repo:
        def commit(name: str, value: float) -> None:
            start.wait()
            try:
                results[name] = repo.commit({"w": torch.full((256, 256), value)}, name)
            except Exception as exc:  # noqa: BLE001 - what the test reports
                results[name] = exc

        threads = [threading.Thread(target=commit, args=(name, value)) for name, value in (("one", 1.0), ("two", 2.0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        log = repo.log()
        assert sorted(c.message for c in log) == ["one", "two"], results
        assert log[0].parents == [log[1].id]
        for name, value in (("one", 1.0), ("two", 2.0)):
            assert_same(repo.checkout(results[name]), {"w": torch.full((256, 256), value)})


def test_failure_is_raised_by_result_and_leaves_the_repository_as_it_was(repo, trainer, monkeypatch):
    first = repo.commit(trainer.state(), "kept")
    before = (repo.branches(), [c.id for c in repo.log()])
    trainer.train(1)
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")  # the disk fills up mid-commit
    handle = repo.commit(trainer.state(), "lost", blocking=False)
    with pytest.raises(DiskFullError):
        handle.result()
    monkeypatch.delenv("CKPT_FAIL_AT")
    assert (repo.branches(), [c.id for c in repo.log()]) == before
    assert fsck(repo).ok
    again = repo.commit(trainer.state(), "again")  # seen by result(): the next commit goes on
    assert [c.id for c in repo.log()] == [again, first]


def _a_warned_failure(repo, trainer, monkeypatch):
    """A background commit after 'kept' that fails (the disk full) with nobody waiting: warned; its handle."""
    repo.commit(trainer.state(), "kept")
    trainer.train(1)
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    with pytest.warns(BackgroundCommitWarning, match="step 1"):
        handle = repo.commit(trainer.state(), step=1, blocking=False)
        handle.wait()
    monkeypatch.delenv("CKPT_FAIL_AT")
    return handle


def test_unobserved_failure_warns_and_the_next_commit_raises_it(repo, trainer, monkeypatch):
    _a_warned_failure(repo, trainer, monkeypatch)
    with pytest.raises(BackgroundCommitError, match="disk is full") as raised:
        repo.commit(trainer.state(), "next")
    assert isinstance(raised.value.__cause__, DiskFullError)
    assert len(repo.log()) == 1
    repo.commit(trainer.state(), "next")  # raised once: the repository works on
    assert len(repo.log()) == 2


def test_a_warned_failure_then_seen_by_result_is_not_raised_again_by_the_next_commit(repo, trainer, monkeypatch):
    """Warned while nobody waited, then asked for with result(): the next commit call must not raise it a second
    time (no test held the check that it was seen; mutation audit round 9)."""
    handle = _a_warned_failure(repo, trainer, monkeypatch)
    with pytest.raises(DiskFullError):
        handle.result()
    repo.commit(trainer.state(), "next")
    assert [c.message for c in repo.log()] == ["next", "kept"]


def test_a_ctrl_c_in_result_before_the_commit_ends_leaves_its_failure_to_be_raised(repo, trainer, monkeypatch, hold):
    """A result() that Ctrl-C cut short, the commit still running, did not see its outcome: its later failure must
    still reach the next commit call, not count as seen (mutation audit round 9: a checkpoint lost unsaid)."""
    repo.commit(trainer.state(), "kept")
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    handle = repo.commit(trainer.state(), step=1, blocking=False)
    with pytest.MonkeyPatch.context() as ctrl_c:
        ctrl_c.setattr(handle._future, "result", lambda timeout=None: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            handle.result()  # Ctrl-C while the commit is held at its start
    assert not handle.done()
    hold.touch()
    with pytest.warns(BackgroundCommitWarning):
        handle.wait()
    monkeypatch.delenv("CKPT_FAIL_AT")
    with pytest.raises(BackgroundCommitError, match="disk is full"):
        repo.commit(trainer.state(), "next")
    assert [c.message for c in repo.log()] == ["kept"]


FAILING_AT_EXIT = """
import resource, sys, torch
from ckptstore import Repository
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, 1 << 19))  # files past 512 KiB fail, as on a full disk
Repository.open(sys.argv[1]).commit({"w": torch.randn(1 << 20)}, step=100, blocking=False)  # the run's last save
print("training done", flush=True)
"""


def test_a_commit_that_fails_as_the_process_ends_is_said_as_an_error(tmp_path):
    """Not as a warning that the next commit call raises it: there is none."""
    Repository.init(tmp_path).close()
    ended = subprocess.run([sys.executable, "-c", FAILING_AT_EXIT, str(tmp_path)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env=ckpt_env())
    assert ended.stdout == "training done\n" and ended.returncode == 0  # set before exit hooks run: left as it is
    assert ended.stderr.startswith("error: the background commit at step 100 failed and the process ended without "
                                   "it: a file reached the largest size allowed here"), ended.stderr
    assert "Warning" not in ended.stderr and "Traceback" not in ended.stderr
    with Repository.open(tmp_path) as repo:
        assert repo.log() == []


def test_a_forked_worker_does_not_tell_its_parents_failure_as_its_own(repo, trainer, monkeypatch, capfd):
    import multiprocessing

    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    with pytest.warns(BackgroundCommitWarning):
        repo.commit(trainer.state(), step=1, blocking=False).wait()
    capfd.readouterr()
    worker = multiprocessing.get_context("fork").Process(target=int)  # a DataLoader worker, say
    worker.start()
    worker.join(timeout=60)
    assert worker.exitcode == 0 and "error:" not in capfd.readouterr().err
    monkeypatch.delenv("CKPT_FAIL_AT")
    with pytest.raises(BackgroundCommitError):  # the parent still has it to raise
        repo.commit(trainer.state(), "next")


def test_closing_waits_for_the_commit_in_flight(tmp_path, trainer, hold):
    repo = Repository.init(tmp_path / "repo")
    release = hold
    handle = repo.commit(trainer.state(), "in flight", blocking=False)
    _wait_reached(release)
    threading.Timer(0.2, release.touch).start()
    repo.close()
    assert handle.done()
    with Repository.open(tmp_path / "repo") as again:
        assert again.log()[0].id == handle.result()


def test_lossy_commit_in_background_equals_the_blocking_one(tmp_path, trainer):
    trainer.train(3)
    state = copy.deepcopy(trainer.state())
    with Repository.init(tmp_path / "a") as a, Repository.init(tmp_path / "b") as b:
        here = a.commit(state, lossy="balanced", model=trainer.model, optimizer=trainer.optimizer)
        there = b.commit(state, lossy="balanced", model=trainer.model, optimizer=trainer.optimizer, blocking=False)
        assert a.manifest(here).to_bytes() == b.manifest(there.result()).to_bytes()
        with pytest.raises(CkptError, match="blocking=True"):
            b.commit(state, lossy="balanced", model=trainer.model, calibration=lambda m: 0.0, blocking=False)


def test_saves_by_path_in_the_background_wait_for_each_other_and_all_land(tmp_path, trainer, hold):
    """Each call on the same folder shares one repository: none races the one in flight on the branch."""
    Repository.init(tmp_path / "repo").close()
    expected, handles = [], []
    threading.Timer(0.3, hold.touch).start()  # the first commit is still held when the next calls come
    for step in range(4):
        trainer.train(1)
        expected.append(copy.deepcopy(trainer.state()))
        handles.append(ckptstore.save(trainer.state(), tmp_path / "repo", message=f"s{step}", step=step,
                                      blocking=False))
    trainer.train(1)
    last = ckptstore.save(trainer.state(), tmp_path / "repo", message="blocking", step=4)  # waits too
    cids = [handle.result() for handle in handles]
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.id for c in repo.log()] == [last, *reversed(cids)]
    for cid, state in zip(cids, expected, strict=True):
        assert_same(ckptstore.load(cid, tmp_path / "repo"), state)


def test_a_folder_made_anew_after_a_background_save_by_path_is_opened_afresh(tmp_path):
    """An idle kept repository is not reused: it would still hold the deleted repository's database."""
    Repository.init(tmp_path / "repo").close()
    ckptstore.save({"w": torch.zeros(4)}, tmp_path / "repo", blocking=False).result()
    shutil.rmtree(tmp_path / "repo")
    Repository.init(tmp_path / "repo").close()
    cid = ckptstore.save({"w": torch.ones(4)}, tmp_path / "repo", blocking=False).result()
    assert torch.equal(ckptstore.load(cid, tmp_path / "repo")["w"], torch.ones(4))
    with Repository.open(tmp_path / "repo") as repo:
        assert [c.id for c in repo.log()] == [cid]


CHILD = """
import sys, time, torch
from ckptstore import Repository
from tests.conftest import Trainer
repo = Repository.open(sys.argv[1])
trainer = Trainer()
trainer.train(int(sys.argv[2]))
torch.save(trainer.model.state_dict(), sys.argv[1] + "/expected-model.pt")  # this process's bits
if sys.argv[3] == "term-in-start":  # a SIGTERM lands while the commit's thread starts (a loaded machine's timing)
    import os, signal, threading
    started = threading.Thread.start
    def start_then_term(thread):
        started(thread)
        if thread.name == "ckpt-background-commit":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # its handler runs here, inside the commit call
    threading.Thread.start = start_then_term
handle = repo.commit(trainer.state(), "background", blocking=False)
if sys.argv[3] == "hang-exit":  # another exit step hangs (a logger's flush) after the commit
    import atexit
    atexit.register(time.sleep, 60)
print("started", flush=True)
if sys.argv[3] in ("hang", "hang-exit"):
    time.sleep(60)
if sys.argv[3] == "fail":  # a peer rank died: the collective raises, and the exit waits for the commit
    raise RuntimeError("gloo: Connection reset by peer")
if sys.argv[3] == "slow-exit":  # the commit done, another exit step hangs (a logger's flush)
    import atexit
    handle.result()
    atexit.register(time.sleep, 60)
    print("committed", flush=True)
"""


SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    """A test that fails while its child waits at a hold point must not leave the child waiting forever."""
    yield
    end_left_running(SPAWNED)


def _child(root: Path, steps: int, mode: str, env: dict | None = None) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(steps), mode], cwd=ROOT,
                             env=ckpt_env(**(env or {})), stdout=subprocess.PIPE)
    SPAWNED.append(child)
    return child


def test_process_exit_waits_for_the_commit_in_flight(tmp_path):
    Repository.init(tmp_path).close()
    child = _child(tmp_path, 2, "exit")
    assert child.wait(timeout=60) == 0
    # the child's own weights: training in another process need not give this one's bits
    expected = torch.load(tmp_path / "expected-model.pt", weights_only=True)
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["background"]
        assert_same(dict(repo.checkout("HEAD")["model"]), dict(expected))


def test_a_sigterm_while_the_exit_waits_for_the_commit_does_not_cut_the_wait_short(tmp_path):
    """torchrun's teardown: a rank whose peer died fails, its exit waits for the commit in flight, then torchrun
    sends SIGTERM; the handler's SystemExit ended that wait and the commit was lost (DDP integrations auditor)."""
    Repository.init(tmp_path).close()
    release = tmp_path / "release"
    child = _child(tmp_path, 1, "fail", {"CKPT_WAIT_AT": f"background:start={release}"})
    _wait_reached(release, child)
    assert child.stdout.readline() == b"started\n"
    time.sleep(0.5)  # the exception ends the script: the exit hook now waits for the held commit
    child.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    release.touch()
    assert child.wait(timeout=60) == 1  # the script's own failure
    expected = torch.load(tmp_path / "expected-model.pt", weights_only=True)
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["background"]
        assert_same(dict(repo.checkout("HEAD")["model"]), dict(expected))


def test_a_sigterm_at_exit_with_no_commit_in_flight_ends_the_process_as_before(tmp_path):
    """The exit's wait ignored every later SIGTERM: a hung exit step after the commits could not be ended (reader
    13, of 4cbef02)."""
    Repository.init(tmp_path).close()
    child = _child(tmp_path, 1, "slow-exit")
    assert child.stdout.readline() == b"started\n" and child.stdout.readline() == b"committed\n"
    time.sleep(0.5)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM


def test_a_second_sigterm_after_the_exits_wait_ends_a_hung_exit_step(tmp_path):
    """SIGTERM mid-commit left SIGTERM ignored for the whole exit: a hung exit step after the commit could not be
    ended, and the wait said nothing (reader 14, of 8c5dd49)."""
    Repository.init(tmp_path).close()
    release = tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "1", "hang-exit"], cwd=ROOT,
                             env=ckpt_env(CKPT_WAIT_AT=f"background:start={release}"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    SPAWNED.append(child)
    _wait_reached(release, child)
    assert child.stdout.readline() == b"started\n"  # past commit(), the hung exit step registered
    child.send_signal(signal.SIGTERM)  # mid-commit: the exit waits for it
    time.sleep(0.5)
    release.touch()
    with Repository.open(tmp_path) as repo:
        deadline = time.monotonic() + 30
        while not repo.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [c.message for c in repo.log()] == ["background"]
    time.sleep(0.5)  # now in the hung exit step
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert b"waiting for the background commit" in child.stderr.read()


CAUGHT = """
import sys, time, torch
from ckptstore import Repository
repo = Repository.open(sys.argv[1])
handle = repo.commit({"w": torch.ones(8)}, "background", blocking=False)
print("started", flush=True)
try:
    time.sleep(60)
except SystemExit:  # a training loop that catches what SIGTERM raises, and goes on
    handle.result()
    print("went on", flush=True)
    time.sleep(60)
"""


def test_a_program_that_catches_the_sigterms_exit_is_still_ended_by_the_next(tmp_path):
    """Once a SIGTERM's SystemExit was caught, every later SIGTERM was let pass: nothing ended the program but the
    scheduler's SIGKILL (reader 15, of 59589c2)."""
    Repository.init(tmp_path).close()
    release = tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", CAUGHT, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             env=ckpt_env(CKPT_WAIT_AT=f"background:start={release}"))
    SPAWNED.append(child)
    _wait_reached(release, child)
    assert child.stdout.readline() == b"started\n"
    child.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    release.touch()
    assert child.stdout.readline() == b"went on\n"
    child.send_signal(signal.SIGTERM)  # nothing in flight now
    assert child.wait(timeout=30) == -signal.SIGTERM


def _program_handlers(seen: list[int]) -> dict:
    """Handlers as a program sets them: Ctrl-C's default, a SIGTERM that exits, an alarm that is only noted."""
    def exits(signum, frame):
        raise SystemExit(128 + signum)

    return {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: exits,
            signal.SIGALRM: lambda signum, frame: seen.append(signum)}


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGALRM), ()],
                         ids=["ctrl-c", "sigterm", "ctrl-c and an alarm", "no thread could start"])
def test_a_signal_while_a_commit_is_put_in_flight_comes_once_it_is(tmp_path, monkeypatch, hold, signals):
    """A handler's exception out of Thread.start() (Ctrl-C's, a SIGTERM's) left a thread its caller believed called
    off: at exit the pools refused it, nothing said (test_a_second_sigterm_... failing under load); in a program
    that went on, it wrote from buffers the next snapshot reuses. Held for that moment, every signal comes once
    the commit is in flight, each to its handler (readers 34-36)."""
    original_start, seen = threading.Thread.start, []
    in_flight = bool(signals)

    def start(thread):
        if not in_flight:
            raise RuntimeError("can't start new thread")
        for signum in signals:
            signal.raise_signal(signum)
        original_start(thread)

    handlers = _program_handlers(seen)
    before = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        with Repository.init(tmp_path / "r") as repo:
            monkeypatch.setattr(threading.Thread, "start", start)
            raising = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: SystemExit}
            with pytest.raises(next((raising[s] for s in signals if s in raising), RuntimeError)):
                repo.commit({"w": torch.ones(8)}, "background", blocking=False)
            monkeypatch.setattr(threading.Thread, "start", original_start)
            assert seen == [s for s in signals if s == signal.SIGALRM]  # each held signal reached its handler
            assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
            assert background.busy(repo) == in_flight  # held at its start: the exit and the next commit wait for it
            hold.touch()
            repo.commit({"w": torch.zeros(8)}, "next")  # raises no failure of it either
            assert [c.message for c in repo.log()] == (["next", "background"] if in_flight else ["next"])
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_held_signal_whose_handler_commits_runs_once_the_call_lets_go_of_the_repository(tmp_path, monkeypatch):
    """A requeue handler (save, then exit) held while a commit was put in flight ran inside the call's lock: its own
    commit waited on that lock for good (reader 37)."""
    original_start, saved = threading.Thread.start, []

    def start(thread):
        if thread.name == "ckpt-background-commit":  # not the pool threads the handler's commit starts
            signal.raise_signal(signal.SIGUSR1)
        original_start(thread)

    def timed_out(signum, frame):
        raise TimeoutError("the handler's commit still waited after 30 s")

    with Repository.init(tmp_path / "r") as repo:
        handlers = {signal.SIGUSR1: lambda signum, frame: saved.append(repo.commit({"w": torch.zeros(8)}, "saved")),
                    signal.SIGALRM: timed_out}
        before = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
        try:
            monkeypatch.setattr(threading.Thread, "start", start)
            signal.alarm(30)
            handle = repo.commit({"w": torch.ones(8)}, "background", blocking=False)
            signal.alarm(0)
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)
        assert len(saved) == 1 and handle.result(timeout=60) != saved[0]
        assert [c.message for c in repo.log()] == ["saved", "background"]


@pytest.mark.parametrize("where", ["caller_origin", "describe"])
def test_a_ctrl_c_after_the_snapshot_before_the_commit_is_in_flight_gives_its_buffers_back(repo, monkeypatch,
                                                                                           where):
    """A Ctrl-C between the snapshot and the commit's start ended the call with no commit, and its host buffers
    were never given back: every later snapshot took one-off ones (reader 37; before the handle existed, on a
    repository's first background commit, reader 38)."""
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(background, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        repo.commit({"w": torch.ones(1024)}, "background", blocking=False)
    buffers = repo._background.buffers
    assert buffers.kept > 0 and sum(len(free) for free in buffers._free.values()) == len(buffers._owned)
    assert repo.log() == [] and not background.busy(repo)


def test_a_ctrl_c_as_the_handlers_are_put_back_leaves_the_commit_its_buffers(tmp_path, monkeypatch, hold):
    """A Ctrl-C right after Ctrl-C's own handler was put back comes out of the call with the commit in flight: the
    call must not give the snapshot's buffers back while the thread reads them (no test held that; reader 38)."""
    original, interrupted = signal.signal, []

    def put_back(signum, handler):
        previous = original(signum, handler)
        if signum == signal.SIGINT and handler is signal.default_int_handler and not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # what the restored handler does with a Ctrl-C landing here
        return previous

    before = original(signal.SIGINT, signal.default_int_handler)
    try:
        with Repository.init(tmp_path / "r") as repo:
            monkeypatch.setattr(signal, "signal", put_back)
            with pytest.raises(KeyboardInterrupt):
                repo.commit({"a": torch.ones(1024), "b": torch.zeros(1024)}, "background", blocking=False)
            monkeypatch.setattr(signal, "signal", original)
            assert background.busy(repo) and not any(repo._background.buffers._free.values())  # all with the thread
            hold.touch()
            repo.commit({"a": torch.full((1024,), 2.0), "b": torch.full((1024,), 3.0)}, "next")
            assert_same({"a": torch.ones(1024), "b": torch.zeros(1024)}, repo.checkout("HEAD~1"))
    finally:
        original(signal.SIGINT, before)


def test_a_background_commit_from_another_thread_than_the_main_one_goes_on(repo):
    """Signals are held only where Python runs their handlers, the main thread: elsewhere they cannot be set."""
    outcome = []
    caller = threading.Thread(target=lambda: outcome.append(repo.commit({"w": torch.ones(8)}, blocking=False)))
    caller.start()
    caller.join(timeout=60)
    assert outcome[0].result(timeout=60) == repo.resolve("main")


def test_sigterm_mid_commit_ends_the_process_once_the_commit_is_written(tmp_path):
    """SIGTERM comes before SIGKILL from a scheduler: the commit in flight is written, then the process exits."""
    Repository.init(tmp_path).close()
    release = tmp_path / "release"
    child = _child(tmp_path, 1, "hang", {"CKPT_WAIT_AT": f"background:start={release}"})
    _wait_reached(release, child)
    child.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # the handler runs while the commit is still held
    child.send_signal(signal.SIGTERM)  # a second one (an impatient scheduler) does not cut the wait short
    time.sleep(0.3)
    release.touch()
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    expected = torch.load(tmp_path / "expected-model.pt", weights_only=True)
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["background"]
        assert_same(dict(repo.checkout("HEAD")["model"]), dict(expected))


def test_a_sigterm_while_the_commits_thread_starts_still_waits_for_the_commit(tmp_path):
    """CI's flaky failure of the test above (-15, not 143): on a loaded machine the SIGTERM reached the main thread
    while it waited for the commit's thread to start; the handler, set inside the commit call, ran at once, and its
    SystemExit read as a thread that never started: the commit left the exit's list, and the next SIGTERM (nothing
    in flight, as far as it knew) killed the process, the commit with it."""
    Repository.init(tmp_path).close()
    release = tmp_path / "release"
    child = _child(tmp_path, 1, "term-in-start", {"CKPT_WAIT_AT": f"background:start={release}"})
    _wait_reached(release, child)
    time.sleep(0.3)
    child.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    release.touch()
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    with Repository.open(tmp_path) as repo:
        assert [c.message for c in repo.log()] == ["background"]
        expected = torch.load(tmp_path / "expected-model.pt", weights_only=True)
        assert_same(dict(repo.checkout("HEAD")["model"]), dict(expected))


def test_sigkill_mid_commit_leaves_earlier_commits_and_garbage_only(tmp_path):
    trainer = Trainer()
    with Repository.init(tmp_path) as repo:
        kept = repo.commit(trainer.state(), "kept")
    release = tmp_path / "never"
    child = _child(tmp_path, 1, "hang", {"CKPT_WAIT_AT": f"commit:objects-written={release}"})
    _wait_reached(release, child)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    with Repository.open(tmp_path) as repo:
        assert [c.id for c in repo.log()] == [kept]
        assert_same(repo.checkout(kept), trainer.state())
        report = fsck(repo)
        assert report.ok and report.unreferenced_objects > 0  # the killed commit's objects: garbage for gc


def test_background_commits_leave_their_planes_for_the_next_commit(repo, trainer):
    from ckptstore.repo import planecache

    trainer.train(1)
    repo.commit(trainer.state(), "first", blocking=False).result()
    assert planecache.cache_of(repo).held_bytes > 0  # kept where the repository's next commit looks
    trainer.train(1)
    cid = repo.commit(trainer.state(), "second", blocking=False).result()
    assert_same(repo.checkout(cid), trainer.state())


def test_an_unchanged_state_is_no_failure_nobody_is_warned_and_the_next_commit_goes_on(repo, trainer):
    import warnings

    from ckptstore.errors import NothingToCommitError

    first = repo.commit(trainer.state(), "first")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a BackgroundCommitWarning would fail the test
        handle = repo.commit(trainer.state(), "same again", blocking=False)
        handle.wait()
        trainer.train(1)
        second = repo.commit(trainer.state(), "changed", blocking=False).result()
    with pytest.raises(NothingToCommitError):
        handle.result()
    assert [c.id for c in repo.log()] == [second, first]


def _times_out(handle) -> None:
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)


def _ctrl_c(handle) -> None:
    def ctrl_c_once_waiting():  # the user presses Ctrl-C while the loop waits in result()
        while not handle._waiting:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_waiting).start()
    with pytest.raises(KeyboardInterrupt):
        handle.result()


@pytest.mark.parametrize("interrupted", [_times_out, _ctrl_c], ids=["timeout", "ctrl-c"])
def test_a_wait_that_ends_before_the_commit_leaves_its_failure_to_be_reported(repo, trainer, hold, monkeypatch,
                                                                              interrupted):
    """result() that gave up (a timeout, Ctrl-C) saw nothing: the failure after it is warned and raised next."""
    repo.commit(trainer.state(), "kept")
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    handle = repo.commit(trainer.state(), step=3, blocking=False)
    _wait_reached(hold)
    interrupted(handle)
    with pytest.warns(BackgroundCommitWarning, match="step 3"):
        hold.touch()
        handle.wait()
    monkeypatch.delenv("CKPT_FAIL_AT")
    with pytest.raises(BackgroundCommitError, match="disk is full"):
        repo.commit(trainer.state(), "next")


def test_load_after_a_background_save_reads_what_it_writes_and_a_relative_path_is_the_callers(
        tmp_path, hold, monkeypatch):
    Repository.init(tmp_path / "repo").close()
    ckptstore.save({"w": torch.zeros(4)}, tmp_path / "repo")
    threading.Timer(0.3, hold.touch).start()
    ckptstore.save({"w": torch.ones(4)}, tmp_path / "repo", blocking=False)
    assert torch.equal(ckptstore.load("HEAD", tmp_path / "repo")["w"], torch.ones(4))  # not the one before
    monkeypatch.chdir(tmp_path / "repo")
    torch.save({"w": torch.full((4,), 2.0)}, "c.pt")
    (tmp_path / "repo" / "other").mkdir()
    torch.save({"w": torch.full((4,), 3.0)}, tmp_path / "repo" / "other" / "c.pt")
    with Repository.open(tmp_path / "repo") as repo:
        handle = repo.commit("c.pt", blocking=False)
        monkeypatch.chdir(tmp_path / "repo" / "other")  # before the thread reads the file
        assert repo.commit_info(handle.result()).source_path == "c.pt"
        assert torch.equal(repo.checkout("HEAD")["w"], torch.full((4,), 2.0))


def test_a_process_forked_while_a_commit_is_in_flight_exits(tmp_path, hold):
    """A DataLoader worker forked mid-commit has no commit thread: its exit must not wait for one."""
    import multiprocessing

    with Repository.init(tmp_path / "repo") as repo:
        handle = repo.commit({"w": torch.ones(64)}, blocking=False)
        _wait_reached(hold)
        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join(timeout=20)
        alive = child.is_alive()
        hold.touch()
        handle.result()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0


def _sigterm_in_a_forked_child() -> None:
    """Exit 0 when the child starts with SIGTERM's default and its own waiting work sets ckptstore's handler again."""
    torch.set_num_threads(1)  # before any torch op in a forked child: OpenMP deadlocks otherwise
    inherited = signal.getsignal(signal.SIGTERM)
    background.end_on_sigterm_after(lambda: False)  # the child's own hf save waiting to be committed
    sys.exit(0 if inherited is signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is background._on_sigterm else 1)


def test_a_forked_child_with_nothing_in_flight_gets_sigterms_default_back(tmp_path):
    """The parent's handler stayed installed in each forked child: a child blocked in native code, where a Python
    handler never runs, ignored kill -TERM (auditor 334)."""
    import multiprocessing

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a program that set no handler of its own
    child = None
    try:
        with Repository.init(tmp_path / "repo") as repo:
            repo.commit({"w": torch.ones(4)}, blocking=False).result()
        assert signal.getsignal(signal.SIGTERM) is background._on_sigterm  # the parent's, for its commits
        child = multiprocessing.get_context("fork").Process(target=_sigterm_in_a_forked_child)
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert signal.getsignal(signal.SIGTERM) is background._on_sigterm  # the parent keeps it
    finally:
        if child is not None and child.is_alive():
            child.kill()
            child.join()
        signal.signal(signal.SIGTERM, before)


def test_load_after_a_failed_background_save_leaves_the_failure_to_the_next_save(tmp_path, monkeypatch):
    """load waits for the save, reads what is there, and does not take the failure the next save must raise."""
    Repository.init(tmp_path / "repo").close()
    ckptstore.save({"w": torch.zeros(4)}, tmp_path / "repo")
    monkeypatch.setenv("CKPT_FAIL_AT", "commit:objects-written")
    with pytest.warns(BackgroundCommitWarning, match="failed"):
        ckptstore.save({"w": torch.ones(4)}, tmp_path / "repo", blocking=False)
        loaded = ckptstore.load("HEAD", tmp_path / "repo")
    monkeypatch.delenv("CKPT_FAIL_AT")
    assert torch.equal(loaded["w"], torch.zeros(4))
    with pytest.raises(BackgroundCommitError, match="disk is full"):
        ckptstore.save({"w": torch.full((4,), 2.0)}, tmp_path / "repo")


FAILED_IN_THE_BACKGROUND_FROM_PYTHON_C = """
import time
from ckptstore import Repository
repo = Repository.init("repo")
open("bad.pt", "wb").write(b"not a checkpoint")
handle = repo.commit("bad.pt", blocking=False)
while not handle.done():
    time.sleep(0.05)
time.sleep(0.2)
print("warned before this line")
repo.close()
"""


def test_a_failed_background_commit_started_from_python_c_is_warned_not_a_thread_traceback(tmp_path):
    """Code from `python -c` (or stdin, a REPL) has no source file: the warning asked its loader for one (auditor)."""
    ended = subprocess.run([sys.executable, "-c", FAILED_IN_THE_BACKGROUND_FROM_PYTHON_C], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=ckpt_env())
    assert "Exception in thread" not in ended.stderr and "ImportError" not in ended.stderr
    assert "BackgroundCommitWarning: the background commit" in ended.stderr
    assert "bad.pt" in ended.stderr and "failed:" in ended.stderr


def _child_uses_the_parents_repository(repo, cid, expected) -> None:
    restored = repo.checkout(cid)
    assert torch.equal(restored["w"], expected["w"])
    repo.commit({"w": expected["w"] * 2}, "from the child", branch="child")


def test_a_forked_child_can_use_its_parents_open_repository(tmp_path):
    """It waited forever on the parent's encoding threads, which a forked child does not have (auditor)."""
    import multiprocessing

    state = {"w": torch.randn(100_000)}
    with Repository.init(tmp_path) as repo:
        cid = repo.commit(state)
        repo.checkout(cid)  # the pool's threads are running now
        repo.branch("child")
        child = multiprocessing.get_context("fork").Process(target=_child_uses_the_parents_repository,
                                                            args=(repo, cid, state))
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        assert child.exitcode == 0
        assert torch.equal(repo.checkout("child")["w"], state["w"] * 2)
        repo.commit({"w": state["w"] + 1}, "the parent goes on")
        assert fsck(repo).ok


def test_a_background_commit_whose_warning_a_filter_makes_an_error_still_resolves(repo, monkeypatch):
    """The warning came first and raised: the handle never resolved, and close() and exit waited on it for good.

    Then the handle resolved, but the warning, an error now, escaped the thread as a traceback besides it.
    """
    import warnings

    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    weight = torch.randn(256, 256)
    weight[0, 0] = float("nan")  # the level falls back to lossless, with a warning
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module=__name__)  # "my code's warnings are errors"
        handle = repo.commit({"model": {"w": weight}}, lossy="balanced", blocking=False)
        handle._thread.join(timeout=60)
    assert handle.done()
    with pytest.raises(RuntimeWarning, match="committed lossless instead"):
        handle.result(timeout=5)
    assert escaped == [] and not handle.warned  # not said: the exit hook says it if nobody asks


def test_a_background_commit_whose_thread_cannot_start_leaves_nothing_to_wait_on(repo, monkeypatch):
    """"can't start new thread" reached the caller, but the handle stayed in flight: the next commit waited forever."""
    real = threading.Thread.start

    def refused(thread):
        if thread.name == "ckpt-background-commit":
            raise RuntimeError("can't start new thread")
        return real(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        repo.commit({"w": torch.ones(4)}, "in the background", blocking=False)
    monkeypatch.undo()
    done = []
    committer = threading.Thread(target=lambda: done.append(repo.commit({"w": torch.ones(4) * 2}, "next")))
    committer.start()
    committer.join(timeout=60)
    assert done and [c.message for c in repo.log()] == ["next"]


def test_a_background_commit_that_warns_after_its_script_is_gone_is_recorded(tmp_path):
    """Warned at the caller's line, the loader was asked for the deleted script's source: ImportError, and the
    commit was lost (auditor)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, torch\n"
        "from ckptstore import Repository\n"
        "os.unlink(__file__)\n"
        "repo = Repository.init(sys.argv[1])\n"
        "w = torch.randn(256, 256)\n"
        "w[5, 5] = float('nan')\n"
        "handle = repo.commit({'w': w}, lossy='balanced', blocking=False)\n"
        "print('committed', handle.result(), len(repo.log()))\n")
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "repo")], capture_output=True, text=True,
                         timeout=120, env=ckpt_env())
    assert out.returncode == 0 and out.stdout.startswith("committed ") and out.stdout.split()[-1] == "1", out.stderr
    assert "RuntimeWarning: the checkpoint holds NaN" in out.stderr


def test_a_background_commit_whose_thread_fails_before_committing_still_resolves(tmp_path, monkeypatch):
    """Out of memory as the thread began (before the commit's own error handling): result(), close() and the
    exit waited forever on a handle nothing would resolve (auditor)."""
    from ckptstore.repo import background

    def no_memory(*_args) -> None:
        raise MemoryError

    with Repository.init(tmp_path) as repo:
        for where in ("_lower_priority", "warnings_at"):
            with monkeypatch.context() as patched:
                patched.setattr(background, where, no_memory)
                handle = repo.commit({"w": torch.ones(8)}, blocking=False)
                deadline = time.monotonic() + 60
                while not handle.done() and time.monotonic() < deadline:  # not result(): nobody sees the failure
                    time.sleep(0.01)
            assert handle.done() and repo.log() == [], where
            with pytest.raises(BackgroundCommitError, match="out of memory"):  # nobody saw it: the next call says it
                repo.commit({"w": torch.ones(8)}, blocking=False)
        assert repo.commit({"w": torch.ones(8)}, blocking=False).result(timeout=60) == repo.log()[0].id


@pytest.mark.both_backends
@pytest.mark.parametrize("how", ["deleted and collected", "pruned"])
def test_a_background_commit_whose_start_was_removed_meanwhile_is_a_conflict_not_damage(repo, hold, how):
    """Its start is fixed at the call; another process deleting the branch and `gc --prune`-ing it (or pruning the
    start commit) before the thread ran made it fail with "metadata has no commit …; run `ckpt fsck`" or a
    checkout's PrunedCommitError, where teams.md promises the conflict (model-based audit helper 290)."""
    from ckptstore.errors import ConflictError
    from ckptstore.repo import gc, prune
    from ckptstore.repo.config import RetentionPolicy

    repo.commit({"w": torch.zeros(8)}, "m")
    repo.branch("x")
    repo.commit({"w": torch.ones(8)}, "x1", branch="x")
    handle = repo.commit({"w": torch.full((8,), 2.0)}, "x2", branch="x", blocking=False)
    _wait_reached(hold)
    with Repository.open(repo.root) as other:  # another process's view of the repository
        if how == "pruned":
            other.commit({"w": torch.full((8,), 3.0)}, "x3", branch="x")
            assert len(prune(other, RetentionPolicy(keep_last=1)).pruned) >= 1
        else:
            other.delete_branch("x")
            assert gc(other, prune_unreachable=True).commits_removed == 1
    hold.touch()
    with pytest.raises(ConflictError, match="while this commit was being written .* nothing was recorded"):
        handle.result(timeout=120)
    assert fsck(repo, full=True).ok



def test_a_background_commit_to_a_new_branch_whose_start_was_pruned_meanwhile_says_so(repo, hold):
    """It said the new branch "was deleted", a branch that never was (review helper 291)."""
    from ckptstore.errors import ConflictError
    from ckptstore.repo import prune
    from ckptstore.repo.config import RetentionPolicy

    start = repo.commit({"w": torch.zeros(8)}, "m")
    handle = repo.commit({"w": torch.ones(8)}, "f", branch="feat", blocking=False)
    _wait_reached(hold)
    with Repository.open(repo.root) as other:
        other.commit({"w": torch.full((8,), 2.0)}, "m2")
        assert start in prune(other, RetentionPolicy(keep_last=1)).pruned
    hold.touch()
    with pytest.raises(ConflictError, match=rf"feat was to be made at {start[:12]}, which `ckpt prune` or `ckpt gc "
                                            r"--prune` removed while this commit was being written; nothing was"):
        handle.result(timeout=120)
    assert "feat" not in repo.branches()


SAVES_IN_ITS_SIGTERM_HANDLER = """
import os, signal, sys, threading, time, torch
import ckptstore
root, mode, release = sys.argv[1], sys.argv[2], sys.argv[3]
state = {"w": torch.arange(4096, dtype=torch.float32)}

def last_save(signum, frame):  # a requeue script's: save a last checkpoint, then exit
    ckptstore.save({"w": state["w"] + 1}, root, step=99)
    sys.exit(0)

def sigterm_once_the_save_waits(where):  # the signal lands while the loop's save holds the repository
    frames = lambda: sys._current_frames().get(threading.main_thread().ident)
    while True:
        frame = frames()
        while frame is not None and frame.f_code.co_name != where:
            frame = frame.f_back
        if frame is not None:
            break
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    open(release, "w").close()

signal.signal(signal.SIGTERM, last_save)
if mode == "blocking":
    ckptstore.save(state, root, step=1)
    os.environ["CKPT_WAIT_AT"] = f"commit:objects-written={release}"  # the loop's next commit waits there
    threading.Thread(target=sigterm_once_the_save_waits, args=("_wait",), daemon=True).start()
else:
    os.environ["CKPT_WAIT_AT"] = f"background:start={release}"  # step 1's thread waits: step 2's save waits on it
    ckptstore.save(state, root, step=1, blocking=False)
    threading.Thread(target=sigterm_once_the_save_waits, args=("settle",), daemon=True).start()
state["w"] = state["w"] * 2
ckptstore.save(state, root, step=2, blocking=mode == "blocking")
print("the loop went on", flush=True)
"""


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_a_sigterm_handler_that_saves_during_the_loops_save_saves_after_it(tmp_path, mode):
    """A SIGTERM handler saving a last checkpoint, run while the loop's save held the repository's lane (a blocking
    commit, or a background save waiting for the one before), waited on that lane until SIGKILL (auditor 358).
    Held until the loop's save lets go, it runs then: both are recorded, the handler's on top, and stderr says so."""
    Repository.init(tmp_path / "r").close()
    child = subprocess.Popen([sys.executable, "-c", SAVES_IN_ITS_SIGTERM_HANDLER, str(tmp_path / "r"), mode,
                              str(tmp_path / "release")], cwd=ROOT, env=ckpt_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    SPAWNED.append(child)
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the handler's save still waited after 120 s") from None
    assert child.returncode == 0 and out == "", err
    assert "SIGTERM came during the commit at step 2" in err and "Traceback" not in err
    base = torch.arange(4096, dtype=torch.float32)
    with Repository.open(tmp_path / "r") as repo:
        log = repo.log()
        assert [c.step for c in log] == [99, 2, 1] and log[0].parents == [log[1].id]
        assert_same(repo.checkout(log[1].id), {"w": base * 2})
        assert_same(repo.checkout(log[0].id), {"w": base * 2 + 1})
        assert fsck(repo).ok


COMMITS_IN_ITS_CALIBRATION = """
import sys, torch
from ckptstore import Repository
from ckptstore.errors import CkptError
with Repository.open(sys.argv[1]) as repo:
    def saving(state):  # runs inside the outer commit, which holds the repository
        repo.commit({"w": torch.zeros(8)}, "inner")
        return 1.0
    try:
        repo.commit({"w": torch.randn(65536)}, "outer", lossy="balanced", calibration=saving, max_loss_change=0.01)
    except CkptError as exc:
        print(exc)
    print([c.message for c in repo.log()])
"""


def test_a_commit_from_inside_the_same_threads_commit_fails_at_once_instead_of_waiting_on_itself(tmp_path):
    """A commit reaching the lane its own thread held (a calibration function's, a signal handler ckptstore could
    not hold) waited on it for good (auditor 358): it is refused at once, and the outer commit records nothing."""
    Repository.init(tmp_path).close()
    child = subprocess.Popen([sys.executable, "-c", COMMITS_IN_ITS_CALIBRATION, str(tmp_path)], cwd=ROOT,
                             env=ckpt_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    SPAWNED.append(child)
    try:
        out, err = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("the inner commit still waited after 120 s") from None
    assert child.returncode == 0, err
    assert "calibration function saving raised CkptError" in out and "would wait for itself" in out
    assert out.splitlines()[-1] == "[]"
