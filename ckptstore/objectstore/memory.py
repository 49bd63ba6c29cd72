"""An in-memory object store, for tests and scratch work."""

from __future__ import annotations

from collections.abc import Iterator

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId, object_id


class MemoryObjectStore:
    """Objects in a dict; verifies hashes on read like the real stores."""

    def __init__(self) -> None:
        self.objects: dict[ObjectId, bytes] = {}

    def put(self, data: bytes | memoryview) -> ObjectId:
        oid = object_id(data)
        self.objects.setdefault(oid, bytes(data))
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

    def delete(self, oid: ObjectId) -> None:
        self.objects.pop(oid, None)

    def iter_ids(self) -> Iterator[ObjectId]:
        return iter(list(self.objects))

    def size(self, oid: ObjectId) -> int:
        if oid not in self.objects:
            raise CorruptObjectError(oid, "missing")
        return len(self.objects[oid])
