"""The native lossy-decoder loops (codecs/_lossy.c) against the numpy code they replace, bit for bit."""

import numpy as np
import pytest

from ckptstore.codecs import entropy, floats
from ckptstore.codecs.entropy import _HEAD, _packed_payload


def test_native_loops_are_built():
    assert entropy.native is not None and floats.native is not None, "ckptstore.codecs._lossy was not built"


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32, np.float64])
@pytest.mark.parametrize("low", [-3, 0, 40_000_017])  # a low float32 cannot hold: rounding must match
def test_packed_codes_unpack_like_numpy(width, dtype, low):
    rng = np.random.default_rng(width)
    symbols = rng.integers(low, low + (1 << width) + 5, 10_007)  # some fall outside: escapes
    body = memoryview(_packed_payload(symbols, width, low, nested=0))
    native = entropy._unpack(body, symbols.size, dtype)
    reference = entropy._unpack(body, symbols.size, dtype, use_native=False)
    assert native.dtype == reference.dtype == np.dtype(dtype)
    assert native.tobytes() == reference.tobytes()
    assert np.array_equal(native.astype(np.int64), symbols) or np.dtype(dtype).kind == "f"


def test_packed_codes_with_a_wrong_escape_count_are_refused():
    symbols = np.array([0, 1, 2, 3, 9, 1, 9] * 20)
    body = bytearray(_packed_payload(symbols, 2, 0, nested=0))
    width, low, length = entropy._PACKED.unpack_from(body)
    escape_head = entropy._PACKED.size + length
    magic, method, count = _HEAD.unpack_from(body, escape_head)
    _HEAD.pack_into(body, escape_head, magic, method, count + 1)
    with pytest.raises(ValueError, match="disagree"):
        entropy._unpack(memoryview(bytes(body)), symbols.size, np.int32)


def _awkward_floats() -> np.ndarray:
    bits = np.random.default_rng(0).integers(0, 1 << 32, 100_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x80000000,
                        0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF], dtype=np.uint32)  # inf, NaNs, ties
    return np.concatenate([bits, special]).view(np.float32)


def test_bfloat16_conversion_and_rounding_match_numpy():
    values = _awkward_floats()
    assert floats.from_float32(values, "torch.bfloat16").tobytes() == \
        floats.from_float32(values, "torch.bfloat16", use_native=False).tobytes()
    native, reference = values.copy(), values.copy()
    floats.round_to_bfloat16(native)
    floats.round_to_bfloat16(reference, use_native=False)
    assert native.tobytes() == reference.tobytes()


@pytest.mark.parametrize("use_native", [True, False])
def test_an_impossible_escape_count_is_refused_before_allocating(use_native):
    symbols = np.array([0, 1, 2, 9] * 20)
    body = bytearray(_packed_payload(symbols, 2, 0, nested=0))
    _, _, length = entropy._PACKED.unpack_from(body)
    escape_head = entropy._PACKED.size + length
    magic, method, _ = _HEAD.unpack_from(body, escape_head)
    _HEAD.pack_into(body, escape_head, magic, method, 1 << 60)
    with pytest.raises(ValueError, match="more escapes than codes"):
        entropy._unpack(memoryview(bytes(body)), symbols.size, np.int32, use_native=use_native)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_codes_pack_like_numpy(dtype, width):
    rng = np.random.default_rng(width)
    for count in (1, 7, 10_007):
        symbols = np.clip(np.round(rng.standard_normal(count) * 4), -100, 100).astype(dtype)
        for low in (-200, -3, 0, 5):  # windows below, around and above most symbols
            packed, escaped = entropy._pack(symbols, width, low)
            reference_packed, reference_escaped = entropy._pack(symbols, width, low, use_native=False)
            assert packed.tobytes() == reference_packed.tobytes()
            assert escaped.tolist() == reference_escaped.tolist()
    assert _packed_payload(symbols, width, -3, 0) == _packed_payload(symbols, width, -3, 0, use_native=False)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_symbol_counts_match_numpy(dtype):
    rng = np.random.default_rng(1)
    for spread in (2, 50, 20_000):  # narrow streams count in split tables, wide ones directly
        symbols = np.clip(np.round(rng.standard_normal(30_001) * spread), np.iinfo(dtype).min, np.iinfo(dtype).max)
        symbols = symbols.astype(dtype)
        low, high = int(symbols.min()), int(symbols.max())
        counts = entropy._histogram(symbols, low, high)
        assert counts.tolist() == entropy._histogram(symbols, low, high, use_native=False).tolist()
        assert counts.sum() == symbols.size
