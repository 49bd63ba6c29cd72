"""What a long-lived process keeps between the repositories it opens at one root: planes and threads.

The ckpt daemon opens the repository afresh for every command (so it sees config changes and other
writers), but a commit runs faster on what the last one left: the parent's byte planes
(planecache.py) and the encoding threads, whose per-thread decompressors and scratch buffers
(threadlocal.py) are already faulted in. `keep_warm(root)` makes every Repository opened at
`root` in this process share one plane cache and one thread pool, which outlive it. Every program
(not the `ckpt` command) loads the modules a commit runs as it opens a repository (`load_machinery`).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ckptstore.repo.forked import ProcessLock
from ckptstore.repo.planecache import share_plane_cache
from ckptstore.signals import loaded, signals_waiting

_ROOTS: set[str] = set()
_LATEST: dict[str, int] = {}  # by root: the thread count its repositories asked for last
_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}
_LOCK = ProcessLock()


os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of their threads


def keep_warm(root: Path) -> None:
    """Repositories opened at `root` (resolved) from now on share planes and threads; load a commit's code."""
    load_machinery(always=True)
    share_plane_cache(root)
    with _LOCK:
        _ROOTS.add(str(root))


_AS_NEEDED = threading.local()  # on a thread running a `ckpt` command: opening loads only what is used
# What any commit may import (a state, a file, a folder, lossy, calibrated, pruned after), numpy but not torch:
# the modules these import complete it (tests/repo/test_signal_hold.py checks that a commit imports nothing more).
MACHINERY = ("ckptstore.replay", "ckptstore.formats.checkpoint_io", "ckptstore.formats.safetensors_file",
             "ckptstore.formats.torchzip", "ckptstore.formats.torchfile", "ckptstore.formats.torchcontainer",
             "ckptstore.formats.snapshot", "ckptstore.formats.dcpmeta", "ckptstore.policy.lossy",
             "ckptstore.policy.mapping", "ckptstore.policy.livenames", "ckptstore.policy.sensitivity",
             "ckptstore.repo.background", "ckptstore.repo.calibrate", "ckptstore.repo.pruning",
             "ckptstore.repo.integrity", "ckptstore.repo.maintenance", "ckptstore.repo.sharded",
             "ckptstore.repo.dcpfiles")


@contextmanager
def machinery_as_needed() -> Iterator[None]:
    """Within the block, on this thread, opening a repository loads only what is used: a `ckpt` command's.

    A `ckpt` command sets no handler that saves, and `ckpt status` loads no numpy. Only for its length and
    its thread: a program that ran a command in-process, or two at once, kept the protection off after it.
    """
    before = getattr(_AS_NEEDED, "on", False)
    _AS_NEEDED.on = True
    try:
        yield
    finally:
        _AS_NEEDED.on = before


def load_machinery(always: bool = False) -> None:
    """Import what commits run, with the program's signal handlers held, unless loaded (or the CLI's, unless `always`).

    A SIGTERM handler that saves, landing while a program's first checkout, diff or commit imported a module
    a commit needs (replay, checkpoint_io, repo.background), found it half-imported: its save failed, and the
    call it interrupted with it. Loaded as the program opens a repository, no later call imports one of them.
    """
    if (always or not getattr(_AS_NEEDED, "on", False)) and not all(loaded(name) for name in MACHINERY):
        with signals_waiting():
            for name in MACHINERY:
                importlib.import_module(name)


def shared_pool(root: Path, threads: int) -> ThreadPoolExecutor | None:
    """The pool of `threads` threads that repositories at `root` share; None unless `root` is kept warm."""
    if str(root) not in _ROOTS:
        return None
    with _LOCK:
        key = (str(root), threads)
        if key not in _POOLS:
            _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-warm")
        _LATEST[str(root)] = threads
        return _POOLS[key]


def settle(root: Path) -> None:
    """Wait until every task given to `root`'s shared pools has finished (a command that failed may leave some).

    One barrier task per thread: all of them run at once only when every earlier task is done.
    """
    with _LOCK:
        pools = [(pool, threads) for (where, threads), pool in _POOLS.items() if where == str(root)]
    for pool, threads in pools:
        barrier = threading.Barrier(threads + 1)
        for _ in range(threads):
            pool.submit(barrier.wait)
        barrier.wait()
    with _LOCK:  # the config's thread count changed: the idle pools of other counts go, between commands
        stale = [k for k in _POOLS if k[0] == str(root) and k[1] != _LATEST.get(str(root))]
        for key in stale:
            _POOLS.pop(key).shutdown(wait=False)
