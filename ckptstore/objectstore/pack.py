"""Pack objects: many small payloads written as one object and read back by byte range.

A pack is the plain concatenation of its payloads, with no header; the metadata records each
payload as (pack object id, offset, length). A file per small payload cost more than its bytes,
so payloads under PACK_BELOW are packed, and a pack closes once it holds PACK_BYTES.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptstore import faults
from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId
from ckptstore.objectstore.base import ObjectStore, RangeReader, as_bytes, put_parts, read_whole

PACK_BELOW = 1 << 20
PACK_BYTES = 32 << 20
# Bounds on what a chunk record may ask of a pack. Packed payloads are under PACK_BELOW, so a
# longer range is damage, refused before a buffer that size is allocated; offsets stay far below
# what the OS's pread takes.
MAX_PACKED_LENGTH = PACK_BYTES
MAX_PACK_END = 1 << 40


def check_range(oid: ObjectId, offset: int, length: int) -> None:
    """CorruptObjectError for a range no pack can hold (negative, too long, too far), before anything is allocated."""
    if not (0 <= offset and 0 <= length <= MAX_PACKED_LENGTH and offset + length <= MAX_PACK_END):
        raise CorruptObjectError(oid, f"named as holding bytes {offset}..{offset + length} of a pack, which no pack "
                                      "holds (the chunk record is damaged)")


@dataclass
class PackSlot:
    """Where a payload given to a PackWriter lands; `object_id` is set when its pack is written."""

    length: int
    offset: int = 0
    object_id: ObjectId | None = None


class PackWriter:
    """Collects payloads and writes a pack whenever the next one would overflow it.

    At most one pack's worth of payloads waits in memory.
    """

    def __init__(self, store: ObjectStore, limit: int | None = None) -> None:
        self.store = store
        self.limit = PACK_BYTES if limit is None else limit
        self._payloads: list[bytes | memoryview] = []
        self._slots: list[PackSlot] = []
        self._filled = 0

    def add(self, payload: bytes | Sequence[bytes | memoryview]) -> PackSlot:
        """Queue `payload` (bytes, or consecutive parts) for a pack; its slot is complete once the pack is written."""
        single = isinstance(payload, (bytes, bytearray, memoryview))
        parts = [as_bytes(payload)] if single else [as_bytes(p) for p in payload]
        length = sum(len(p) for p in parts)
        if self._filled + length > self.limit:
            self.close()
        slot = PackSlot(length, self._filled)
        self._payloads.extend(parts)
        self._slots.append(slot)
        self._filled += length
        return slot

    def close(self) -> None:
        """Write the pending payloads as one pack (nothing when none are pending), part by part where the store can."""
        if self._payloads:
            oid = put_parts(self.store, self._payloads)
            faults.point("pack-written")
            for slot in self._slots:
                slot.object_id = oid
        self._payloads, self._slots, self._filled = [], [], 0


class PackReader:
    """Reads payloads out of packs.

    With `ranges` (a store's open_ranges(), for callers that verify what they decode), each
    payload is read alone and nothing is cached. Otherwise a pack is read whole and verified
    once, and the most recently used packs are kept up to `cache_bytes`: chunks are replayed in
    about the order they were packed, so a pack is rarely read twice.
    """

    def __init__(self, store: ObjectStore, verify: bool = True, ranges: RangeReader | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        self.store = store
        self.verify = verify
        self.ranges = ranges
        self.cache_bytes = cache_bytes
        self._packs: OrderedDict[ObjectId, Future] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, oid: ObjectId, offset: int, length: int, into: Any = None) -> bytes | memoryview:
        """Bytes [offset, offset + length) of pack `oid` (into `into` when reading a range alone).

        A range no pack can hold (negative, too long, past the pack's end) is a CorruptObjectError:
        the chunk record naming it is damaged.
        """
        check_range(oid, offset, length)
        if self.ranges is not None:
            return self.ranges.read(oid, offset, length, into)
        pack = self._pack(oid)
        if offset + length > len(pack):
            raise CorruptObjectError(oid, f"{len(pack)} bytes long, shorter than a chunk record says (it reads to "
                                          f"{offset + length}: the object cut short, or the record damaged)")
        return memoryview(pack)[offset : offset + length]

    def _pack(self, oid: ObjectId) -> bytes | memoryview:
        with self._lock:
            pending = self._packs.get(oid)
            owner = pending is None
            if owner:
                pending = self._packs[oid] = Future()
            self._packs.move_to_end(oid)
        if owner:
            try:
                pending.set_result(read_whole(self.store, oid, self.verify))
            except BaseException as exc:
                pending.set_exception(exc)
            self._evict()
        return pending.result()

    def _evict(self) -> None:
        """Drop the least recently used packs beyond `cache_bytes` (the newest always stays)."""
        with self._lock:
            held = [(oid, f) for oid, f in self._packs.items() if f.done() and f.exception() is None]
            total = sum(len(f.result()) for _, f in held)
            for oid, future in held[:-1]:
                if total <= self.cache_bytes:
                    break
                total -= len(future.result())
                del self._packs[oid]
