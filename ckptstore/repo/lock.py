"""Advisory repository lock: commits share it, gc takes it alone.

So gc never deletes objects that a commit in flight has written but not yet recorded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ckptstore.errors import RepoLockedError


@contextlib.contextmanager
def repo_lock(path: Path, exclusive: bool, wait: bool = True) -> Iterator[None]:
    """Hold a shared or exclusive flock on `path` for the duration of the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, flags if wait else flags | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RepoLockedError(
                f"{path.parent} is busy: another ckpt process is committing or collecting garbage; "
                "try again when it finishes"
            ) from None
        yield
    finally:
        os.close(fd)
