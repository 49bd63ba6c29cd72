"""Commits in the background: the caller waits for a snapshot of the state; a thread encodes and writes it.

DESIGN.md puts background commits with the integrations, but `Repository.commit(blocking=False)`
is a repo-layer verb and the repo layer may not import the integrations: the mechanism lives here
and the torch side of the snapshot in formats/snapshot.py.

One commit per repository is in flight: the next commit call (blocking or not) waits for it first,
and its handle's `timing["waited_s"]` says how long. A failure is re-raised by the handle's
`result()`; when nobody is waiting on it as it happens, it is reported at once as a
`BackgroundCommitWarning`, and the next commit call on that repository raises it as a
`BackgroundCommitError`, unless `result()` was asked first. A failed commit recorded nothing (the
write path's metadata step never ran), so the repository is as it was. Closing the repository and
the end of the process wait for the commit in flight, and so does SIGTERM where no handler was set
(it exits with status 143 once the commit is written); a SIGKILL leaves only garbage for gc.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 (its exit hook must be registered before ours: see _at_exit)
import copy
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptstore import faults
from ckptstore.errors import (
    BackgroundCommitError,
    CkptError,
    NothingToCommitError,
    RetentionError,
    explain,
)
from ckptstore.formats import Checkpoint
from ckptstore.formats.snapshot import HostBuffers, snapshot
from ckptstore.hashing import CommitId
from ckptstore.repo import planecache
from ckptstore.repo.commit import CommitOptions, LossyOptions, commit, norm_names_of, param_names_of
from ckptstore.repo.forked import ProcessLock
from ckptstore.repo.gcpause import no_cyclic_gc
from ckptstore.repo.target import start_now
from ckptstore.signals import SignalHold, describe, run_held, signals_held
from ckptstore.warn import caller_origin, warn_caller, warnings_at

if TYPE_CHECKING:
    from ckptstore.repo.progress import Progress
    from ckptstore.repo.repository import Repository


class BackgroundCommitWarning(RuntimeWarning):
    """A background commit failed while nobody waited on its handle (the next commit call raises it)."""


@dataclass(eq=False)
class BackgroundCommit:
    """The handle of a commit running in the background.

    `timing` holds `waited_s` (for the commit in flight before this one), `snapshot_s` (copying
    the state: what the caller was blocked for besides the wait) and, once done, `commit_s`
    (encoding and writing, in the background).
    """

    description: str
    timing: dict[str, float]
    _future: Future = field(default_factory=Future)
    _observed: bool = False  # its result or failure reached a caller
    _waiting: int = 0  # callers in result() now: a failure reaches them, so it is not also warned
    warned: bool = False  # its failure was already said as a warning (nobody waited on it then)
    _thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the commit has finished (written, or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CommitId:
        """The new commit's id, once it is written; re-raises the exception that made the commit fail.

        A `timeout` that passes first raises TimeoutError and leaves a later failure to be reported.
        """
        self._waiting += 1
        try:
            value = self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            # the commit's own failure reached the caller; Ctrl-C or SIGTERM while waiting did not
            self._observed = self._future.done()
            raise
        finally:
            self._waiting -= 1
        self._observed = True
        return value

    @property
    def seen(self) -> bool:
        """Whether a caller has, or is waiting for, its outcome (then a failure needs no warning)."""
        return self._observed or self._waiting > 0

    def when_done(self, callback: Callable[[BackgroundCommit], None]) -> None:
        """Call `callback(self)` once the commit has finished: on its thread, or here at once where it has."""
        self._future.add_done_callback(lambda _: callback(self))

    def failure(self) -> BaseException | None:
        """Why the finished commit failed (NothingToCommitError where nothing changed); None where it is written."""
        return self._future.exception(timeout=0)

    def wait(self) -> None:
        """Block until the commit has finished, without raising its failure."""
        if self._thread is not threading.current_thread():
            wait_for([self._future])


class Lane:
    """A repository's background commits: the one in flight, an unobserved failure, the snapshot buffers."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()  # held by a blocking commit throughout, by a background one while it starts
        self.owner: int | None = None  # the thread holding the mutex: a commit of its own inside waits on itself
        self.current: BackgroundCommit | None = None
        self.failed: BackgroundCommit | None = None
        self.buffers = HostBuffers()
        self.pool: ThreadPoolExecutor | None = None  # the commits' encoding threads, at a lower priority

    def close(self) -> None:
        """Wait for the commit in flight, then stop the encoding threads."""
        self.wait()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def wait(self) -> None:
        """Block until the commit in flight (if any) has finished; its failure stays for the next commit call."""
        if self.current is not None:
            self.current.wait()

    def settle(self) -> float:
        """Wait for the commit in flight and raise its failure if nobody saw it; return the seconds waited."""
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        failed, self.failed = self.failed, None
        if failed is not None and not failed._observed:
            failed._observed = True
            error = failed._future.exception()
            raise BackgroundCommitError(
                f"the background commit {failed.description} failed: {explain(error) or error}. Nothing of it was "
                "recorded and the repository is as it was before it; commit that state again "
                "(handle.result() reports such a failure where it happens)") from error
        return waited


