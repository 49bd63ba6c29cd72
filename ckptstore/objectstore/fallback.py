"""A local store that fills in the objects it lacks from another store on first read (lazy clones)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from ckptstore.errors import CkptError, CorruptObjectError, DiskFullError, StoreUnavailableError, explain
from ckptstore.hashing import ObjectId
from ckptstore.objectstore.base import ObjectStore, RangeReader, delivered, read_whole
from ckptstore.signals import signals_waiting

UNAVAILABLE_FOR = 60.0  # seconds a source found unavailable is not asked again (about S3's default retry budget)


class FallbackStore:
    """`local`, except that reading an object it lacks first copies it from `source()` (verified on the way).

    Writes, listings and deletes see only `local`: gc and commits work on what is here. The
    source is opened on the first miss, so a checkout of objects already here never connects.
    `keep=False` (a read-only repository): what is read from the source is not written here.
    A source found unavailable stays so for UNAVAILABLE_FOR seconds: each object's read would otherwise
    spend the whole retry budget again, one after another (hours for a checkout); a store kept open
    for a training run's saves (ckptstore.save) asks again after that, not never.
    """

    def __init__(self, local: ObjectStore, source: Callable[[], ObjectStore], keep: bool = True) -> None:
        self.local = local
        self.url = local.url
        self.keep = keep
        self._open_source = source
        self._source: ObjectStore | None = None
        self._lock = threading.Lock()
        self._copying: dict[ObjectId, list] = {}  # [lock, threads using it] by object being copied
        self._unavailable: tuple[StoreUnavailableError, float] | None = None  # why the source failed, and when

    def reading_only(self) -> FallbackStore:
        """The same store, keeping nothing it reads from the source: fsck checks a lazy clone and leaves it lazy."""
        return FallbackStore(self.local, self._open_source, keep=False)

    def source(self, oid: ObjectId) -> ObjectStore:
        """The source, opened on first use; one that cannot be opened makes `oid` (being read) lacking."""
        with self._lock:
            if self._source is None:
                try:
                    self._source = self._open_source()
                except (CkptError, OSError) as exc:  # the origin's folder gone or moved: this object is lacking
                    raise CorruptObjectError(oid, f"not read yet, and the origin it comes from cannot be opened "
                                                  f"({exc}); if it moved: `ckpt remote set-url origin NEW-URL`"
                                             ) from None
            return self._source

    def from_source(self, oid: ObjectId) -> bytes:
        """The object's bytes from the source, verified against its id."""
        source = self.source(oid)
        try:
            return self.reading_source(oid, lambda: source.get(oid))  # get verifies the bytes against the id
        except CorruptObjectError as exc:
            if exc.problem != "missing":
                raise
            # not "run fsck here": what is gone is the origin's (its gc --prune after a branch moved back, a prune)
            raise CorruptObjectError(oid, f"not read yet, and the origin it comes from ({source.url}) no longer "
                                          "holds it: a prune there re-encodes the commits it keeps under new "
                                          "objects, which this clone's records do not name (clone it again to "
                                          "read those), and the objects of commits it removed (a prune, a gc) "
                                          "are gone for good") from None

    def reading_source(self, oid: ObjectId, read: Callable[[], Any]) -> Any:
        """`read()` of the source for `oid`; once the source was unavailable, that error at once, without trying."""
        failed = self._unavailable
        if failed is None or time.monotonic() - failed[1] > UNAVAILABLE_FOR:
            try:
                return read()
            except StoreUnavailableError as exc:  # its retry budget is spent: the next read would spend it again
                failed = self._unavailable = exc, time.monotonic()
        # the command needed the origin: say so, not only that S3 is down
        raise StoreUnavailableError(f"object {oid[:12]} is not held here, and the origin it comes from cannot "
                                    f"be read: {failed[0]}") from None

    def _filled(self, read: Callable[[], Any], oid: ObjectId, held: Callable[[bytes], Any]) -> Any:
        """`read()` of the local store; a missing object is copied here first (or, not kept, `held(its bytes)`).

        A disk here too full to keep it does not fail the read: the bytes are used without keeping
        them, and from then on nothing more is kept (range reads go to the source's own ranges, not a
        whole pack each), as in a read-only repository: reading commands work on a full disk.
        """
        try:
            return read()
        except CorruptObjectError as exc:
            if exc.problem != "missing":
                raise
        # a handler that saves (a SIGTERM's) reads the same chain: run inside the copy, it waited on its locks forever
        with signals_waiting(f"the download of object {oid[:12]} from the origin", "it is here"):
            return self._copied(read, oid, held)

    def _copied(self, read: Callable[[], Any], oid: ObjectId, held: Callable[[bytes], Any]) -> Any:
        """`_filled` of an object not held here: copied from the source once, whichever threads miss it."""
        if not self.keep:  # nothing kept here for a thread to wait for: each reads the source
            return held(self.from_source(oid))
        with self._one_copy(oid):
            try:  # another thread that missed it too may have copied it meanwhile
                return read()
            except CorruptObjectError as exc:
                if exc.problem != "missing":
                    raise
            data = self.from_source(oid)
            try:
                self.local.put(data)
                return read()
            except Exception as exc:
                if not isinstance(explain(exc), DiskFullError):
                    raise
                self.keep = False
        return held(data)

    @contextlib.contextmanager
    def _one_copy(self, oid: ObjectId) -> Iterator[None]:
        """Threads that miss one object at once copy it once: the first downloads, the others wait and read it here."""
        with self._lock:
            entry = self._copying.setdefault(oid, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._copying[oid]

    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        return self._filled(lambda: self.local.get(oid, verify), oid, bytes)

    def view(self, oid: ObjectId, verify: bool = True) -> bytes | memoryview:
        return self._filled(lambda: read_whole(self.local, oid, verify), oid, memoryview)

    def size(self, oid: ObjectId) -> int:
        return self._filled(lambda: self.local.size(oid), oid, len)

    def open_ranges(self) -> RangeReader:
        return FillingRanges(self, self.local.open_ranges())

    def put(self, data: bytes | memoryview) -> ObjectId:
        return self.local.put(data)

    def holds(self, oid: ObjectId, data: Callable[[], bytes | memoryview]) -> bool:
        return self.local.holds(oid, data)

    def has(self, oid: ObjectId) -> bool:
        return self.local.has(oid)

    def iter_sizes(self) -> Iterator[tuple[ObjectId, int]]:
        return self.local.iter_sizes()

    def delete(self, oid: ObjectId) -> None:
        self.local.delete(oid)

    def iter_ids(self) -> Iterator[ObjectId]:
        return self.local.iter_ids()

    def batch(self) -> AbstractContextManager[None]:
        return self.local.batch()

    def clear_tmp(self) -> int:
        return self.local.clear_tmp()


class FillingRanges:
    """Range reads of the local store; a pack it lacks is copied whole first, or (not kept) read from the source."""

    def __init__(self, store: FallbackStore, ranges: RangeReader) -> None:
        self._store = store
        self._ranges = ranges
        self._source: RangeReader | None = None  # the source's own range reads, opened on the first miss

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        if self._store.keep:
            return self._store._filled(lambda: self._ranges.read(oid, offset, length, into), oid,
                                       lambda data: delivered(memoryview(data)[offset:offset + length], into))
        try:
            return self._ranges.read(oid, offset, length, into)
        except CorruptObjectError as exc:
            if exc.problem != "missing":
                raise
        with signals_waiting(f"a read of object {oid[:12]} from the origin", "it is here"):  # as in _filled
            if self._source is None:  # unverified, as range reads are: the replay checks each chunk's checksum
                self._source = self._store.source(oid).open_ranges()
            source = self._source
            return self._store.reading_source(oid, lambda: source.read(oid, offset, length, into))

    def close(self) -> None:
        self._ranges.close()
        if self._source is not None:
            self._source.close()


def held_here(store: ObjectStore) -> ObjectStore:
    """`store` as what it holds now: a FallbackStore's local store, which fills nothing in from its source."""
    return store.local if isinstance(store, FallbackStore) else store
