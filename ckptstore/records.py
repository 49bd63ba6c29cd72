"""How one tensor is stored: codec, params, chunk objects and the base it is a residual against (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptstore.hashing import ObjectId, TensorId


@dataclass
class Chunk:
    """One independently decodable slice of a tensor's bytes: a whole object, or a range of a pack."""

    object_id: ObjectId
    raw_bytes: int
    offset: int = 0
    length: int | None = None  # None: the payload is the whole object
    checksum: str | None = None  # hashing.chunk_checksum of the decoded bytes; None before schema 0005


@dataclass
class TensorRecord:
    """The stored form of a tensor id; immutable once written."""

    id: TensorId
    dtype: str
    shape: tuple[int, ...]
    codec: str
    params: dict[str, Any]
    base_id: TensorId | None
    depth: int
    raw_bytes: int
    stored_bytes: int
    chunks: list[Chunk] = field(default_factory=list)

    def cut(self) -> list[int]:
        """The raw size of each chunk: records chained on one another replay chunk by chunk, so a base is cut alike."""
        return [chunk.raw_bytes for chunk in self.chunks]

    def chunk_offsets(self) -> list[int]:
        """Byte offset of each chunk inside the tensor."""
        offsets, cursor = [], 0
        for chunk in self.chunks:
            offsets.append(cursor)
            cursor += chunk.raw_bytes
        return offsets
