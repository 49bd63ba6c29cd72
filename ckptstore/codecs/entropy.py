"""Entropy coding of integer symbol streams (quantized values), choosing the smallest of these coders.

- `zstd`: symbols as int8 (or int16) bytes, zstd level 3; decodes at GB/s.
- `constant`: a stream of one repeated value, stored once.
- `sparse` (decoded only; earlier versions wrote it for mostly-zero streams, which `packed` with
  1-bit codes now covers): a zstd bitmap of the nonzero positions, then the nonzero values.
- `packed`: 1, 2, 4 or 8-bit codes for the densest window of values (the top code escapes to the
  values outside it, coded after), packed 8, 4, 2 or 1 to a byte and zstd-compressed: zstd's
  Huffman stage then codes a byte of several symbols, which lands within about a percent of the
  order-0 entropy, and everything decodes in zstd and numpy without holding the GIL.
- `gaps`: for streams that are nearly all one value (second moments that did not change): that
  value, then the gaps between the other positions and their values, each a nested stream; a
  bitmap would cost zstd about 1.5x the entropy there, gaps code it within a few percent.
- `split`: for wide streams (fine steps: a weight stored once at 1/16 of the usual step spreads
  over about a thousand levels), each value's low k bits and the rest as two nested streams. The
  low bits of a smooth, wide distribution are nearly uniform, so they cost k bits, and the high
  part fits one 8-bit window again; packed codes alone escaped half such a stream and spent
  about 2.4 bits per value over its entropy.
- `rans` (read only): an order-0 rANS coder (the `constriction` package) with the stream's own
  histogram as the model, written by earlier versions where it saved 10% over the others. Its
  decoder holds the GIL, so chains using it decoded on about one core; measured on the
  benchmark runs, dropping it cost at most 0.12% of size (bf16 `extreme` 27.75x -> 27.72x) and
  doubled `extreme` decoding on sgd-momentum (220-238 -> 476-506 MB/s).
Layout: b"EN1", method (u8), count (u64), then the method's payload.
"""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

import numpy as np
import zstandard

from ckptstore.errors import CodecError
from ckptstore.threadlocal import decompress_at_most

try:
    from ckptstore.codecs import _lossy as native
except ImportError:  # built without a C compiler: the numpy code below does the same, slower
    native = None

MAGIC = b"EN1"
ZSTD, RANS, CONSTANT, SPARSE, PACKED, GAPS, SPLIT = 0, 1, 2, 3, 4, 5, 6
_HEAD = struct.Struct("<3sBQ")
METHOD_NAMES = {ZSTD: "zstd", RANS: "rans", CONSTANT: "constant", SPARSE: "sparse", PACKED: "packed",
                GAPS: "gaps", SPLIT: "split"}
# Every stream method `decode_symbols` accepts; tests/fixtures holds one of each, forever.
DECODES = tuple(f"method:{name}" for name in METHOD_NAMES.values())
PACK_WIDTHS = (1, 2, 4, 8)
MAX_NESTING = 3
# Streams nest at most MAX_NESTING deep; deeper is damage (or forged), refused before the stack runs out.
MAX_DECODE_NESTING = 8
ESTIMATE_SLACK = 1.1  # a width whose estimate is this close to the best one's is tried too
PACK_MAX_RANGE = 1 << 20
_PACKED = struct.Struct("<BiQ")
_GAPS = struct.Struct("<qQ")
GAPS_ABOVE = 0.8  # the most common value's share from which the gaps method is tried
SPLIT_SPREAD = 8.0  # the split method leaves the high part about this many values of spread
SPLIT_MAX_BITS = 7  # low parts stay inside one 8-bit window
_SPLIT = struct.Struct("<BQ")
MAX_SYMBOLS = 1 << 30  # a 4 GiB chunk of float32; a damaged count above it is refused before allocating
_local = threading.local()
NATIVE_KINDS = {"i": "i", "l": "q", "q": "q", "f": "f", "d": "d"}  # numpy's dtype.char -> the C loops' kind
PACK_KINDS = {"b": "b", "h": "h", "i": "i", "l": "q", "q": "q"}  # the same, for streams being coded