BACKGROUND_NICE = 10  # how much lower a background commit's threads run than the caller's
_LIVE: set[BackgroundCommit] = set()  # in flight in this process: the exit waits for them
_LANES: weakref.WeakSet[Lane] = weakref.WeakSet()  # every lane of this process, for a forked child to reset
_registered = threading.Lock()
_LANE_MADE = ProcessLock()  # held while a repository's lane is made (lane_of)
_hooked: list[bool] = []
_EXITING = threading.Event()  # the interpreter is ending: a failure has no next commit call to raise it
_WAITING = threading.Event()  # the exit is waiting for the commits in flight (_at_exit)
_TERMINATED = threading.Event()  # a SIGTERM began the exit, which is on its way to that wait
_OTHER_WORK: list[Callable[[], bool]] = []  # whether an integration holds a commit its exit hook makes (hf)


def _at_exit() -> None:
    """Let the commits in flight finish before the interpreter stops its thread pools.

    Registered with threading's exit hooks, which run newest first and before the thread pools
    refuse new work (concurrent.futures registers its own there when imported, above). A failure
    nobody can be told of any more is printed as an error: a checkpoint the job believes saved.
    """
    _EXITING.set()
    ending = list(_LIVE)
    _WAITING.set()
    try:
        for handle in ending:
            _wait_through_signals(handle, announce=_TERMINATED.is_set())
    finally:
        _WAITING.clear()  # the rest of the exit is the program's: a SIGTERM ends it as it would have
        _TERMINATED.clear()
    unraised = [lane.failed for lane in list(_LANES) if lane.failed is not None and not lane.failed._observed]
    for handle in dict.fromkeys([*ending, *unraised]):
        error = handle._future.exception()
        if not handle._observed and not isinstance(error, (type(None), NothingToCommitError, RetentionError)):
            # The exit status was settled before these hooks ran: only os._exit could change it, and that
            # would cut short other threads and unflushed files. Waiting on handle.result() raises it in time.
            print(f"error: the background commit {handle.description} failed and the process ended without "
                  f"it: {explain(error) or error}. Nothing of it was recorded", file=sys.stderr, flush=True)


def _wait_through_signals(handle: BackgroundCommit, announce: bool = False) -> None:
    """Wait for `handle` at exit, a Ctrl-C or SIGTERM meanwhile (torchrun's teardown) not cutting the wait short.

    The first such signal (with `announce`, the SIGTERM that began the exit) is answered on stderr: the
    process waits on purpose, and SIGKILL abandons the commit.
    """
    said, due = False, announce  # the line is said inside the try: a signal while it prints is absorbed as any other
    while True:
        try:
            if due:
                due, said = False, True
                _say_waiting(handle)
            handle.wait()
            return
        except (KeyboardInterrupt, SystemExit):
            due = not said


def _say_waiting(handle: BackgroundCommit) -> None:
    print(f"waiting for the background commit {handle.description} before the process ends (kill -9 abandons it: "
          "nothing of it is recorded then)", file=sys.stderr, flush=True)


