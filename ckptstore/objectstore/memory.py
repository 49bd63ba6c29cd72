"""An in-memory object store, for tests and scratch work."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id
from ckptstore.objectstore.base import as_bytes, delivered


class MemoryRanges:
    """The memory store's RangeReader: slices of the stored bytes."""

    def __init__(self, store: MemoryObjectStore) -> None:
        self._store = store

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        data = self._store.get(oid, verify=False)[offset : offset + length]
        if len(data) != length:
            raise CorruptObjectError(oid, f"shorter than its chunks say ({offset + len(data)} bytes)")
        return delivered(data, into)

    def close(self) -> None:
        pass


class MemoryObjectStore:
    """Objects in a dict; verifies hashes on read like the real stores."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self.objects: dict[ObjectId, bytes] = {}

    def put(self, data: bytes | memoryview) -> ObjectId:
        oid = object_id(data)
        if self.objects.get(oid) != as_bytes(data):  # absent, or damaged in place: store these bytes
            self.objects[oid] = bytes(data)
        return oid

    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        if oid not in self.objects:
            raise CorruptObjectError(oid, "missing")
        data = self.objects[oid]
        if verify and object_id(data) != oid:
            raise CorruptObjectError(oid, "corrupted")
        return data

    def has(self, oid: ObjectId) -> bool:
        return oid in self.objects

    def holds(self, oid: ObjectId, data: Callable[[], bytes | memoryview]) -> bool:
        return oid in self.objects and object_id(self.objects[oid]) == oid

    def lacking(self, oids: Iterable[ObjectId]) -> set[ObjectId]:
        return {oid for oid in oids if not self.has(oid)}

    def delete(self, oid: ObjectId) -> None:
        self.objects.pop(oid, None)

    def iter_ids(self) -> Iterator[ObjectId]:
        return iter(list(self.objects))

    def iter_sizes(self) -> Iterator[tuple[ObjectId, int]]:
        return iter([(oid, len(data)) for oid, data in self.objects.items()])

    def size(self, oid: ObjectId) -> int:
        if oid not in self.objects:
            raise CorruptObjectError(oid, "missing")
        return len(self.objects[oid])

    def open_ranges(self) -> MemoryRanges:
        return MemoryRanges(self)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield  # puts are complete at once; nothing to flush

    def clear_tmp(self) -> int:
        return 0
