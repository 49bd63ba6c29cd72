"""Advisory repository lock: commits share it, gc takes it alone.

So gc never deletes objects that a commit in flight has written but not yet recorded. A gate
lock in front keeps gc from starving: a flock shared by overlapping committers might never
be free, so a gc takes the gate first, and commits pass the gate (briefly, alone) before they
take their shared lock; commits that start while a gc waits queue behind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ckptstore.errors import RepoLockedError


def _flock(fd: int, flags: int, wait: bool, path: Path) -> None:
    try:
        fcntl.flock(fd, flags if wait else flags | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RepoLockedError(
            f"{path.parent} is busy: another ckpt process is committing or collecting garbage; "
            "try again when it finishes"
        ) from None


@contextlib.contextmanager
def repo_lock(path: Path, exclusive: bool, wait: bool = True) -> Iterator[None]:
    """Hold a shared or exclusive flock on `path` for the duration of the block."""
    gate = os.open(path.with_name(path.name + ".gate"), os.O_RDWR | os.O_CREAT, 0o644)
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _flock(gate, fcntl.LOCK_EX, wait, path)
        try:
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, wait, path)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(gate)