def _zstd_c() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "c"):
        _local.c = zstandard.ZstdCompressor(level=3)
        # Packed codes are nearly memoryless: short matches cost more than the literals they
        # replace, so only long runs are matched and the rest goes to the Huffman stage.
        _local.packer = zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters.from_level(3, min_match=7))
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


def _unpack_tables() -> dict[int, np.ndarray]:
    """Per code width, each byte value's codes in order, as one wide word, so unpacking is one gather."""
    tables = {}
    for width in (2, 4):
        per = 8 // width
        codes = [[(byte >> (k * width)) & ((1 << width) - 1) for k in range(per)] for byte in range(256)]
        tables[width] = np.array(codes, dtype=np.uint8).view(np.uint32 if per == 4 else np.uint16).reshape(-1)
    return tables


_UNPACK = _unpack_tables()


def _native_kind(symbols: np.ndarray, use_native: bool) -> str | None:
    """The C loops' name for this integer stream's type, or None to use numpy."""
    if native is None or not use_native or not symbols.flags.c_contiguous:
        return None
    return PACK_KINDS.get(symbols.dtype.char)


def _histogram(symbols: np.ndarray, low: int, high: int, use_native: bool = True) -> np.ndarray:
    """The count of each value from `low` to `high` (the stream's extremes)."""
    kind = _native_kind(symbols, use_native)
    if kind is None:
        return np.bincount(symbols.astype(np.int32, copy=False) - np.int32(low), minlength=high - low + 1)
    counts = np.empty(high - low + 1, np.int64)
    native.count_symbols(symbols, kind, low, counts)
    return counts


