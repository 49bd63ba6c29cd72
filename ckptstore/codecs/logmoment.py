"""Lossy codec for Adam's second moment: log2(v) on a grid of 2**-k octaves.

Levels are coded as differences from the base's levels (the parent's reconstruction) or, without
a base, from the chunk's median level; exact zeros stay exact.

Adam divides by sqrt(v), so a relative error in v matters, not an absolute one: the log domain
spends bits where they count. Reconstruction is ldexp(table[level mod 2**k], level div 2**k), which
is exact and identical on any device. Params: dtype, k (levels per octave = 2**k; a negative k
spaces levels 2**-k octaves apart).
Layout: b"LG1", has-base (u8), median level (i32), zero-mask length (u32), zstd zero mask, symbols.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import zstandard

from ckptstore.codecs.entropy import decode_sparse, decode_symbols, encode_symbols, symbol_count
from ckptstore.codecs.floats import from_float32, itemsize, overflows, rounding_error, to_float32, underflows
from ckptstore.errors import CodecError, NonFiniteError, UnquantizableError
from ckptstore.threadlocal import decompress_at_most

MAGIC = b"LG1"
_HEAD = struct.Struct("<3sBiI")
# Every payload layout `decode`/`decode_chain` accept; tests/fixtures holds one of each, forever.
DECODES = ("LG1:keyframe", "LG1:residual", "chain")


K_RANGE = range(-30, 21)  # grids a payload may name: past the knob's -6..12, and 2**20 table entries at most


def grid_of(params: dict[str, Any]) -> int:
    """A record's k, refused outside K_RANGE: decoding allocates 2**k floats, and params may come from a remote."""
    k = params["k"]
    if type(k) is not int or k not in K_RANGE:
        raise CodecError(f"log2moment: a grid of 2**{k!r} levels per octave is none a level writes")
    return k


def _table(k: int) -> np.ndarray:
    return np.exp2(np.arange(1 << k, dtype=np.float64) / (1 << k)).astype(np.float32)


def levels_of(values: np.ndarray, k: int) -> np.ndarray:
    """Nearest level of each positive value on a grid of 2**k per octave (k < 0: one per 2**-k octaves).

    Zeros give an arbitrary level; callers mask them.
    """
    with np.errstate(divide="ignore"):
        logs = np.log2(np.maximum(values.astype(np.float64), np.finfo(np.float64).tiny))
    return np.rint(logs * 2.0**k).astype(np.int64)


def values_of(levels: np.ndarray, k: int) -> np.ndarray:
    """2 ** (level / 2**k), exactly as float32."""
    if k < 0:
        return np.ldexp(np.float32(1), (levels << -k).astype(np.int32)).astype(np.float32)
    table = _table(k)
    return np.ldexp(table[levels & ((1 << k) - 1)], (levels >> k).astype(np.int32)).astype(np.float32)


def _octave_bits(levels: np.ndarray, zero: np.ndarray, k: int, dtype: str) -> np.ndarray:
    """What values_of then from_float32 give for whole-octave levels (k <= 0) in the normal range.

    Those values are powers of two, so their bits are the biased exponent alone: no float math.
    """
    exponent = (levels << -k) + np.int32(127)
    if dtype == "torch.bfloat16":
        bits = (exponent << 7).astype(np.uint16)
    else:
        bits = (exponent << 23).astype(np.uint32)
    if zero.any():
        bits[zero] = 0
    return bits.view(np.uint8)


