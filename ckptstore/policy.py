"""Per tensor: keyframe or residual against the parent, and the codec parameters to use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.codecs.record import TensorRecord

LOSSLESS_CODEC = "bytegroup"


@dataclass(frozen=True)
class EncodingSettings:
    """Repository-wide knobs that decide how tensors are encoded."""

    max_chain: int = 8
    chunk_bytes: int = 4 << 20
    zstd_level: int = 1


@dataclass
class EncodePlan:
    """What the writer does with one new tensor."""

    codec: str
    params: dict[str, Any]
    base: TensorRecord | None

    @property
    def depth(self) -> int:
        return 0 if self.base is None else self.base.depth + 1


def plan_tensor(dtype: str, nbytes: int, itemsize: int, parent: TensorRecord | None,
                settings: EncodingSettings) -> EncodePlan:
    """Residual against the parent's tensor when it has the same layout and the chain has room."""
    chunk_bytes = max(itemsize, settings.chunk_bytes // itemsize * itemsize)
    usable = (
        parent is not None
        and parent.codec == LOSSLESS_CODEC
        and parent.dtype == dtype
        and parent.raw_bytes == nbytes
        and parent.depth + 1 <= settings.max_chain
        and nbytes > 0
    )
    if usable:
        chunk_bytes = int(parent.params["chunk_bytes"])
    params = {"width": itemsize, "level": settings.zstd_level, "chunk_bytes": chunk_bytes}
    return EncodePlan(LOSSLESS_CODEC, params, parent if usable else None)


def chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """Split `nbytes` into chunks of `chunk_bytes` (the last may be shorter); one empty chunk for 0."""
    if nbytes == 0:
        return [0]
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])
