"""Memory maps of a user's files, guarded: a file cut short while it is read is refused, not a SIGBUS.

A commit reads checkpoints through maps (no copy, no extra memory). When the training run
truncates the file meanwhile (the next torch.save opens it with "wb"), touching a page past its
new end raises SIGBUS, which would kill the process (the daemon, under `ckpt daemon`). Within
`guard()`, every map made here is registered with the native handler (_sigbus.c), which answers
such a fault with a page of zeros; on leaving, the guard raises the documented "changed while it
was being committed" error if any of its maps faulted, so nothing read from them is recorded.
Without the native module (no C compiler at install) maps are unguarded, as before.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from ckptstore.formats.atomic import changed_while_read
from ckptstore.hashing import bytes_digest

try:
    from ckptstore.formats import _sigbus
except ImportError:  # built without a C compiler: maps are read unguarded
    _sigbus = None

if TYPE_CHECKING:
    import numpy as np

native = _sigbus is not None
_local = threading.local()


class Guard:
    """The maps registered while a guard is active, and which of them faulted (by file path)."""

    def __init__(self, reading: bool = False) -> None:
        self._slots: dict[int, str] = {}
        self._tokens: dict[int, object] = {}  # which registration holds each slot now
        self._faulted: list[str] = []
        self.reading = reading  # a read for another command than commit: its refusal says so

    def add(self, data: mmap.mmap, path: str | os.PathLike) -> int:
        """Register `data` (a map of `path`): a fault in it reads zeros and marks the path. Returns its slot.

        The slot goes with the map: its addresses may be mapped again, by anyone, once it is closed.
        """
        if _sigbus is None or not len(data):
            return -1
        slot = _sigbus.register(_address(data), len(data))
        if slot >= 0:  # -1: the table is full, the map is read unguarded
            self._slots[slot] = str(path)
            self._tokens[slot] = token = object()
            weakref.finalize(data, self._release_if_still, slot, token)
        return slot

    def _release_if_still(self, slot: int, token: object) -> None:
        """`release(slot)` unless it was released already (and perhaps taken by another map since)."""
        if self._tokens.get(slot) is token:
            self.release(slot)

    def adopt(self, path: str | os.PathLike) -> None:
        """Register the maps of `path` another library made in this process (torch.load(mmap=True))."""
        if _sigbus is None:
            return
        real = os.path.realpath(path)
        try:
            with open("/proc/self/maps") as maps:
                lines = [line.split(None, 5) for line in maps]
        except OSError:  # not Linux: those maps stay unguarded
            return
        for fields in lines:
            if len(fields) == 6 and fields[5].rstrip("\n") == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                slot = _sigbus.register(start, end - start)
                if slot >= 0:
                    self._slots[slot] = str(path)

    def release(self, slot: int) -> None:
        """Stop guarding one map (before it is closed), keeping whether it faulted."""
        path = self._slots.pop(slot, None)
        self._tokens.pop(slot, None)
        if path is not None and _sigbus.unregister(slot):
            self._faulted.append(path)

    def faulted(self) -> list[str]:
        """The files whose maps were read past their end so far: they were cut short while being read."""
        live = [path for slot, path in list(self._slots.items()) if _sigbus.hits(slot)]
        return self._faulted + live

    def close(self) -> None:
        for slot in list(self._slots):
            self.release(slot)


def current() -> Guard | None:
    """The guard active on this thread, if any."""
    return getattr(_local, "guard", None)


@contextmanager
def guard(reading: bool = False) -> Iterator[Guard]:
    """Guard the maps made here on this thread (and those given the guard); refuse a file cut short meanwhile.

    On leaving, a file any map of which was read past its end raises `changed_while_read` (with
    `reading`, for a command that commits nothing, its message for reading), whatever else was
    raised meanwhile (zeros read in place of its bytes can fail any parser).
    """
    if _sigbus is not None:
        _sigbus.install()  # again each time: faulthandler.enable() may have taken SIGBUS since
    outer, made = current(), Guard(reading)
    _local.guard = made
    try:
        yield made
    except BaseException:
        _refuse(made)
        raise
    finally:
        _local.guard = outer
    _refuse(made)


def _refuse(made: Guard) -> None:
    made.close()
    faulted = made.faulted()
    if faulted:
        raise changed_while_read(faulted[0], committing=not made.reading) from None


def open_map(path: str | os.PathLike, writable: bool = False, within: Guard | None = None) -> mmap.mmap | None:
    """A map of the whole file (None where it is empty), registered with `within` or the thread's guard.

    `writable`: a private copy-on-write map (arrays torch may write to; the file is untouched).
    """
    return _open(path, writable, within or current())[0]


def _open(path: str | os.PathLike, writable: bool, within: Guard | None) -> tuple[mmap.mmap | None, int]:
    """The map and its slot in `within` (-1 where it is not registered)."""
    with open(path, "rb") as handle:
        if not os.fstat(handle.fileno()).st_size:
            return None, -1
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY if writable else mmap.ACCESS_READ)
    return data, within.add(data, path) if within is not None else -1


def _address(data: mmap.mmap) -> int:
    """The map's first address, from the native module; through numpy where that build predates `address`."""
    if hasattr(_sigbus, "address"):
        return _sigbus.address(data)
    import numpy as np  # a checkout updated without a rebuild (`pip install -e .` again): guarded as before

    return np.frombuffer(data, np.uint8).ctypes.data


def array(path: str | os.PathLike, writable: bool = False) -> np.ndarray:
    """The file's bytes as a uint8 array over `open_map`'s map (read-only unless `writable`)."""
    import numpy as np  # here only: `ckpt status` hashes files through this module without numpy

    data = open_map(path, writable)
    return np.empty(0, dtype=np.uint8) if data is None else np.frombuffer(data, dtype=np.uint8)


def allow_open_files(count: int) -> None:
    """Raise this process's soft limit on open files (up to its hard limit) to hold `count` maps and the rest.

    Each map keeps a descriptor until it goes, and a commit keeps a folder's maps until it is recorded:
    a Trainer folder with a file per rank passes the usual soft limit of 1024 from about a thousand ranks.
    A copy of the small files instead would hide a file rewritten in place while it is committed.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = count + 256  # the process's other files: the database, objects, sockets
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else
                                                        min(wanted, hard), hard))
    except (ImportError, OSError, ValueError):  # not on this platform, or not allowed: the limit stays
        pass


def file_digest(path: str | os.PathLike, within: Guard | None = None) -> str:
    """blake3 of a file's bytes on one thread, hashed from a guarded map (as fast as blake3's own map).

    With no guard given or active, it guards itself: a file cut short meanwhile raises.
    """
    active = within or current()
    with nullcontext(active) if active is not None else guard(reading=True) as used:
        data, slot = _open(path, False, used)
        if data is None:
            return bytes_digest(b"")
        try:
            return bytes_digest(data)
        finally:
            used.release(slot)  # before the map goes: its addresses may be reused
            data.close()
