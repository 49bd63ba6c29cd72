"""Per-thread reusable objects for the decoding hot paths: zstd decompressors and scratch buffers.

Making a decompressor per payload costs more than decoding a small one, and decoding into fresh
memory costs a page fault per 4 KiB; each replay thread keeps its own and reuses them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import zstandard

if TYPE_CHECKING:
    import numpy as np

_local = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def decompress_at_most(frame: bytes | memoryview, limit: int) -> bytes:
    """A zstd frame's content, of at most `limit` bytes; ValueError before allocating when its header declares more.

    zstd sizes its output by the content size a frame header declares (max_output_size bounds
    only frames that declare none), so a damaged header could make it allocate gigabytes.
    """
    declared = zstandard.frame_content_size(frame)  # -1: not declared
    if declared > limit:
        raise ValueError(f"a zstd frame declares {declared} bytes where at most {limit} fit")
    return decompressor().decompress(frame, max_output_size=max(limit, 1))


def scratch(kind: str, slot: int, size: int) -> np.ndarray:
    """`size` bytes (uint8) of this thread's buffer for (`kind`, `slot`), valid until the next call for them."""
    import numpy as np  # here only: reading a manifest (`ckpt status`) needs the decompressor, not numpy

    buffers = _local.__dict__.setdefault("scratch", {})
    key = (kind, slot)
    if key not in buffers or buffers[key].size < size:
        buffers[key] = np.empty(size, np.uint8)
    return buffers[key][:size]
