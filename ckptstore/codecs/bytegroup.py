"""Lossless codec: byte planes, each stored raw, zstd-compressed, or XORed with the base's plane.

Planes are all first bytes, then all second bytes, and so on; each plane takes whichever mode a
sample says is smallest.

Exponent bytes of floats are highly redundant and mostly unchanged between checkpoints, while
mantissa noise is not compressible at all; grouping bytes lets zstd see the first and lets us skip
the second cheaply. Chunk layout: b"BG1", width (u8), plane count (u16), then per plane
mode (u8) and payload length (u64), then the payloads in order.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import numpy as np
import zstandard

from ckptstore.errors import CodecError

MAGIC = b"BG1"
RAW, ZSTD, XOR_ZSTD = 0, 1, 2
_HEAD = struct.Struct("<3sBH")
_PLANE = struct.Struct("<BQ")
SAMPLE_BYTES = 1 << 14
SAMPLES = 4
INCOMPRESSIBLE = 0.97

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _sample(plane: np.ndarray) -> np.ndarray:
    """A few blocks spread over the plane: enough to guess which mode compresses best."""
    if plane.size <= SAMPLES * SAMPLE_BYTES:
        return plane
    starts = np.linspace(0, plane.size - SAMPLE_BYTES, SAMPLES).astype(np.int64)
    return np.concatenate([plane[s : s + SAMPLE_BYTES] for s in starts])


def _planes(data: np.ndarray, width: int) -> np.ndarray:
    return data.reshape(-1, width)


class ByteGroupCodec:
    """Byte-grouped zstd, with XOR residual planes when a base is given."""

    codec_id = "bytegroup"

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        width = int(params["width"])
        compressor = _compressor(int(params.get("level", 1)))
        if data.size % width:
            raise CodecError(f"bytegroup: {data.size} bytes is not a multiple of width {width}")
        grid = _planes(data, width)
        base_grid = _planes(base, width) if base is not None else None
        headers, payloads = [], []
        for j in range(width):
            plane = np.ascontiguousarray(grid[:, j])
            candidates = [(ZSTD, plane)]
            if base_grid is not None:
                candidates.append((XOR_ZSTD, plane ^ base_grid[:, j]))
            mode, chosen = self._pick(candidates, compressor)
            payload = plane.tobytes() if mode == RAW else compressor.compress(chosen)
            if mode != RAW and len(payload) >= plane.size:
                mode, payload = RAW, plane.tobytes()
            headers.append(_PLANE.pack(mode, len(payload)))
            payloads.append(payload)
        return b"".join([_HEAD.pack(MAGIC, width, width), *headers, *payloads])

    @staticmethod
    def _pick(candidates: list[tuple[int, np.ndarray]], compressor: zstandard.ZstdCompressor):
        """Choose the mode whose sample compresses smallest; RAW when nothing compresses."""
        best_mode, best_plane, best_size = RAW, candidates[0][1], None
        for mode, plane in candidates:
            sample = _sample(plane)
            size = len(compressor.compress(sample)) / max(sample.size, 1)
            if size < INCOMPRESSIBLE and (best_size is None or size < best_size):
                best_mode, best_plane, best_size = mode, plane, size
        return best_mode, best_plane

    def _parse(self, payload: bytes) -> tuple[int, list[tuple[int, int, int]]]:
        if len(payload) < _HEAD.size:
            raise CodecError(f"bytegroup: payload of {len(payload)} bytes is truncated")
        magic, width, count = _HEAD.unpack_from(payload)
        if magic != MAGIC or count != width:
            raise CodecError("bytegroup: payload does not start with a valid header")
        planes, offset = [], _HEAD.size + count * _PLANE.size
        for j in range(count):
            mode, length = _PLANE.unpack_from(payload, _HEAD.size + j * _PLANE.size)
            planes.append((mode, offset, length))
            offset += length
        if offset != len(payload):
            raise CodecError(f"bytegroup: payload is {len(payload)} bytes, header says {offset}")
        return width, planes

    def needs_base(self, payload: bytes) -> bool:
        return any(mode == XOR_ZSTD for mode, _, _ in self._parse(payload)[1])

    def decode(
        self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int
    ) -> np.ndarray:
        width, planes = self._parse(payload)
        rows = nbytes // width
        needs_base = any(mode == XOR_ZSTD for mode, _, _ in planes)
        if needs_base and (base is None or base.size != nbytes):
            raise CodecError("bytegroup: residual chunk decoded without its base")
        out = base if base is not None else np.empty(nbytes, dtype=np.uint8)
        grid = _planes(out, width)
        view = memoryview(payload)
        for j, (mode, offset, length) in enumerate(planes):
            if mode == RAW:
                plane = np.frombuffer(view[offset : offset + length], dtype=np.uint8)
            else:
                try:
                    raw = _decompressor().decompress(view[offset : offset + length], max_output_size=rows)
                except zstandard.ZstdError as exc:
                    raise CodecError(f"bytegroup: plane {j} does not decompress: {exc}") from None
                plane = np.frombuffer(raw, dtype=np.uint8)
            if plane.size != rows:
                raise CodecError(f"bytegroup: plane {j} has {plane.size} bytes, expected {rows}")
            if mode == XOR_ZSTD:
                grid[:, j] ^= plane
            else:
                grid[:, j] = plane
        return out