def _bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits of a stream with these value counts."""
    counts = counts[counts > 0].astype(np.float64)
    return float(-(counts * np.log2(counts / counts.sum())).sum()) if counts.size else 0.0


def _huffman_bits(probabilities: np.ndarray) -> float:
    """About the mean code length of a Huffman code for these probabilities (zstd's literal stage).

    The entropy plus Gallager's redundancy bound, and never under one bit.
    """
    p = probabilities[probabilities > 0]
    entropy = float(-(p * np.log2(p)).sum())
    top = float(p.max())
    return max(1.0, entropy + top + (0.086 if top < 0.5 else 0.0))


def _packings(low: int, counts: np.ndarray, widths: tuple[int, ...] = PACK_WIDTHS) -> list[tuple[float, int, int]]:
    """(estimated bytes, width, lowest coded value) of each code width, smallest estimate first.

    Per width, the densest window of 2**width - 1 values gets codes and the rest escape; a packed
    byte costs its Huffman code length (codes treated as independent), which is what makes
    narrow codes win on skewed streams and wide ones on flat streams.
    """
    cumulative = np.concatenate([[0], np.cumsum(counts)])
    starts = np.arange(counts.size)
    total = float(cumulative[-1])
    options = []
    for width in widths:
        escape = (1 << width) - 1
        ends = np.minimum(starts + escape, counts.size)
        start = int(np.argmax(cumulative[ends] - cumulative[starts]))
        inside = counts[start : start + escape]
        outside = np.concatenate([counts[:start], counts[start + escape :]])
        codes = np.append(inside, outside.sum()) / total
        per = 8 // width
        byte = codes
        for _ in range(per - 1):
            byte = np.outer(byte, codes).reshape(-1)
        estimate = (total / per * _huffman_bits(byte) + _bits(outside) + 8 * (outside > 0).sum()) / 8
        options.append((estimate, width, low + start))
    return sorted(options)


def _packed_payload(symbols: np.ndarray, width: int, low: int, nested: int, use_native: bool = True) -> bytes:
    packed, escaped = _pack(symbols, width, low, use_native)
    _zstd_c()  # sets up this thread's compressors
    body = (_local.c if width == 1 else _local.packer).compress(packed)
    return _PACKED.pack(width, low, len(body)) + body + encode_symbols(escaped, nested + 1)


def _pack(symbols: np.ndarray, width: int, low: int, use_native: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The `width`-bit codes of `symbols` for the window from `low`, packed, and the escaped values in order."""
    escape, per = (1 << width) - 1, 8 // width
    kind = _native_kind(symbols, use_native)
    if kind is not None:  # room for every symbol to escape: the pages never written cost no memory
        packed, escaped = np.empty(-(-symbols.size // per), np.uint8), np.empty(symbols.size, np.int64)
        return packed, escaped[: native.pack_codes(symbols, kind, width, low, packed, escaped)]
    offsets = (symbols.astype(np.int32, copy=False) - np.int32(low)).view(np.uint32)  # below: huge, escaped
    codes = np.minimum(offsets, escape).astype(np.uint8)
    if width == 1:
        packed = np.packbits(codes, bitorder="little")
    else:
        codes = np.concatenate([codes, np.zeros(-codes.size % per, dtype=np.uint8)]).reshape(-1, per)
        packed = codes[:, 0].copy()
        for k in range(1, per):
            packed |= codes[:, k] << np.uint8(k * width)
    return packed, symbols[offsets >= escape]


def _unpack(body: memoryview, count: int, dtype: type, depth: int = 0, use_native: bool = True) -> np.ndarray:
    width, low, length = _PACKED.unpack_from(body)
    if width not in PACK_WIDTHS:
        raise ValueError(f"packed codes have width {width}, not one of {PACK_WIDTHS}")
    per = 8 // width
    raw = np.frombuffer(decompress_at_most(body[_PACKED.size : _PACKED.size + length], -(-count // per)),
                        dtype=np.uint8)
    if raw.size * per < count:
        raise ValueError("packed codes are short")
    escaped = body[_PACKED.size + length :]
    escapes = _HEAD.unpack_from(escaped)[2] if len(escaped) >= _HEAD.size else 0
    if escapes > count:
        raise ValueError("packed codes claim more escapes than codes")
    kind = np.dtype(dtype).char
    if native is not None and use_native and kind in NATIVE_KINDS:
        out, positions = np.empty(count, dtype), np.empty(escapes, np.int64)
        if native.unpack_codes(raw, width, low, out, NATIVE_KINDS[kind], positions) != escapes:
            raise ValueError("packed codes and their escapes disagree")
        if escapes:
            out[positions] = _decode(escaped, np.int32, count, depth + 1)
        return out
    if width == 1:
        codes = np.unpackbits(raw, count=count, bitorder="little")
    elif width == 8:
        codes = raw[:count]
    else:
        codes = _UNPACK[width][raw].view(np.uint8)[:count]
    out = codes.astype(dtype)  # then add: a ufunc that casts as it adds runs at a third of the speed
    out += dtype(low)
    if escapes:
        out[np.flatnonzero(codes == (1 << width) - 1)] = _decode(escaped, np.int32, count, depth + 1)
    return out


def _split_bits(counts: np.ndarray) -> int:
    """How many low bits the split method peels off this stream (0: too narrow to gain)."""
    total = float(counts.sum())
    values = np.arange(counts.size, dtype=np.float64)
    mean = float(counts @ values) / total
    spread = float(np.sqrt(max(0.0, float(counts @ (values - mean) ** 2) / total)))
    return min(SPLIT_MAX_BITS, int(np.log2(spread / SPLIT_SPREAD))) if spread >= 4 * SPLIT_SPREAD else 0


def _split_payload(symbols: np.ndarray, low_bits: int, nested: int) -> bytes:
    """Each value as high * 2**low_bits + low, the two parts coded as nested streams."""
    wide = symbols.astype(np.int64, copy=False)
    high = encode_symbols(wide >> low_bits, nested + 1)
    return _SPLIT.pack(low_bits, len(high)) + high + encode_symbols(wide & ((1 << low_bits) - 1), nested + 1)


def _unsplit(body: memoryview, count: int, dtype: type, depth: int) -> np.ndarray:
    low_bits, length = _SPLIT.unpack_from(body)
    if not 0 < low_bits <= SPLIT_MAX_BITS:
        raise ValueError(f"split stream has {low_bits} low bits")
    high = _decode(body[_SPLIT.size : _SPLIT.size + length], np.int32, count, depth + 1)
    low = _decode(body[_SPLIT.size + length :], np.int32, count, depth + 1)
    if high.size != count or low.size != count:
        raise ValueError("split parts disagree with the stream's count")
    high <<= low_bits
    high |= low
    return high.astype(dtype, copy=False)


def _gaps_payload(symbols: np.ndarray, common: int, nested: int) -> bytes:
    positions = np.flatnonzero(symbols != common)
    gaps = np.diff(positions, prepend=-1) - 1  # zeros between consecutive other positions
    gaps_stream = encode_symbols(gaps, nested + 1)
    return _GAPS.pack(common, len(gaps_stream)) + gaps_stream + encode_symbols(symbols[positions], nested + 1)


def _gap_parts(body: memoryview, count: int, dtype: type, depth: int) -> tuple[int, np.ndarray, np.ndarray]:
    common, length = _GAPS.unpack_from(body)
    gaps = _decode(body[_GAPS.size : _GAPS.size + length], np.int32, count, depth + 1).astype(np.int64)
    positions = np.cumsum(gaps + 1) - 1
    if positions.size and (gaps.min() < 0 or positions[-1] >= count):
        raise ValueError("gaps run past the stream")
    values = _decode(body[_GAPS.size + length :], dtype, count, depth + 1)
    if values.size != positions.size:
        raise ValueError("gaps and values disagree")
    return common, positions, values


def _ungap(body: memoryview, count: int, dtype: type, depth: int) -> np.ndarray:
    common, positions, values = _gap_parts(body, count, dtype, depth)
    out = np.full(count, common, dtype=dtype)
    out[positions] = values
    return out


class Sparse(NamedTuple):
    """A stream that is `common` everywhere but at `positions`, which hold `values`."""

    count: int
    common: int
    positions: np.ndarray
    values: np.ndarray


def decode_sparse(payload: bytes | memoryview, dtype: type = np.int32, limit: int | None = None) -> Sparse | None:
    """A `gaps` or `constant` stream without expanding it, so a chain can update only what changed.

    None for streams coded otherwise: decode those with decode_symbols.
    """
    method, count = _header(payload, limit)
    body = memoryview(payload)[_HEAD.size :]
    try:
        if method == GAPS:
            return Sparse(count, *_gap_parts(body, count, dtype, 0))
        if method == CONSTANT:
            return Sparse(count, struct.unpack_from("<q", body)[0], np.empty(0, np.int64), np.empty(0, dtype))
    except (zstandard.ZstdError, ValueError, KeyError, IndexError, OverflowError, MemoryError, struct.error) as exc:
        raise CodecError(f"entropy: stream does not decode: {exc}") from None
    return None


def symbol_count(payload: bytes | memoryview) -> int | None:
    """How many symbols a stream's header says it holds, read without decoding it; None where it is no stream."""
    if len(payload) < _HEAD.size or bytes(payload[:3]) != MAGIC:
        return None
    return _HEAD.unpack_from(payload)[2]


def _header(payload: bytes | memoryview, limit: int | None = None) -> tuple[int, int]:
    """(method, symbol count) of a stream, checked to be one (of at most `limit` symbols, when given)."""
    if len(payload) < _HEAD.size:
        raise CodecError("entropy: payload is truncated")
    magic, method, count = _HEAD.unpack_from(payload)
    if magic != MAGIC:
        raise CodecError("entropy: payload does not start with a valid header")
    if count > MAX_SYMBOLS:
        raise CodecError(f"entropy: stream claims {count} symbols, more than any chunk holds")
    if limit is not None and count > limit:  # refused before allocating: a damaged count can be huge
        raise CodecError(f"entropy: stream claims {count} symbols where at most {limit} fit")
    return method, count


def encode_symbols(symbols: np.ndarray, nested: int = 0) -> bytes:
    """Compress an integer array; the result records how, and how many symbols.

    The packed method codes its escaped values again; `nested` counts how deep, and from
    `MAX_NESTING` levels down only zstd and rANS are tried.
    """
    symbols = np.asarray(symbols).reshape(-1)
    if symbols.size == 0:
        return _HEAD.pack(MAGIC, ZSTD, 0) + _zstd_payload(symbols)
    low, high = int(symbols.min()), int(symbols.max())
    if low == high:
        return _HEAD.pack(MAGIC, CONSTANT, symbols.size) + struct.pack("<q", low)
    if symbols.size < 64 or high - low >= PACK_MAX_RANGE:
        return _HEAD.pack(MAGIC, ZSTD, symbols.size) + _zstd_payload(symbols)
    counts = _histogram(symbols, low, high)
    if nested < MAX_NESTING:  # the estimate ranks the widths; the likeliest (two at the top level) are tried
        # Escaped values are the stream's spread-out tail: narrow codes would peel them one by one.
        ranked = _packings(low, counts, PACK_WIDTHS if nested == 0 else (4, 8))
        ranked = [r for r in ranked[:2] if r[0] <= ESTIMATE_SLACK * ranked[0][0]][: 1 if nested else 2]
        low_bits = _split_bits(counts) if -(1 << 31) <= low and high < (1 << 31) else 0  # parts decode as int32
        tries = [(SPLIT, _split_payload(symbols, low_bits, nested))] if low_bits else []
        tries += [(PACKED, _packed_payload(symbols, width, window, nested)) for estimate, width, window in ranked
                  if not tries or estimate < len(tries[0][1])]  # a wide stream's split usually wins outright
        best_method, best = min(tries, key=lambda method_payload: len(method_payload[1]))
        common = int(np.argmax(counts))
        if counts[common] >= GAPS_ABOVE * symbols.size:
            gaps = _gaps_payload(symbols, low + common, nested)
            if len(gaps) < len(best):
                best_method, best = GAPS, gaps
    else:
        best_method, best = ZSTD, _zstd_payload(symbols)
    return _HEAD.pack(MAGIC, best_method, symbols.size) + best


def decode_symbols(payload: bytes | memoryview, dtype: type = np.int32, limit: int | None = None) -> np.ndarray:
    """The integer array `encode_symbols` was given, as int32 or float32.

    float32 is exact for these symbols and saves a dequantizing codec one pass over the values.
    A stream of more than `limit` symbols (when given) is refused before anything is allocated.
    """
    return _decode(payload, dtype, limit, 0)


def _decode(payload: bytes | memoryview, dtype: type, limit: int | None, depth: int) -> np.ndarray:
    """decode_symbols for a stream nested `depth` streams down."""
    if depth > MAX_DECODE_NESTING:
        raise CodecError(f"entropy: streams nest more than {MAX_DECODE_NESTING} deep")
    method, count = _header(payload, limit)
    body = memoryview(payload)[_HEAD.size :]
    try:
        if method == ZSTD:
            width = body[0]
            raw = decompress_at_most(body[1:], count * width)
            out = np.frombuffer(raw, dtype={1: np.int8, 2: np.int16, 4: np.int32}[width]).astype(dtype)
        elif method == SPARSE:
            (length,) = struct.unpack_from("<Q", body)
            bits = decompress_at_most(body[8 : 8 + length], (count + 7) // 8)
            nonzero = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=count).astype(bool)
            out = np.zeros(count, dtype=dtype)
            out[nonzero] = _decode(body[8 + length :], np.int32, count, depth + 1)
        elif method == PACKED:
            out = _unpack(body, count, dtype, depth)
        elif method == GAPS:
            out = _ungap(body, count, dtype, depth)
        elif method == SPLIT:
            out = _unsplit(body, count, dtype, depth)
        elif method == CONSTANT:
            out = np.full(count, struct.unpack_from("<q", body)[0], dtype=dtype)
        elif method == RANS:
            import constriction

            low, size = struct.unpack_from("<iI", body)
            counts = np.frombuffer(body[8 : 8 + 4 * size], dtype=np.uint32)
            words = np.frombuffer(body[8 + 4 * size :], dtype=np.uint32).copy()
            model = constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)
            out = (constriction.stream.stack.AnsCoder(words).decode(model, count).astype(np.int32) + low).astype(dtype)
        else:
            raise CodecError(f"entropy: unknown method {method}")
    except (zstandard.ZstdError, ValueError, KeyError, IndexError, OverflowError, MemoryError, struct.error) as exc:
        raise CodecError(f"entropy: stream does not decode: {exc}") from None
    if out.size != count:
        raise CodecError(f"entropy: decoded {out.size} symbols, expected {count}")
    return out