class LogMomentCodec:
    """Second moments in the log domain, closed loop against the parent's reconstruction."""

    codec_id = "log2moment"

    def encode_lossy(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
                     hints: dict[str, Any] | None = None) -> tuple[bytes, np.ndarray]:
        k = grid_of(params)
        values = to_float32(data, params["dtype"])
        if not np.isfinite(values).all():
            raise NonFiniteError("log2moment: non-finite values cannot be quantized")
        if (values < 0).any():
            raise UnquantizableError("log2moment: a second moment holds negative values")
        zero = values == 0
        levels = levels_of(values, k)
        median = int(np.median(levels[~zero])) if (~zero).any() else 0
        predicted, usable = self._prediction(base, params, median, zero.size)
        residual = np.where(zero, 0, levels - predicted)
        if hints and hints.get("prune") is not None and base is not None:
            residual[hints["prune"] & usable] = 0  # rebuild from the parent where the weight did not move
        mask = zstandard.ZstdCompressor(level=3).compress(np.packbits(zero).tobytes())
        payload = (_HEAD.pack(MAGIC, base is not None, median, len(mask)) + mask
                   + encode_symbols(residual[~zero]))
        return payload, self._reconstruct(predicted + residual, zero, params, encoding=True)

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any]) -> bytes:
        return self.encode_lossy(data, base, params)[0]

    @staticmethod
    def error_bound(data: np.ndarray, base: np.ndarray | None, rebuilt: np.ndarray,
                    params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(|log2(reconstruction / value)|, the bound it keeps) per entry, in octaves; zeros stay exact.

        The bound: half a level, 2**-(k + 1) octaves (the nearest level is kept; a residual only
        re-expresses the level against the parent's), plus the rounding to the dtype. It holds
        for values whose reconstruction is a normal number of the dtype, without prune hints.
        """
        dtype = params["dtype"]
        values, got = to_float32(data, dtype).astype(np.float64), to_float32(rebuilt, dtype).astype(np.float64)
        zero = values == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            error = np.where(zero, np.where(got == 0, 0.0, np.inf), np.abs(np.log2(got / np.where(zero, 1, values))))
        relative = rounding_error(np.ones(1, np.float32), dtype)[0]
        bound = 2.0 ** -(grid_of(params) + 1) + 2 * relative + 2.0**-20
        return error, np.where(zero, 0.0, bound)

    @staticmethod
    def _prediction(base, params, median: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if base is None:
            return np.full(count, median, dtype=np.int64), np.zeros(count, dtype=bool)
        previous = to_float32(base, params["dtype"])
        usable = previous > 0
        return np.where(usable, levels_of(previous, grid_of(params)), median), usable

    @staticmethod
    def _reconstruct(levels: np.ndarray, zero: np.ndarray, params: dict[str, Any], encoding: bool = False
                     ) -> np.ndarray:
        """The levels' values in the dtype.

        `encoding`: refused where a level's value is beyond the dtype (a second moment would come
        back as zero or infinity), so that none is ever stored.
        """
        values = values_of(levels, grid_of(params))
        dtype = params["dtype"]
        if encoding and (overflows(values, dtype) or underflows(values[~zero], dtype)):
            raise UnquantizableError(f"log2moment: rounded to this level's grid of 2**{grid_of(params)} levels per "
                                     f"octave, some second-moment values become zero or infinity in "
                                     f"{dtype.removeprefix('torch.')}")
        values[zero] = 0
        return from_float32(values, dtype)

    def _head(self, payload: bytes) -> tuple[int, int, int]:
        if len(payload) < _HEAD.size or payload[:3] != MAGIC:
            raise CodecError("log2moment: payload does not start with a valid header")
        return _HEAD.unpack_from(payload)[1:]

    def needs_base(self, payload: bytes) -> bool:
        return bool(self._head(payload)[0])

    def _zero_bits(self, payload: bytes, count: int) -> tuple[bool, int, np.ndarray, memoryview]:
        """(has base, median level, packed zero mask, the symbol stream) of one payload of `count` values."""
        has_base, median, mask_length = self._head(payload)
        try:
            bits = decompress_at_most(payload[_HEAD.size : _HEAD.size + mask_length], (count + 7) // 8)
        except (zstandard.ZstdError, ValueError) as exc:
            raise CodecError(f"log2moment: zero mask does not decompress: {exc}") from None
        stream = memoryview(payload)[_HEAD.size + mask_length :]
        return bool(has_base), median, np.frombuffer(bits, dtype=np.uint8), stream

    def declared_bytes(self, payload: bytes | memoryview, params: dict[str, Any]) -> tuple[int, int] | None:
        """The fewest and most raw bytes `payload` says it decodes to, from its zero mask's and stream's sizes.

        The mask holds one bit per value (its zstd frame declares its bytes: a count within 7 of eight
        times that), the stream one symbol per value that is not zero: no fewer values than it holds.
        Checked before a record's buffer is taken (replay.py): a forged record cannot claim far more.
        """
        try:
            _, _, mask_length = self._head(payload)
            size = itemsize(params["dtype"])
            mask_bytes = zstandard.frame_content_size(bytes(payload[_HEAD.size : _HEAD.size + mask_length]))
        except (CodecError, KeyError, TypeError, zstandard.ZstdError):  # not ours, or a damaged record's params
            return None
        nonzero = symbol_count(memoryview(payload)[_HEAD.size + mask_length :])
        if nonzero is None or mask_bytes < 0:  # a mask frame that does not say its size: neither does the payload
            return None
        return max(nonzero, 8 * mask_bytes - 7) * size, 8 * mask_bytes * size

    @staticmethod
    def _residual(packed: np.ndarray, stream: memoryview, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(zero mask, residual levels as int32) from a payload's packed zero mask and symbol stream."""
        symbols = decode_symbols(stream, limit=count)
        if not packed.any():  # no exact zeros, the usual case: no scatter needed
            if symbols.size != count:
                raise CodecError(f"log2moment: {symbols.size} levels for {count} values")
            return np.zeros(count, dtype=bool), symbols
        zero = np.unpackbits(packed, count=count).astype(bool)
        residual = np.zeros(count, dtype=np.int32)
        try:
            residual[~zero] = symbols
        except ValueError:
            raise CodecError("log2moment: levels do not match the zero mask") from None
        return zero, residual

    def decode(self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int) -> np.ndarray:
        count = nbytes // (4 if params["dtype"] == "torch.float32" else 2)
        has_base, median, packed, stream = self._zero_bits(payload, count)
        zero, residual = self._residual(packed, stream, count)
        if has_base and (base is None or base.size != nbytes):
            raise CodecError("log2moment: residual chunk decoded without its base")
        predicted, _ = self._prediction(base if has_base else None, params, median, count)
        return self._reconstruct(predicted + residual, zero, params)

    def decode_chain(self, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """A whole chain (newest payload first) summed in the level domain, converted to floats once.

        Exactly what level-by-level decoding gives while every level is a normal float32; chains
        that leave that range, or other dtypes, are decoded level by level. bfloat16 qualifies
        when levels are whole octaves (k <= 0): its values are then powers of two, which bfloat16
        holds exactly over float32's whole exponent range.
        """
        dtype, k = params["dtype"], grid_of(params)
        if not (dtype == "torch.float32" or (dtype == "torch.bfloat16" and k <= 0)):
            return self._level_by_level(payloads, params, nbytes, out)
        count, scale = nbytes // itemsize(dtype), 2.0 ** -k
        levels = zero = None
        low = high = 0  # bounds on the kept levels: exact after a dense level, safe after a sparse one
        for payload in reversed(payloads):
            has_base, median, packed, stream = self._zero_bits(payload, count)
            if levels is not None and has_base and not zero.any() and not packed.any():
                updated = self._sparse_update(stream, levels)
                if updated is not None:
                    low, high = low + updated[0], high + updated[1]
                    if low * scale < -126 or high * scale > 127:  # maybe out of range: check exactly
                        low, high = int(levels.min()), int(levels.max())
                    if low * scale < -126 or high * scale > 127:
                        return self._level_by_level(payloads, params, nbytes, out)
                    continue
            now_zero, residual = self._residual(packed, stream, count)
            if has_base and levels is None:
                raise CodecError("log2moment: residual chunk decoded without its base")
            if not has_base:
                levels = residual + np.int32(median)
            elif zero.any():
                levels = np.where(zero, np.int32(median), levels) + residual
            else:
                levels += residual
            zero = now_zero
            kept = ~zero if zero.any() else True  # a masked reduction is several times slower
            low = int(levels.min(where=kept, initial=np.iinfo(np.int32).max))
            high = int(levels.max(where=kept, initial=np.iinfo(np.int32).min))
            if np.any(kept) and (low * scale < -126 or high * scale > 127):
                return self._level_by_level(payloads, params, nbytes, out)
        result = _octave_bits(levels, zero, k, dtype) if k <= 0 else self._reconstruct(levels, zero, params)
        if out is None:
            return result
        out[...] = result
        return out

    @staticmethod
    def _sparse_update(stream: memoryview, levels: np.ndarray) -> tuple[int, int] | None:
        """Add a residual level that is one value but at a few positions, touching only those.

        For a residual without exact zeros over levels without them; returns how far the levels'
        minimum and maximum may have moved, or None (nothing done) for streams coded otherwise.
        """
        sparse = decode_sparse(stream, limit=levels.size)
        if sparse is None:
            return None
        if sparse.count != levels.size:
            raise CodecError(f"log2moment: {sparse.count} levels for {levels.size} values")
        if sparse.common:
            levels += np.int32(sparse.common)
        levels[sparse.positions] += sparse.values - np.int32(sparse.common)
        spread = [sparse.common, *([int(sparse.values.min()), int(sparse.values.max())] if sparse.values.size else [])]
        return min(spread), max(spread)

    def _level_by_level(self, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                        out: np.ndarray | None) -> np.ndarray:
        result = None
        for payload in reversed(payloads):
            result = self.decode(payload, result, params, nbytes)
        if out is None:
            return result
        out[...] = result
        return out
