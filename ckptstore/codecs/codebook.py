"""Non-uniform scalar quantization: a per-chunk codebook fitted to the values, entropy-coded indices.

The weight quantizer (deadzone.py) offers every chunk this alternative to its uniform dead-zone
levels and keeps whichever payload is smaller at no larger error: the fewest levels (2 to 256,
1-8 bits) whose Lloyd-Max codebook, fitted to a sample of the chunk's values (the keyframe values
or the closed-loop residual), gives an error no larger than the dead-zone levels' (in total, and
on every entry: the dead zone's bound of half a step, or its wider dead zone, is kept). Entropy-coded
uniform levels are close to optimal for smooth, single-peaked values, so the codebook mostly wins
where the values cluster (a few distinct updates, multi-modal weights); the sample decides before
anything is coded in full, so trying costs little.

Layout: b"CB1", has-base flag (u8), the chunk's dead-zone step (f32, kept so that callers can
tell a capped step as for dead-zone payloads), centroid count K (u16), K float32 centroids in
ascending order, then the entropy-coded indices.
"""

from __future__ import annotations

import struct

import numpy as np

from ckptstore.codecs.entropy import decode_symbols, encode_symbols
from ckptstore.errors import CodecError

MAGIC = b"CB1"
_HEAD = struct.Struct("<3sBfH")
MAX_BITS = 8
SAMPLE = 4096
ITERATIONS = 8
WIN_MARGIN = 0.97  # the sample's estimate must beat the dead-zone payload by this before coding in full


def fit(values: np.ndarray, levels: int, iterations: int = ITERATIONS) -> np.ndarray:
    """Lloyd-Max centroids (ascending, distinct float32) for `values`, started at their quantiles."""
    centroids = np.unique(np.quantile(values, (np.arange(levels) + 0.5) / levels).astype(np.float32))
    for _ in range(iterations):
        if centroids.size < 2:
            break
        index = assign(values, centroids)
        counts = np.bincount(index, minlength=centroids.size)
        sums = np.bincount(index, weights=values, minlength=centroids.size)
        filled = counts > 0
        centroids = np.unique((sums[filled] / counts[filled]).astype(np.float32))
    return centroids


def assign(values: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The index of the nearest centroid for each value."""
    return np.searchsorted((centroids[1:] + centroids[:-1]) / np.float32(2), values).astype(np.int32)


def _estimated_bytes(index: np.ndarray, levels: int, count: int) -> float:
    """Order-0 entropy of the sample's indices scaled to `count` values, plus the table and header."""
    p = np.bincount(index) / index.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) * count / 8 + 4 * levels + _HEAD.size + 16


def _exceeds(error: np.ndarray, max_error_sq: float, max_error: float) -> bool:
    """Whether `error` sums to more than `max_error_sq` squared, or any entry is off by more than `max_error`."""
    return float(np.sum(error.astype(np.float64) ** 2)) > max_error_sq or float(np.abs(error).max()) > max_error


def try_encode(target: np.ndarray, max_error_sq: float, max_error: float, beat_bytes: int, has_base: bool,
               step: float, seed: int = 0) -> tuple[bytes, np.ndarray] | None:
    """(payload, float32 update) coding `target` with a codebook, if it beats `beat_bytes` at no more error.

    `max_error_sq` is the dead-zone levels' summed squared error on `target` and `max_error` their
    bound on any one entry, which the codebook must keep too (the closed loop's guarantee). None
    when no codebook of at most 2**MAX_BITS levels is estimated, on a sample, to be smaller within
    both, or when coding it in full does not confirm it.
    """
    count = target.size
    if count == 0 or not np.isfinite(max_error_sq):
        return None
    rng = np.random.default_rng(seed)
    sample = target if count <= SAMPLE else target[rng.integers(0, count, SAMPLE)]
    allowed = max_error_sq / count * sample.size
    for bits in range(1, MAX_BITS + 1):
        centroids = fit(sample, 1 << bits)
        index = assign(sample, centroids)
        if _exceeds(centroids[index] - sample, allowed, max_error):
            continue
        if _estimated_bytes(index, centroids.size, count) > WIN_MARGIN * beat_bytes:
            return None
        full = assign(target, centroids)
        update = centroids[full]
        if _exceeds(update - target, max_error_sq, max_error):
            return None
        payload = _HEAD.pack(MAGIC, has_base, step, centroids.size) + centroids.tobytes() + encode_symbols(full)
        return (payload, update) if len(payload) < beat_bytes else None
    return None


def is_codebook(payload: bytes | memoryview) -> bool:
    return bytes(payload[:3]) == MAGIC


def head(payload: bytes | memoryview) -> tuple[int, float]:
    """(has base, step) of a codebook payload."""
    if len(payload) < _HEAD.size or not is_codebook(payload):
        raise CodecError("codebook: payload does not start with a valid header")
    _, has_base, step, _ = _HEAD.unpack_from(payload)
    return has_base, step


def stream_start(payload: bytes | memoryview) -> int:
    """Where a codebook payload's index stream starts: after its header and its table of centroids."""
    head(payload)
    return _HEAD.size + 4 * _HEAD.unpack_from(payload)[3]


def decode_update(payload: bytes | memoryview, limit: int | None = None) -> np.ndarray:
    """The float32 values (keyframe) or update (residual) a codebook payload holds (at most `limit`)."""
    head(payload)
    levels = _HEAD.unpack_from(payload)[3]
    end = _HEAD.size + 4 * levels
    if levels == 0 or len(payload) < end:
        raise CodecError("codebook: payload is shorter than its table")
    centroids = np.frombuffer(payload, np.float32, levels, _HEAD.size)
    index = decode_symbols(memoryview(payload)[end:], limit=limit)
    if index.size and (index.min() < 0 or index.max() >= levels):
        raise CodecError("codebook: an index points outside the table")
    return centroids[index]
