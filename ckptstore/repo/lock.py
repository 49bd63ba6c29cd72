"""Advisory repository lock: commits share it, gc takes it alone.

So gc never deletes objects that a commit in flight has written but not yet recorded. A gate
lock in front keeps gc from starving: a flock shared by overlapping committers might never
be free, so a gc takes the gate first, and commits pass the gate (briefly, alone) before they
take their shared lock; commits that start while a gc waits queue behind it. The exclusive holder
records itself in the gate file, so that a command waiting for it names who it waits for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ckptstore.errors import RepoLockedError
from ckptstore.holders import LOCK_NOTICE_S, holder_named, process_tag
from ckptstore.warn import warn_caller

_RETRY_S = 0.05  # how often a wait tries the lock again until it says so (then it blocks)


def _flock(fd: int, flags: int, wait: bool, path: Path, waiting: Callable[[], str]) -> None:
    """Lock `fd` (flock); past LOCK_NOTICE_S of waiting, `waiting()`'s line says for what, and the wait goes on.

    Tried without blocking first (one call, as before, when the lock is free), then again every _RETRY_S
    until the notice is due: a blocking flock cannot be timed, and a commit behind a long gc hung silently.
    """
    said_at = time.monotonic() + LOCK_NOTICE_S
    while True:
        try:
            fcntl.flock(fd, flags | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not wait:
                raise RepoLockedError(f"{path.parent} is busy: another ckpt process is committing or collecting "
                                      "garbage; try again when it finishes") from None
        if time.monotonic() >= said_at:
            break
        time.sleep(_RETRY_S)
    warn_caller(waiting())
    fcntl.flock(fd, flags)


def _held_alone_by(gate: int, path: Path) -> str:
    """The line of a command waiting behind the lock's exclusive holder, named as it recorded itself in the gate."""
    tag = _recorded_holder(gate)
    who = holder_named(tag) if tag else "a ckpt gc or prune (it did not record which process)"
    return (f"waiting for the repository lock of {path.parent}: {who} holds it alone, or is next in line for it "
            "(a gc or prune); this command goes on once it finishes")


def _recorded_holder(gate: int) -> str:
    """The `process_tag` the gate file holds; "" where none, or where it names a process of this host that is gone.

    A gc killed -9 leaves its name there, and a gc after it that cannot rewrite the file (another
    user's) holds the lock unnamed: the dead one was blamed for it.
    """
    try:
        tag = os.pread(gate, 512, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    found = re.match(r"(\d+)@(\S+)", tag)
    if found is not None and found[2] == socket.gethostname() and not _alive(int(found[1])):
        return ""
    return tag


def _alive(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's too: signal 0 checks, sends nothing)."""
    if pid <= 0:  # 0 would signal our own process group: no holder records that
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process: there
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _held_by_commits(path: Path) -> str:
    """The line of a gc or prune waiting for the commits in flight, which hold the lock shared."""
    return (f"waiting for the repository lock of {path.parent}: commits in flight hold it (shared), or a sharded "
            "save whose ranks failed, until its process saves again or exits; this command starts once they finish, "
            "and commits started meanwhile wait for it")


_OPEN: set[int] = set()  # the descriptors of the locks held (or being taken) in this process


def _record_holder(gate: int, tag: str) -> None:
    """Write `tag` (this process, or "" on letting go) into the gate file, where waiters read who holds the lock."""
    with contextlib.suppress(OSError):  # a gate file another user made read-only: the lock holds unnamed
        os.ftruncate(gate, 0)
        os.pwrite(gate, tag.encode(), 0)


def _lock_file(path: Path) -> int:
    """A descriptor of `path` to flock, made with the umask's modes: 0644 locked a group's other members out.

    Read and write where allowed (NFS emulates flock with byte-range locks, which need it), else read
    only: another member's file made under a stricter umask still serves a local flock.
    """
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


@contextlib.contextmanager
def repo_lock(path: Path, exclusive: bool, wait: bool = True) -> Iterator[None]:
    """Hold a shared or exclusive flock on `path` for the duration of the block."""
    gate = _lock_file(path.with_name(path.name + ".gate"))
    _OPEN.add(gate)
    fd, recorded = -1, False
    try:
        fd = _lock_file(path)
        _OPEN.add(fd)
        _flock(gate, fcntl.LOCK_EX, wait, path, lambda: _held_alone_by(gate, path))
        if exclusive:
            _record_holder(gate, process_tag())
            recorded = True
        try:
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, wait, path,
                   lambda: _held_by_commits(path) if exclusive else _held_alone_by(gate, path))
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        if recorded:
            _record_holder(gate, "")  # let go: a waiter finds no stale name
        for held in (fd, gate):
            if held >= 0:
                _OPEN.discard(held)
                os.close(held)


@contextlib.contextmanager
def held_alone(path: Path, busy: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the block, without waiting: `busy(holder's pid)` is raised if taken.

    The holder writes its pid into the file, so that the refusal can name who holds it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock_file(path)
    _OPEN.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy(os.pread(fd, 32, 0).decode(errors="replace").strip() or "?") from None
        with contextlib.suppress(OSError):  # a lock file another user made read-only: the lock holds without the pid
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        _OPEN.discard(fd)
        os.close(fd)


def _let_go_in_child() -> None:
    """A forked child's copies of the descriptors keep the parent's flocks until the child exits: drop them.

    A DataLoader worker forked while a commit held the lock kept it for its life: every later gc
    waited, and a waiting gc then held back the parent's commits. Each descriptor is pointed at
    /dev/null rather than closed, so a `with repo_lock` the child was forked inside still closes
    a descriptor of its own at the end.
    """
    if not _OPEN:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for held in list(_OPEN):
        os.dup2(null, held)
    os.close(null)
    _OPEN.clear()


os.register_at_fork(after_in_child=_let_go_in_child)
