"""Float formats numpy lacks (bfloat16) and the conversions lossy codecs need, done on bit patterns.

Lossy codecs compute in float32 and hand back exactly the bytes a checkout returns; these helpers
make that conversion identical on every machine (round to nearest even, like torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore.errors import CodecError

try:
    from ckptstore.codecs import _lossy as native
except ImportError:  # built without a C compiler: numpy below, same bits
    native = None

LOSSY_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")
# float32 magnitudes that round to infinity (at or above) and to zero (at or below) in each lossy
# dtype, rounding to nearest even: float16's largest is 65504, bfloat16's smallest is 2**-133.
_ROUNDS_TO_INF = {"torch.float16": 65520.0, "torch.bfloat16": 2.0**127 * (2 - 2.0**-8), "torch.float32": math.inf}
_ROUNDS_TO_ZERO = {"torch.float16": 2.0**-25, "torch.bfloat16": 2.0**-134, "torch.float32": 0.0}


def overflows(values: np.ndarray, dtype: str) -> bool:
    """Whether float32 `values` hold one that is not finite once rounded to `dtype` (NaN included)."""
    limit = _ROUNDS_TO_INF[dtype]
    return not (np.isfinite(values) if limit == math.inf else np.abs(values) < limit).all()


def underflows(values: np.ndarray, dtype: str) -> bool:
    """Whether non-zero float32 `values` hold one that rounds to zero in `dtype`."""
    return bool((np.abs(values) <= _ROUNDS_TO_ZERO[dtype]).any())


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw little-endian bytes of a float tensor as float32 values."""
    if dtype == "torch.float32":
        return raw.view(np.float32)
    if dtype == "torch.float16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "torch.bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise CodecError(f"lossy codecs take {', '.join(LOSSY_DTYPES)}, not {dtype}")


def from_float32(values: np.ndarray, dtype: str, use_native: bool = True) -> np.ndarray:
    """float32 values rounded to `dtype`, as raw bytes (uint8)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "torch.float32":
        return values.view(np.uint8)
    if dtype == "torch.float16":
        return values.astype(np.float16).view(np.uint8)
    if dtype == "torch.bfloat16":
        if native is not None and use_native:
            out = np.empty(values.size, np.uint16)
            native.to_bfloat16(values, out)
            return out.view(np.uint8)
        bits = values.view(np.uint32)
        rounded = _rounded_bits(bits)
        rounded >>= 16
        out = rounded.astype(np.uint16)
        if _has_nan(values):
            nan = np.isnan(values)
            out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep NaNs quiet NaNs
        return out.view(np.uint8)
    raise CodecError(f"lossy codecs take {', '.join(LOSSY_DTYPES)}, not {dtype}")


def round_to_bfloat16(values: np.ndarray, use_native: bool = True) -> None:
    """Round float32 `values` in place to the nearest bfloat16 (ties to even), as from_float32 would."""
    if native is not None and use_native and values.flags.c_contiguous:
        native.round_bfloat16(values)
        return
    if _has_nan(values):
        values[...] = to_float32(from_float32(values, "torch.bfloat16", use_native), "torch.bfloat16")
        return
    bits = values.view(np.uint32)
    rounded = _rounded_bits(bits)
    np.bitwise_and(rounded, np.uint32(0xFFFF0000), out=bits)


def _rounded_bits(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns plus the rounding that takes their top half to the nearest bfloat16."""
    rounded = bits >> 16
    rounded &= 1
    rounded += np.uint32(0x7FFF)
    rounded += bits
    return rounded


def _has_nan(values: np.ndarray) -> bool:
    return bool(values.size) and bool(np.isnan(values.max()))  # max propagates NaN: one pass, no mask


# Per dtype: a rounding's relative error (half a unit in the last place) and the smallest step (subnormals).
_HALF_ULP = {"torch.float32": (2.0**-24, 2.0**-150), "torch.float16": (2.0**-11, 2.0**-25),
             "torch.bfloat16": (2.0**-8, 2.0**-134)}


def rounding_error(values: np.ndarray, dtype: str) -> np.ndarray:
    """The most rounding float32 `values` to `dtype` can change each (float64), in its finite range."""
    relative, smallest = _HALF_ULP[dtype]
    return np.abs(values.astype(np.float64)) * relative + smallest


def itemsize(dtype: str) -> int:
    return 4 if dtype == "torch.float32" else 2


UNDERFLOW = 1e-30  # a float32 sum of squares below this lost digits to subnormals: sum_of_squares redoes it


