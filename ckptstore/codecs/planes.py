"""Byte planes to elements and back: the native loops (codecs/_planes.c) when built, else numpy.

Both give the same bytes; the native ones compose whole elements per iteration and release the
GIL, 4x numpy's strided copies for 4-byte elements and 10x for 2-byte ones (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np

try:
    from ckptstore.codecs import _planes as native
except ImportError:  # built without a C compiler: numpy does the same, about 3x slower
    native = None


def interleave(planes: list[np.ndarray], out: np.ndarray, use_native: bool = True) -> np.ndarray:
    """Write `out[i * width + j] = planes[j][i]`: byte planes back into elements (`out` contiguous)."""
    if native is not None and use_native:
        native.interleave(planes, out)
        return out
    grid = out.reshape(-1, len(planes))
    for j, plane in enumerate(planes):
        grid[:, j] = plane
    return out


def group(data: np.ndarray, width: int, use_native: bool = True) -> np.ndarray:
    """The byte planes of `data` (contiguous uint8) as rows of a (width, len / width) array."""
    if native is not None and use_native:
        planes = np.empty((width, data.size // width), dtype=np.uint8)
        native.deinterleave(data, width, planes)
        return planes
    return data.reshape(-1, width).T.copy()