def _hook_exit() -> None:
    with _registered:
        if not _hooked:
            # atexit.register runs after the pools stopped: only a fallback for a Python without this hook
            getattr(threading, "_register_atexit", atexit.register)(_at_exit)
            _hooked.append(True)
    _hook_sigterm()


def _hook_sigterm() -> None:
    """Make SIGTERM (what SLURM and Kubernetes send before SIGKILL) end the process as an exit does.

    Its default kills the process at once, commit in flight and all. Only where nobody set a
    handler (Lightning sets its own), and only from the main thread (Python's rule), so each
    background commit tries again. Once set it stays: a Python handler runs when the main thread
    is back in Python, so a SIGTERM reaches a main thread blocked in native code when that returns.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if _WAITING.is_set():  # the exit waits for the commits in flight: a SIGTERM must not cut that short
        raise SystemExit(128 + signum)  # _wait_through_signals says so and waits on
    if not _LIVE and not any(holds() for holds in _OTHER_WORK):  # nothing in flight: end as the default would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _TERMINATED.is_set():  # the exit a SIGTERM began is on its way to that wait: let it get there
        return
    _TERMINATED.set()
    raise SystemExit(128 + signum)  # the interpreter's exit waits for the commits in flight (_at_exit)


def end_on_sigterm_after(holds: Callable[[], bool]) -> None:
    """Let a SIGTERM end the process as an exit does (its exit hooks run) while `holds()` says work waits.

    For a commit an integration makes in its own exit hook (a Trainer save whose next hook never came).
    """
    if holds not in _OTHER_WORK:  # called at each save: its hook is kept once
        _OTHER_WORK.append(holds)
    _hook_sigterm()  # again in a forked child, which started with the default (_forget_in_child)


def busy(repo: Repository) -> bool:
    """Whether `repo` has a background commit in flight, or a failure of one its next commit call must raise."""
    lane = repo._background
    return lane is not None and (lane.failed is not None or (lane.current is not None and not lane.current.done()))


def forget_failure(repo: Repository) -> None:
    """Mark `repo`'s failed background commit seen: no call will use it again (its folder was made anew).

    A failure warned of where it happened is not told again by closing the repository, or at the exit; one a
    warnings filter swallowed (an error filter) is left for the exit to tell.
    """
    lane = repo._background
    if lane is not None and lane.failed is not None and lane.failed.warned:  # one not warned of: the exit says it
        lane.failed._observed = True
        lane.failed = None


def lane_of(repo: Repository) -> Lane:
    """The repository's lane, made once: two threads' first commits each made one and raced for the branch."""
    lane = repo._background
    if lane is None:
        with _LANE_MADE:
            if repo._background is None:  # another thread's first commit may have made it while this one waited
                repo._background = Lane()
                _LANES.add(repo._background)
            lane = repo._background
    return lane


def wait_in_flight(repo: Repository) -> None:
    """Wait for `repo`'s background commit in flight (a failure stays for the next commit call to raise)."""
    if repo._background is not None:
        repo._background.wait()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the parent's commit threads: nothing to wait for at its exit."""
    _LIVE.clear()
    for lane in list(_LANES):  # the parent's failures are the parent's to tell, not each worker's at its exit
        lane.current, lane.pool, lane.mutex, lane.owner, lane.failed = None, None, threading.Lock(), None, None
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        # nothing in flight here: the default again, as before ckptstore set it (_hook_sigterm sets it only over
        # SIG_DFL), so a child blocked in native code (where a Python handler never runs) still dies of kill -TERM
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread: cannot happen after a fork, whose thread becomes the main one
            pass


# at import, not at the first commit: a waiting hf save installs _on_sigterm with no commit of its own
os.register_at_fork(after_in_child=_forget_in_child)


