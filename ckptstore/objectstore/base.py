"""The object store contract: five methods over immutable, content-addressed blobs (and one optional)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from ckptstore.hashing import ObjectId


@runtime_checkable
class ObjectStore(Protocol):
    """Immutable blobs named by the blake3 of their bytes."""

    def put(self, data: bytes | memoryview) -> ObjectId:
        """Store `data` durably and return its id; storing existing content is a cheap no-op."""

    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        """Return the bytes of `oid`, verified against the id; raise CorruptObjectError otherwise.

        `verify=False` skips the hash for callers that verify what they decode from the bytes.
        """

    def has(self, oid: ObjectId) -> bool:
        """True when `oid` is present (its content is not verified)."""

    def delete(self, oid: ObjectId) -> None:
        """Remove `oid`; removing an absent object is not an error."""

    def iter_ids(self) -> Iterator[ObjectId]:
        """Every stored id, in no particular order."""


class RangeReader(Protocol):
    """What a store's optional `open_ranges()` returns: unverified reads of object byte ranges.

    Handles stay open until `close()`: a replay reads many payloads from a few packs.
    """

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        """Bytes [offset, offset + length) of `oid`; a missing object or short read is a CorruptObjectError.

        With `into` (a writable buffer of at least `length` bytes) they are read into it and a view is returned.
        """

    def close(self) -> None:
        """Release the handles."""
