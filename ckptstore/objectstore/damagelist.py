"""The local store's list of objects a read found corrupted: what a commit must store again.

A commit checks that the objects it reuses are there (one stat each), never their hashes: a flipped
byte under the right name passed for whole, and committing the file again reused the damaged object
("0 B new"). Every verified read that finds an object not matching its hash (fsck, a checkout, a
commit decoding its parent) lists its id in `damaged` in the store's folder; the store then counts it
as lacking, so the next commit holding its tensor encodes it again, and the put that writes the
object's exact bytes takes the id off the list.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ckptstore.hashing import ObjectId, is_hex_id

NAME = "damaged"  # beside the fan-out folders, which every listing of objects takes alone (two-letter names)


class DamageList:
    """Ids one a line; appended under a flock, rewritten whole to a temp file that replaces it (never half read).

    Best effort: a store this process may not write (a read-only mount, another user's) lists nothing,
    and the damage is still reported as it was; `notes` False (a read-only open) writes nothing at all.
    """

    def __init__(self, path: Path, scratch: Callable[[], Path], notes: bool = True) -> None:
        self.path = path
        self._scratch = scratch  # a folder on the list's file system, for the rewrite's temp file
        self.notes = notes
        self._cache: tuple[tuple[int, int, int] | None, frozenset[ObjectId]] = (None, frozenset())
        self._lock = threading.Lock()

    def ids(self) -> frozenset[ObjectId]:
        """The listed ids: one stat, and a read only when the file changed since the last."""
        try:
            stat = self.path.stat()
        except OSError:  # none listed (or none readable: nothing to go by)
            return frozenset()
        stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if self._cache[0] == stamp:
                return self._cache[1]
        try:
            text = self.path.read_text(errors="replace")
        except OSError:
            return frozenset()
        listed = frozenset(ObjectId(line) for line in text.split() if is_hex_id(line))
        with self._lock:
            self._cache = (stamp, listed)
        return listed

    def add(self, oid: ObjectId) -> None:
        """List `oid` (once); where the list cannot be written, nothing (the read's error still says the damage)."""
        if not self.notes or oid in self.ids():
            return
        with contextlib.suppress(OSError), self._locked() as fd:
            os.write(fd, f"{oid}\n".encode())

    def discard(self, oids: Iterable[ObjectId]) -> None:
        """Take `oids` off the list (stored whole again, or deleted); nothing to do costs one stat."""
        gone = self.ids() & set(oids)
        if not gone:
            return
        with contextlib.suppress(OSError), self._locked() as fd:
            with open(fd, closefd=False, errors="replace") as handle:
                kept = sorted({line for line in handle.read().split() if is_hex_id(line)} - gone)
            if not kept:
                self.path.unlink()
                return
            scratch = self._scratch()
            scratch.mkdir(parents=True, exist_ok=True)
            temp = scratch / f"{NAME}.{uuid.uuid4().hex}"
            try:
                temp.write_text("".join(f"{oid}\n" for oid in kept))
                os.replace(temp, self.path)
            finally:
                temp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """A descriptor of the list (made if missing), appending, flocked: the file the path names once locked."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)  # the umask decides, as for objects
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _same_file(fd, self.path):  # else a rewrite replaced it meanwhile: lock the new one
                    yield fd
                    return
            finally:
                os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:  # emptied and removed meanwhile
        return False