def commit_in_background(repo: Repository, source: Any, options: CommitOptions, lossy: LossyOptions,
                         progress: Progress | None = None, buffer_budget: int | None = None) -> BackgroundCommit:
    """Snapshot `source` and commit it on a thread; return the handle once the snapshot is taken.

    A path is committed as it is on disk when the thread reads it: keep the file until `done()`.
    `buffer_budget` sets how many bytes of host buffers the repository keeps for the next snapshots.
    """
    if lossy.calibration is not None:
        raise CkptError("a calibration function runs the live model, which training changes meanwhile: "
                        "commit with blocking=True to calibrate, or without calibration= in the background")
    repo.db.refuse_writes()  # a read-only repository says so here, not in a warning later
    # SIGTERM's handler set before the signals are held, so that it waits too while the commit is put in flight:
    # set inside, it ran at once, and a SIGTERM in the thread's start took the commit off the exit's list
    _hook_sigterm()
    hold = SignalHold(options, "that commit is in flight, after the background commit before it")
    try:
        with _lane_held(repo, hold) as lane:
            _hook_exit()  # its lock taken with signals held: a saving handler takes it again
            waited = lane.settle()
            start = time.perf_counter()
            # the branch and its tip as they are now: a checkout or a deleted branch meanwhile must not redirect it
            options = replace(options, start=start_now(repo, options.branch))
            if buffer_budget is not None:  # a lower one frees kept buffers at the next take
                lane.buffers.budget = buffer_budget
            # the live objects stay with the caller: the thread gets the parameter names they give
            lossy = replace(lossy, model=None, optimizer=None, norm_names=norm_names_of(lossy.model),
                            param_names=param_names_of(lossy.model, lossy.optimizer))
            checkpoint, lent, handle = source, [], None
            try:
                if isinstance(source, (str, os.PathLike)):  # the caller's folder now, not the thread's later
                    checkpoint = Path(source).absolute()
                elif isinstance(source, Checkpoint):  # flattened by the caller (save of a str): its bytes copied now
                    checkpoint = replace(source, tensors={p: replace(raw, data=np.array(raw.data, copy=True))
                                                          for p, raw in source.tensors.items()})
                else:
                    with no_cyclic_gc():  # as in a commit: a full collection in the snapshot would stall the caller
                        checkpoint, lent = snapshot(source, lane.buffers)
                handle = BackgroundCommit(describe(options), {"waited_s": waited,
                                                               "snapshot_s": time.perf_counter() - start})
                handle._thread = threading.Thread(target=_work, name="ckpt-background-commit", args=(
                    repo, lane, handle, checkpoint, lent, options, lossy, progress, caller_origin()))
                hold.everything = True  # from here Ctrl-C waits too: its exception must not cut _start in two
                _start(lane, handle)
            except BaseException:  # no thread took the snapshot (Ctrl-C after it, or none could start): free it
                if handle is None or lane.current is not handle:
                    lane.buffers.give_back(lent)
                raise
    finally:
        run_held(hold.held)  # outside the mutex: a handler that commits (a requeue's save) must not wait on it
    return handle


def _start(lane: Lane, handle: BackgroundCommit) -> None:
    """Put `handle` in flight (the exit and the next commit call wait for it) and start its thread."""
    lane.current = handle
    _TERMINATED.clear()  # a program that caught the SIGTERM's SystemExit goes on: the next SIGTERM is its own
    _LIVE.add(handle)
    try:
        handle._thread.start()
    except BaseException as exc:  # "can't start new thread": nothing runs, so nothing may wait on the handle
        lane.current = None
        _LIVE.discard(handle)
        handle._future.set_exception(exc)
        raise


@contextmanager
def _lane_held(repo: Repository, hold: SignalHold) -> Iterator[Lane]:
    """`repo`'s lane with its mutex taken; on the main thread the program's signal handlers wait meanwhile.

    Python runs a handler on the main thread wherever it is: one that commits (a SIGTERM's or a requeue's last
    save, then sys.exit) inside a commit call waited on the mutex that call held, until SIGKILL. Held, it runs
    once the caller lets go (run_held), its commit after the call's. A commit reaching the lane its own
    thread holds (a calibration function's, a handler set meanwhile) fails at once instead of waiting on itself.
    """
    with signals_held(hold):
        lane = lane_of(repo)
        if lane.owner == threading.get_ident():
            raise CkptError("a commit to this repository from inside this thread's own commit to it (a signal handler "
                            "or calibration function that commits) would wait for itself: commit once that call "
                            "has returned")
        with lane.mutex:
            lane.owner = threading.get_ident()
            try:
                yield lane
            finally:
                lane.owner = None