def sum_of_squares(values: np.ndarray, block: int = 1 << 16) -> float:
    """Sum of squares of float32 values: float32 dot products per block, added in float64.

    Within about 1e-7 of a float64 pass (measured: 1e-9 to 3e-8 on a million values) without
    copying the chunk to float64 first: those copies and float64 dot products took a third of a
    bf16 commit's time.
    """
    parts = (values[start : start + block] for start in range(0, values.size, block))
    with np.errstate(over="ignore"):  # an overflow is redone below
        total = math.fsum(float(np.dot(part, part)) for part in parts)
    overflowed = not math.isfinite(total) and np.isfinite(values).all()  # squares past float32's range (|x| > 1e17)
    underflowed = total < UNDERFLOW and values.any()  # squares below float32's normal range (|x| < 1e-19)
    if overflowed or underflowed:
        wide = values.astype(np.float64)
        total = float(np.dot(wide, wide))
    return total


# each float dtype's exponent and mantissa bits: the exponent all set with a mantissa is NaN
_NAN_BITS = {"torch.float32": (np.uint32, 0x7F800000, 0x007FFFFF), "torch.float16": (np.uint16, 0x7C00, 0x03FF),
             "torch.bfloat16": (np.uint16, 0x7F80, 0x007F),
             "torch.float64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF)}
NUMPY_PREFIX = "numpy:"  # state.NUMPY_PREFIX: how a numpy array's dtype is recorded (codecs sit below state)
_IEEE_BITS = {2: _NAN_BITS["torch.float16"], 4: _NAN_BITS["torch.float32"], 8: _NAN_BITS["torch.float64"]}
_COMPLEX_PARTS = {"torch.complex32": 2, "torch.complex64": 4, "torch.complex128": 8}  # each part an IEEE float
_SCAN_ELEMENTS = 1 << 22  # a slice at a time: no temporary as large as a multi-GB tensor


def _float_bits(dtype: str) -> tuple[np.dtype, int, int] | None:
    """(word, exponent mask, mantissa mask) of a float or complex dtype's parts, torch's or numpy's; None for others.

    numpy arrays and complex tensors count: a NaN in them kept a commit lossless no more than in a float tensor.
    """
    if dtype in _NAN_BITS:
        unit, exponent, mantissa = _NAN_BITS[dtype]
        return np.dtype(unit), exponent, mantissa
    if dtype in _COMPLEX_PARTS:
        unit, exponent, mantissa = _IEEE_BITS[_COMPLEX_PARTS[dtype]]
        return np.dtype(unit), exponent, mantissa
    if not dtype.startswith(NUMPY_PREFIX):
        return None
    try:
        found = np.dtype(dtype[len(NUMPY_PREFIX):])
    except TypeError:
        return None
    part = found.itemsize // 2 if found.kind == "c" else found.itemsize if found.kind == "f" else 0
    if part not in _IEEE_BITS:  # no float, or long double's 10-byte layout
        return None
    unit, exponent, mantissa = _IEEE_BITS[part]
    return np.dtype(unit).newbyteorder(found.byteorder), exponent, mantissa


def holds_nan(dtype: str, data: np.ndarray) -> bool:
    """Whether a float tensor (its bytes) holds a NaN, read from its bit patterns (infinities are not NaN)."""
    bits = _float_bits(dtype)
    if bits is None:
        return False
    unit, exponent, mantissa = bits
    words = np.asarray(data).view(unit)
    return any((((part := words[at:at + _SCAN_ELEMENTS]) & exponent) == exponent).any()
               and ((part & exponent == exponent) & (part & mantissa != 0)).any()
               for at in range(0, words.size, _SCAN_ELEMENTS))


def holds_non_finite(dtype: str, data: np.ndarray) -> bool:
    """Whether a float tensor (its bytes) holds a NaN or an infinity: an exponent with every bit set."""
    bits = _float_bits(dtype)
    if bits is None:
        return False
    unit, exponent, _ = bits
    words = np.asarray(data).view(unit)
    return any(((words[at:at + _SCAN_ELEMENTS] & exponent) == exponent).any()
               for at in range(0, words.size, _SCAN_ELEMENTS))


def first_with_nan(tensors: Mapping[str, Any]) -> str | None:
    """The path of the first tensor (a RawTensor: `dtype`, `data`) holding a NaN, or None."""
    return next((path for path, raw in tensors.items() if holds_nan(raw.dtype, raw.data)), None)
