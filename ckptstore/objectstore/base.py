"""The object store contract: immutable, content-addressed blobs, and the optional capabilities.

Every method the code calls is named here. A capability only some stores have (the local
store's memory maps) is a protocol of its own, tested in one place: `read_whole`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

from ckptstore.hashing import ObjectId


class RangeReader(Protocol):
    """Unverified reads of object byte ranges, handles kept open until `close()`.

    A replay reads many payloads from a few packs.
    """

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        """Bytes [offset, offset + length) of `oid`; a missing object or short read is a CorruptObjectError.

        With `into` (a writable buffer of at least `length` bytes) they are read into it and a view is returned.
        """

    def close(self) -> None:
        """Release the handles."""


@runtime_checkable
class ObjectStore(Protocol):
    """Immutable blobs named by the blake3 of their bytes."""

    url: str

    def put(self, data: bytes | memoryview) -> ObjectId:
        """Store `data` durably (or, inside `batch()`, by the block's end) and return its id.

        An object already stored under that id is kept only when it holds exactly `data` (a
        crash or a bad disk can leave a damaged file under the right name); otherwise it is replaced.
        """

    def get(self, oid: ObjectId, verify: bool = True) -> bytes:
        """Return the bytes of `oid`, verified against the id; raise CorruptObjectError otherwise.

        `verify=False` skips the hash for callers that verify what they decode from the bytes.
        """

    def has(self, oid: ObjectId) -> bool:
        """True when `oid` is present (its content is not verified)."""

    def holds(self, oid: ObjectId, data: Callable[[], bytes | memoryview]) -> bool:
        """True when `oid` is stored with exactly its bytes: a name, or a size, is no proof.

        A store with its copy at hand checks that copy against the id; a bucket compares the
        object's ETag with the MD5 of `data()` (the bytes, called only when it needs them), or
        where its ETags are no MD5s, reads the object back.
        """

    def delete(self, oid: ObjectId) -> None:
        """Remove `oid`; removing an absent object is not an error."""

    def iter_ids(self) -> Iterator[ObjectId]:
        """Every stored id, in no particular order."""

    def iter_sizes(self) -> Iterator[tuple[ObjectId, int]]:
        """Every stored id with its size, in one listing (a bucket lists sizes with names)."""

    def size(self, oid: ObjectId) -> int:
        """Stored size in bytes of `oid`; CorruptObjectError when it is missing."""

    def open_ranges(self) -> RangeReader:
        """A reader of byte ranges of objects (see RangeReader); close it when done."""

    def batch(self) -> AbstractContextManager[None]:
        """Puts inside the block become durable together at its end.

        Nothing put inside the block may be referenced by metadata until the block has exited.
        """

    def clear_tmp(self) -> int:
        """Remove leftovers of interrupted writes; returns how many were removed."""


@runtime_checkable
class MappedObjects(Protocol):
    """A store that can hand out an object's bytes as a memory map instead of a copy."""

    def view(self, oid: ObjectId, verify: bool = True) -> bytes | memoryview:
        """The bytes of `oid`, read-only, valid while referenced."""


@runtime_checkable
class ReadsAhead(Protocol):
    """A store across a network: reading objects ahead of use hides each request's round trip."""

    def read_ahead(self, oids: Iterable[ObjectId]) -> AbstractContextManager[None]:
        """Fetch `oids` in the background, in this order, while the block runs; `view`/`get` take them from there."""


@runtime_checkable
class WritesParts(Protocol):
    """A store that writes an object given as consecutive parts without joining them first."""

    def put_parts(self, parts: Sequence[bytes | memoryview]) -> ObjectId:
        """`put(b"".join(parts))`, without the join's copy."""


@runtime_checkable
class KnowsItsObjects(Protocol):
    """A store that tells which objects it lacks without a request per object (a local folder, memory)."""

    def lacking(self, oids: Iterable[ObjectId]) -> set[ObjectId]:
        """The `oids` this store does not hold."""


def tells_lacking(store: ObjectStore) -> bool:
    """Whether `store` says cheaply which objects it lacks (`lacking` answers "none" for the others)."""
    return isinstance(store, KnowsItsObjects)


def lacking(store: ObjectStore, oids: Iterable[ObjectId]) -> set[ObjectId]:
    """The `oids` the store lacks where it can tell cheaply; else none (a bucket is not asked per object)."""
    if tells_lacking(store):
        return store.lacking(oids)
    return set()


def put_parts(store: ObjectStore, parts: Sequence[bytes | memoryview]) -> ObjectId:
    """Store the concatenation of `parts`: written part by part where the store can, else joined first.

    A commit's chunk payloads are a header and one part per byte plane, and a pack many payloads;
    joining them copied every stored byte once or twice before the write copied it again.
    """
    if isinstance(store, WritesParts):
        return store.put_parts(parts)
    return store.put(parts[0] if len(parts) == 1 else b"".join(parts))


def reading_ahead(store: ObjectStore, oids: Iterable[ObjectId]) -> AbstractContextManager[None]:
    """`store.read_ahead(oids)` where the store can, else nothing."""
    if isinstance(store, ReadsAhead):
        return store.read_ahead(oids)
    return nullcontext()


def delivered(data: bytes | memoryview, into: Any = None) -> bytes | memoryview:
    """`data` itself, or copied to the front of the buffer `into` and viewed there (RangeReader.read's `into`)."""
    if into is None:
        return data
    view = memoryview(into)[: len(data)]
    view[:] = data
    return view


def read_whole(store: ObjectStore, oid: ObjectId, verify: bool = True) -> bytes | memoryview:
    """An object's bytes: mapped where the store can, else read."""
    if isinstance(store, MappedObjects):
        return store.view(oid, verify)
    return store.get(oid, verify)


def as_bytes(data: bytes | memoryview) -> bytes | memoryview:
    """`data` as flat unsigned bytes, so that `==` compares bytes (a typed view compares its items)."""
    if isinstance(data, bytes):
        return data
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
