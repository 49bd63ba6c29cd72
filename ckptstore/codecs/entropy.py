"""Entropy coding of integer symbol streams (quantized values), choosing the smaller of two coders.

- `zstd`: symbols as int8 (or int16) bytes, zstd level 3; decodes at GB/s.
- `constant`: a stream of one repeated value, stored once.
- `sparse`: for streams that are mostly zeros: a zstd-compressed bitmap of the nonzero positions,
  then the nonzero values coded by whichever of the other methods is smaller.
- `rans`: an order-0 rANS coder (the `constriction` package) with the stream's own histogram as
  the model, within a few bytes of the order-0 entropy; decodes at tens of millions of symbols/s.
rANS is used only where it saves at least `RANS_MIN_GAIN` over zstd, since it decodes slower.
Layout: b"EN1", method (u8), count (u64), then the method's payload.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from ckptstore.errors import CodecError

MAGIC = b"EN1"
ZSTD, RANS, CONSTANT, SPARSE = 0, 1, 2, 3
_HEAD = struct.Struct("<3sBQ")
RANS_MIN_GAIN = 0.10
SPARSE_BELOW = 0.25
MAX_ALPHABET = 1 << 12
_local = threading.local()


def _zstd_c() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "c"):
        _local.c = zstandard.ZstdCompressor(level=3)
        _local.d = zstandard.ZstdDecompressor()
    return _local.c


def _narrow(symbols: np.ndarray) -> np.ndarray:
    if symbols.size == 0 or (symbols.min() >= -128 and symbols.max() <= 127):
        return symbols.astype(np.int8)
    if symbols.min() >= -32768 and symbols.max() <= 32767:
        return symbols.astype(np.int16)
    return symbols.astype(np.int32)


def _zstd_payload(symbols: np.ndarray) -> bytes:
    narrow = _narrow(symbols)
    return bytes([narrow.itemsize]) + _zstd_c().compress(narrow.tobytes())


def _rans_payload(symbols: np.ndarray) -> bytes | None:
    import constriction

    low, high = int(symbols.min()), int(symbols.max())
    if high - low + 1 > MAX_ALPHABET:
        return None
    shifted = (symbols - low).astype(np.int32)
    counts = np.bincount(shifted, minlength=high - low + 1).astype(np.uint32)
    model = constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(shifted, model)
    words = coder.get_compressed()
    return struct.pack("<iI", low, counts.size) + counts.tobytes() + words.astype(np.uint32).tobytes()


def encode_symbols(symbols: np.ndarray) -> bytes:
    """Compress an integer array; the result records how, and how many symbols."""
    symbols = np.asarray(symbols).reshape(-1)
    if symbols.size and symbols.min() == symbols.max():
        return _HEAD.pack(MAGIC, CONSTANT, symbols.size) + struct.pack("<q", int(symbols[0]))
    best_method, best = ZSTD, _zstd_payload(symbols)
    if symbols.size >= 64:
        nonzero = symbols != 0
        if nonzero.mean() < SPARSE_BELOW:
            bitmap = _zstd_c().compress(np.packbits(nonzero).tobytes())
            sparse = struct.pack("<Q", len(bitmap)) + bitmap + encode_symbols(symbols[nonzero])
            if len(sparse) < len(best):
                best_method, best = SPARSE, sparse
        rans = _rans_payload(symbols.astype(np.int64))
        if rans is not None and len(rans) < (1 - RANS_MIN_GAIN) * len(best):
            best_method, best = RANS, rans
    return _HEAD.pack(MAGIC, best_method, symbols.size) + best


def decode_symbols(payload: bytes | memoryview) -> np.ndarray:
    """The integer array `encode_symbols` was given (as int32)."""
    if len(payload) < _HEAD.size:
        raise CodecError("entropy: payload is truncated")
    magic, method, count = _HEAD.unpack_from(payload)
    body = memoryview(payload)[_HEAD.size :]
    if magic != MAGIC:
        raise CodecError("entropy: payload does not start with a valid header")
    try:
        if method == ZSTD:
            _zstd_c()
            width = body[0]
            raw = _local.d.decompress(body[1:], max_output_size=count * width)
            dtype = {1: np.int8, 2: np.int16, 4: np.int32}[width]
            out = np.frombuffer(raw, dtype=dtype).astype(np.int32)
        elif method == SPARSE:
            _zstd_c()
            (length,) = struct.unpack_from("<Q", body)
            bits = _local.d.decompress(body[8 : 8 + length], max_output_size=(count + 7) // 8)
            nonzero = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=count).astype(bool)
            out = np.zeros(count, dtype=np.int32)
            out[nonzero] = decode_symbols(body[8 + length :])
        elif method == CONSTANT:
            out = np.full(count, struct.unpack_from("<q", body)[0], dtype=np.int32)
        elif method == RANS:
            import constriction

            low, size = struct.unpack_from("<iI", body)
            counts = np.frombuffer(body[8 : 8 + 4 * size], dtype=np.uint32)
            words = np.frombuffer(body[8 + 4 * size :], dtype=np.uint32).copy()
            model = constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)
            out = constriction.stream.stack.AnsCoder(words).decode(model, count).astype(np.int32) + low
        else:
            raise CodecError(f"entropy: unknown method {method}")
    except (zstandard.ZstdError, ValueError, KeyError, struct.error) as exc:
        raise CodecError(f"entropy: stream does not decode: {exc}") from None
    if out.size != count:
        raise CodecError(f"entropy: decoded {out.size} symbols, expected {count}")
    return out
