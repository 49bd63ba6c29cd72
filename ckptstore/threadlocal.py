"""Per-thread reusable objects for the decoding hot paths: zstd decompressors and scratch buffers.

Making a decompressor per payload costs more than decoding a small one, and decoding into fresh
memory costs a page fault per 4 KiB; each replay thread keeps its own and reuses them.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

_local = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def scratch(kind: str, slot: int, size: int) -> np.ndarray:
    """`size` bytes (uint8) of this thread's buffer for (`kind`, `slot`), valid until the next call for them."""
    buffers = _local.__dict__.setdefault("scratch", {})
    key = (kind, slot)
    if key not in buffers or buffers[key].size < size:
        buffers[key] = np.empty(size, np.uint8)
    return buffers[key][:size]