def commit_call(repo: Repository, source: Any, options: CommitOptions, lossy: LossyOptions,
                progress: Progress | None, blocking: bool, buffer_budget: int | None) -> CommitId | BackgroundCommit:
    """`Repository.commit`: in the background, or now once the commit in flight is done (raising its unseen failure)."""
    if not blocking:
        return commit_in_background(repo, source, options, lossy, progress, buffer_budget)
    hold = SignalHold(options, "that commit is written")
    try:
        with _lane_held(repo, hold) as lane:  # threads sharing the repository commit one at a time, as in background
            lane.settle()
            return commit(repo, source, options, lossy, progress)
    finally:
        run_held(hold.held)  # outside the mutex: a handler that commits follows this commit


def _work(repo: Repository, lane: Lane, handle: BackgroundCommit, checkpoint: Any, lent: list[Any],
          options: CommitOptions, lossy: LossyOptions, progress: Progress | None, origin: Any) -> None:
    """The thread: commit, give the buffers back, then resolve the handle (its warnings point at `origin`, the call)."""
    try:
        with warnings_at(origin):
            _commit_and_resolve(repo, lane, handle, checkpoint, lent, options, lossy, progress)
    except BaseException as exc:  # before the commit's own handling (out of memory as the thread began)
        if not handle._future.done():  # else resolved: result(), close() and the exit would wait on it forever
            lane.buffers.give_back(lent)
            lane.failed = handle  # the next commit call raises it, as any failure nobody waited on
            handle._future.set_exception(exc)
            _LIVE.discard(handle)


def _commit_and_resolve(repo: Repository, lane: Lane, handle: BackgroundCommit, checkpoint: Any, lent: list[Any],
                        options: CommitOptions, lossy: LossyOptions, progress: Progress | None) -> None:
    start = time.perf_counter()
    error: BaseException | None = None
    try:
        _lower_priority()
        # the repository as it is, but with threads of its own at a lower priority: training keeps the cores
        background = copy.copy(repo)
        if lane.pool is None:  # kept for the repository's next background commits: one runs at a time
            lane.pool = ThreadPoolExecutor(repo.config.threads or os.cpu_count() or 1, "ckpt-background",
                                           _lower_priority)
        background._pool = lane.pool
        planecache.set_cache(background, planecache.cache_of(repo))  # one set of residual bases, whoever commits
        faults.point("background:start")  # tests hold the thread here to change the state meanwhile
        cid = commit(background, checkpoint, options, lossy, progress)
    except BaseException as exc:  # every failure goes to the handle, none is lost with the thread
        error = exc
    finally:
        lane.buffers.give_back(lent)
        handle.timing["commit_s"] = time.perf_counter() - start
    try:
        if error is not None:
            _tell(handle, lane, error)
    except Exception:  # a filter made the warning an error, or showing it failed: the handle holds the failure
        handle.warned = False
    finally:  # resolved even where a warnings filter turns the warning into an error: nothing waits forever
        if error is None:
            handle._future.set_result(cid)
        else:
            handle._future.set_exception(error)
        _LIVE.discard(handle)


def _tell(handle: BackgroundCommit, lane: Lane, error: BaseException) -> None:
    """Warn of a failed background commit nobody waits on (nothing changed is no failure: result() says so)."""
    if isinstance(error, RetentionError):  # recorded: only the prune after it failed, and the next one retries
        if not handle.seen:
            handle.warned = True
            warn_caller(f"the background commit {handle.description}: {error}; the next commit's policy "
                        "prunes again", BackgroundCommitWarning)
    elif not handle.seen and not isinstance(error, NothingToCommitError):
        lane.failed = handle
        if not _EXITING.is_set():  # at exit there is no next commit call: _at_exit says it
            handle.warned = True
            warn_caller(f"the background commit {handle.description} failed: {explain(error) or error}; nothing of "
                        "it was recorded (the next commit call raises it)", BackgroundCommitWarning)


def _lower_priority() -> None:
    """Run this thread at nice +BACKGROUND_NICE (Linux sets it per thread), so a busy CPU serves training first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # not on this platform, or not allowed: the same priority, only slower training
        pass
