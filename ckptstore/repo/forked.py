"""What a forked child (a DataLoader worker) must not keep as the parent had it: locks other threads held.

A fork copies a lock as it is; one that another thread of the parent held at that moment stays held
in the child, whose copy of that thread never runs to release it. Locks made here are new, unheld,
in every child.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


class ProcessLock:
    """A `threading.Lock` (used as `with lock:`) that each forked child gets afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _LOCKS.add(self)

    def __enter__(self) -> ProcessLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _renew(self) -> None:
        self._lock = threading.Lock()


_LOCKS: weakref.WeakSet[ProcessLock] = weakref.WeakSet()


def _renew_in_child() -> None:
    for lock in list(_LOCKS):
        lock._renew()


os.register_at_fork(after_in_child=_renew_in_child)
