import struct

import numpy as np
import pytest
import torch
import zstandard

from ckptstore.codecs import get_codec
from ckptstore.codecs.deadzone import DeadZoneCodec
from ckptstore.codecs.entropy import (
    CONSTANT,
    GAPS,
    MAGIC,
    PACKED,
    RANS,
    SPARSE,
    SPLIT,
    _header,
    decode_sparse,
    decode_symbols,
    encode_symbols,
)
from ckptstore.codecs.floats import from_float32, to_float32
from ckptstore.errors import CodecError, UnquantizableError

_HEAD_DZ = 8  # deadzone header: magic, has-base flag, step
RNG = np.random.default_rng(0)


def _raw(values: np.ndarray, dtype: str) -> np.ndarray:
    return from_float32(values.astype(np.float32), dtype).copy()


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16", "torch.bfloat16"])
def test_float_conversions_match_torch_rounding(dtype):
    values = RNG.standard_normal(10_000).astype(np.float32) * 3
    expected = torch.from_numpy(values).to(getattr(torch, dtype.split(".")[1]))
    raw = from_float32(values, dtype)
    assert raw.tobytes() == expected.view(torch.uint8).numpy().tobytes()
    assert np.array_equal(to_float32(raw, dtype), expected.float().numpy())


@pytest.mark.parametrize("special", [False, True])
def test_bfloat16_rounding_in_place_matches_the_conversion(special):
    from ckptstore.codecs.floats import round_to_bfloat16

    values = RNG.standard_normal(10_000).astype(np.float32) * 3
    values[:4] = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000], dtype=np.uint32).view(np.float32)  # ties
    if special:
        values[10:14] = [np.inf, -np.inf, np.nan, -np.nan]
        values[14:16] = np.array([0x7FA00001, 0xFFC00123], dtype=np.uint32).view(np.float32)  # NaN payloads
    expected = from_float32(values, "torch.bfloat16").view(np.uint16)
    assert np.isnan(values).any() == special
    rounded = values.copy()
    round_to_bfloat16(rounded)
    assert np.array_equal(rounded.view(np.uint32) >> 16, expected)
    assert not (rounded.view(np.uint32) & 0xFFFF).any()
    finite = np.isfinite(values)
    torch_bits = torch.from_numpy(values[finite]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(expected[finite], torch_bits)


@pytest.mark.parametrize("scale", [0.6, 5.0, 300.0])
def test_entropy_round_trip(scale):
    symbols = np.round(RNG.laplace(0, scale, 50_000)).astype(np.int32)
    payload = encode_symbols(symbols)
    assert np.array_equal(decode_symbols(payload), symbols)
    as_float = decode_symbols(payload, np.float32)
    assert as_float.dtype == np.float32 and np.array_equal(as_float, symbols.astype(np.float32))
    with pytest.raises(CodecError):
        decode_symbols(payload[:10])


def test_entropy_sparse_streams():
    symbols = np.zeros(200_000, dtype=np.int32)
    symbols[RNG.integers(0, symbols.size, 2000)] = RNG.integers(-40, 40, 2000)
    payload = encode_symbols(symbols)
    assert np.array_equal(decode_symbols(payload), symbols)
    assert len(payload) < 2000 * 2 + 4000


def _entropy_bytes(symbols: np.ndarray) -> float:
    p = np.bincount(symbols - symbols.min()) / symbols.size
    return float(-(p[p > 0] * np.log2(p[p > 0])).sum() * symbols.size / 8)


@pytest.mark.parametrize("nonzero", [0.03, 0.3, 0.9])
def test_entropy_lands_near_the_order0_bound(nonzero):
    skewed = (RNG.random(200_000) < nonzero).astype(np.int32) * np.round(RNG.laplace(0, 2, 200_000)).astype(np.int32)
    payload = encode_symbols(skewed)
    assert np.array_equal(decode_symbols(payload), skewed)
    assert len(payload) < 1.1 * _entropy_bytes(skewed) + 300


def test_packed_codes_escape_values_outside_their_window():
    symbols = np.round(RNG.normal(0, 0.8, 100_000)).astype(np.int32)
    symbols[RNG.integers(0, symbols.size, 500)] = RNG.integers(-3000, 3000, 500)
    payload = encode_symbols(symbols)
    assert payload[3] == PACKED
    assert np.array_equal(decode_symbols(payload), symbols)
    with pytest.raises(CodecError):
        decode_symbols(payload[: len(payload) // 2])


@pytest.mark.parametrize("spread", [40.0, 180.0, 3000.0])
def test_wide_streams_split_off_their_low_bits_and_land_on_the_entropy(spread):
    symbols = np.round(RNG.normal(-25, spread, 300_000)).astype(np.int32)  # a weight at a fine step
    payload = encode_symbols(symbols)
    assert payload[3] == SPLIT
    assert np.array_equal(decode_symbols(payload), symbols)
    assert np.array_equal(decode_symbols(payload, np.float32), symbols.astype(np.float32))
    assert np.array_equal(decode_symbols(encode_symbols(symbols.astype(np.int64))), symbols)
    assert len(payload) < 1.02 * _entropy_bytes(symbols) + 300
    with pytest.raises(CodecError):
        decode_symbols(payload[: len(payload) - 40])
    corrupt = bytearray(payload)
    corrupt[struct.calcsize("<3sBQ")] = 0  # the low-bit count, right after the stream's header
    with pytest.raises(CodecError):
        decode_symbols(bytes(corrupt))


def test_narrow_streams_do_not_split():
    symbols = np.round(RNG.normal(0, 6, 100_000)).astype(np.int32)
    assert encode_symbols(symbols)[3] == PACKED


@pytest.mark.parametrize("common", [0, 7])
def test_nearly_constant_streams_code_the_gaps_near_the_entropy(common):
    symbols = np.full(500_000, common, dtype=np.int32)
    where = RNG.random(symbols.size) < 0.03
    symbols[where] = RNG.integers(-3, 4, where.sum())
    payload = encode_symbols(symbols)
    assert payload[3] == GAPS
    assert np.array_equal(decode_symbols(payload), symbols)
    assert np.array_equal(decode_symbols(payload, np.float32), symbols.astype(np.float32))
    assert len(payload) < 1.05 * _entropy_bytes(symbols) + 300
    with pytest.raises(CodecError):
        decode_symbols(payload[: len(payload) - 40])
    sparse = decode_sparse(payload, np.float32)  # the same stream, not expanded
    expanded = np.full(sparse.count, sparse.common, dtype=np.float32)
    expanded[sparse.positions] = sparse.values
    assert sparse.common == common and np.array_equal(expanded, symbols.astype(np.float32))
    assert decode_sparse(encode_symbols(RNG.integers(-3, 4, 10_000))) is None  # not a gaps stream
    constant = decode_sparse(encode_symbols(np.full(100, 3)))
    assert (constant.count, constant.common, constant.positions.size) == (100, 3, 0)


def test_sparse_payloads_of_earlier_versions_still_decode():
    symbols = np.zeros(10_000, dtype=np.int32)
    symbols[::97] = 5
    nonzero = symbols != 0
    bitmap = zstandard.ZstdCompressor().compress(np.packbits(nonzero).tobytes())
    payload = (struct.pack("<3sBQ", MAGIC, SPARSE, symbols.size) + struct.pack("<Q", len(bitmap)) + bitmap
               + encode_symbols(symbols[nonzero]))
    assert np.array_equal(decode_symbols(payload), symbols)


def test_rans_payloads_of_earlier_versions_still_decode():
    import constriction

    symbols = RNG.integers(-3, 9, 5_000).astype(np.int32)
    low, shifted = int(symbols.min()), (symbols - symbols.min()).astype(np.int32)
    counts = np.bincount(shifted).astype(np.uint32)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(shifted, constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False))
    words = coder.get_compressed().astype(np.uint32)
    payload = (struct.pack("<3sBQ", MAGIC, RANS, symbols.size) + struct.pack("<iI", low, counts.size)
               + counts.tobytes() + words.tobytes())
    assert np.array_equal(decode_symbols(payload), symbols)
    assert _header(encode_symbols(symbols))[0] != RANS  # no longer written


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_deadzone_keyframe_and_closed_loop_residuals(dtype):
    codec = get_codec("deadzone")
    weights = RNG.standard_normal(20_000).astype(np.float32) * 0.02
    step = 0.02 / 64
    params = {"dtype": dtype, "step": step, "rounding": 0.5}
    payload, recon = codec.encode_lossy(_raw(weights, dtype), None, params)
    assert not codec.needs_base(payload)
    assert codec.decode(payload, None, params, recon.size).tobytes() == recon.tobytes()
    ulp = 2 ** -8 if dtype == "torch.bfloat16" else 0
    assert np.abs(to_float32(recon, dtype) - weights).max() <= step / 2 + ulp * np.abs(weights).max()
    current, previous = weights, recon
    for _ in range(6):  # small updates: the dead zone drops most, closed loop keeps the error bounded
        current = current + RNG.standard_normal(current.size).astype(np.float32) * 1e-5
        payload, previous_next = codec.encode_lossy(_raw(current, dtype), previous, dict(params, rounding=0.3))
        assert codec.needs_base(payload)
        decoded = codec.decode(payload, previous.copy(), dict(params, rounding=0.3), previous.size)
        assert decoded.tobytes() == previous_next.tobytes()
        previous = previous_next
        error = np.abs(to_float32(previous, dtype) - current).max()
        assert error <= 0.7 * step + ulp * np.abs(current).max()
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode_lossy(_raw(np.array([1.0, np.nan] * 10), dtype), None, params)


def test_log_moment_codec_relative_error_and_zeros():
    codec = get_codec("log2moment")
    v = np.exp(RNG.normal(-14, 3, 30_000)).astype(np.float32)
    v[::7] = 0
    for k in (-1, 0, 1, 2, 4):
        params = {"dtype": "torch.float32", "k": k}
        payload, recon = codec.encode_lossy(v.view(np.uint8), None, params)
        assert codec.decode(payload, None, params, recon.size).tobytes() == recon.tobytes()
        back = recon.view(np.float32)
        assert np.array_equal(back == 0, v == 0)
        ratio = back[v > 0] / v[v > 0]
        assert np.abs(np.log2(ratio)).max() <= 0.5 / 2.0**k + 1e-6
        later = (v * np.exp(RNG.normal(0, 0.05, v.size))).astype(np.float32)
        payload2, recon2 = codec.encode_lossy(later.view(np.uint8), recon, params)
        assert codec.needs_base(payload2) and len(payload2) <= len(payload)
        assert codec.decode(payload2, recon.copy(), params, recon.size).tobytes() == recon2.tobytes()


@pytest.mark.parametrize("dtype, value, k", [
    ("torch.float32", 2.0**-149, -3),  # float32's smallest: the 8-octave grid puts it at 2**-152
    ("torch.bfloat16", 2.0**-133, -3),  # bfloat16's smallest
    ("torch.float16", 60_000.0, -1),  # the 2-octave grid rounds it to 2**16: float16 has no such value
])
def test_log_moment_refuses_a_level_the_dtype_cannot_hold_instead_of_storing_zero_or_inf(dtype, value, k):
    codec = get_codec("log2moment")
    v = np.exp2(RNG.uniform(-12, -8, 4096)).astype(np.float32)
    v[:3] = value
    with pytest.raises(UnquantizableError, match="become zero or infinity in " + dtype.removeprefix("torch.")):
        codec.encode_lossy(_raw(v, dtype), None, {"dtype": dtype, "k": k})


def test_deadzone_refuses_a_reconstruction_that_overflows_float16_and_names_float16():
    params = {"dtype": "torch.float16", "step": 4096.0, "rounding": 0.5}
    with pytest.raises(UnquantizableError, match="overflows float16"):  # 65000 rounds to 16 steps: 65536
        get_codec("deadzone").encode_lossy(_raw(np.full(64, 65000.0, np.float32), "torch.float16"), None, params)


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
def test_overflow_is_found_at_the_first_value_that_rounds_to_infinity(dtype):
    """float32 65520 rounds to float16's inf: taken as finite where the bound was inclusive (mutation audit)."""
    from ckptstore.codecs.floats import _ROUNDS_TO_INF, overflows

    limit = np.float32(_ROUNDS_TO_INF[dtype])
    below = np.nextafter(limit, np.float32(0))
    torch_dtype = getattr(torch, dtype.removeprefix("torch."))
    assert torch.isinf(torch.tensor(limit).to(torch_dtype)) and torch.isfinite(torch.tensor(below).to(torch_dtype))
    assert overflows(np.array([1.0, -limit], np.float32), dtype) and not overflows(np.array([below], np.float32), dtype)


def test_a_codebook_keeps_the_dead_zones_bound_on_every_entry():
    """With `codebooks`, entries 2.6 times over the dead zone's bound went unnoticed where the codebook was held to
    a looser one: only the norm bound was tested (mutation audit)."""
    from ckptstore.codecs import codebook
    rng = np.random.default_rng(0)
    used = 0
    for trial in range(24):
        centers = (0.1 + 0.2 * rng.integers(-6, 6, 4)).astype(np.float32)  # on the dead zone's rounding boundaries
        values = (centers[rng.integers(0, 4, 1 << 14)]
                  + rng.normal(0, 0.01 + 0.03 * (trial % 8), 1 << 14)).astype(np.float32)
        params = {"dtype": "torch.float32", "step": 0.2, "rounding": 0.5, "codebooks": True}
        payload, recon = DeadZoneCodec().encode_lossy(values.view(np.uint8), None, params, {})
        if codebook.is_codebook(payload):
            used += 1
            error, bound = DeadZoneCodec.error_bound(values.view(np.uint8), None, recon, params)
            assert (error <= bound).all()
    assert used >= 2  # the codebook was chosen, so its bound was what the test held


def test_normalized_moment_codec_is_relative_to_the_second_moment():
    codec = get_codec("normmoment")
    v = np.exp(RNG.normal(-14, 2, 10_000)).astype(np.float32)
    m = (RNG.standard_normal(10_000) * np.sqrt(v) * 0.3).astype(np.float32)
    params = {"dtype": "torch.float32", "v_dtype": "torch.float32", "step": 1 / 16, "rounding": 0.5, "eps": 1e-30}
    payload, recon = codec.encode_lossy(m.view(np.uint8), v.view(np.uint8), params)
    assert codec.decode(payload, v.view(np.uint8).copy(), params, recon.size).tobytes() == recon.tobytes()
    error = np.abs(recon.view(np.float32) - m) / np.sqrt(v)
    assert error.max() <= 1 / 32 + 1e-5
    with pytest.raises(CodecError):
        codec.decode(payload, None, params, recon.size)
    assert codec.step_of(payload) == np.float32(1 / 16)
    other_params = dict(params, step=1 / 4)  # the payload's own step decides, not the params'
    assert codec.decode(payload, v.view(np.uint8).copy(), other_params, recon.size).tobytes() == recon.tobytes()


def test_normalized_moment_version_1_payloads_still_decode_with_the_step_in_params():
    from ckptstore.codecs.deadzone import quantize
    from ckptstore.codecs.entropy import encode_symbols

    codec = get_codec("normmoment")
    v = np.exp(RNG.normal(-14, 2, 5_000)).astype(np.float32)
    m = (RNG.standard_normal(5_000) * np.sqrt(v)).astype(np.float32)
    params = {"dtype": "torch.float32", "v_dtype": "torch.float32", "step": 0.5, "rounding": 0.5, "eps": 1e-30}
    old = b"MN1" + encode_symbols(quantize(m / np.sqrt(v + np.float32(1e-30)), 0.5, 0.5))
    _, recon = codec.encode_lossy(m.view(np.uint8), v.view(np.uint8), params)
    assert codec.decode(old, v.view(np.uint8).copy(), params, recon.size).tobytes() == recon.tobytes()


def _decodes_like_level_by_level(codec, payloads: list[bytes], params: dict, recon: np.ndarray) -> None:
    expected = None
    for payload in reversed(payloads):
        expected = codec.decode(payload, expected, params, recon.size)
    assert expected.tobytes() == recon.tobytes()
    assert codec.decode_chain(payloads, params, recon.size).tobytes() == recon.tobytes()


@pytest.mark.parametrize("moving", [1.0, 0.02])  # 0.02: residuals are gaps streams, added in place
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16", "torch.bfloat16"])
def test_deadzone_chain_decodes_like_level_by_level(dtype, moving):
    codec = get_codec("deadzone")
    weights = RNG.standard_normal(50_000).astype(np.float32)
    payloads, base = [], None
    for level in range(4):
        params = {"dtype": dtype, "step": 0.01 * (level + 1), "rounding": 0.4}
        payload, base = codec.encode_lossy(_raw(weights, dtype), base, params)
        payloads.insert(0, payload)
        moved = RNG.random(weights.size) < moving  # all by a little, or a few by a lot
        weights = weights + np.where(moved, RNG.standard_normal(weights.size) * (0.03 / moving), 0).astype(np.float32)
    if moving < 1:
        assert all(p[_HEAD_DZ + 3] == GAPS for p in payloads[:-1])
    _decodes_like_level_by_level(codec, payloads, {"dtype": dtype}, base)
    with pytest.raises(CodecError):
        codec.decode_chain(payloads[:-1], {"dtype": dtype}, base.size)


def test_deadzone_sparse_levels_turn_a_rounded_negative_zero_positive_like_the_dense_sum():
    """A bfloat16 chain that rounds a tiny negative sum to -0.0, then adds an all-zero level:
    level by level that gives +0.0 (-0.0 + 0.0), and so must the in-place sparse update."""
    codec, dtype = get_codec("deadzone"), "torch.bfloat16"
    values = np.zeros(10_000, dtype=np.float32)
    values[:100] = -1e-39
    payloads, recon = [], None
    first, _ = codec.encode_lossy(_raw(values, dtype), None, {"dtype": dtype, "step": 1e-39})
    keyframe = codec.decode(first, None, {"dtype": dtype}, values.size * 2)
    kept = -float(to_float32(keyframe, dtype)[0])
    payloads.insert(0, first)
    recon = keyframe
    for step in (kept * (1 - 1e-3), 1.0):  # back to zero, landing 1e-3 of the way short; then nothing
        payload, recon = codec.encode_lossy(_raw(np.zeros_like(values), dtype), recon, {"dtype": dtype, "step": step})
        payloads.insert(0, payload)
    assert payloads[0][_HEAD_DZ + 3] == CONSTANT  # all zero: a stream the chain applies in place
    middle = codec.decode_chain(payloads[1:], {"dtype": dtype}, recon.size)
    assert (middle.view(np.uint16)[:100] == 0x8000).all(), "the second level rounds to -0.0"
    assert (recon.view(np.uint16) == 0).all()
    _decodes_like_level_by_level(codec, payloads, {"dtype": dtype}, recon)


def test_capped_residuals_round_to_nearest_whatever_the_dead_zone():
    """A wider dead zone would hold back a fine-tune's small steady updates (a lag along the
    training direction), so residuals whose step relative_step capped round to nearest."""
    codec = get_codec("deadzone")
    rng = np.random.default_rng(5)  # its own: the module's RNG is where other tests, in any order, left it
    base = rng.standard_normal(20_000).astype(np.float32)
    params = {"dtype": "torch.float32", "step": 0.5, "rounding": 0.3, "relative_step": 0.5}
    for move, capped in ((1e-3, True), (2.0, False)):
        data = base + rng.standard_normal(base.size).astype(np.float32) * move
        payload, recon = codec.encode_lossy(data.view(np.uint8), base.view(np.uint8), params)
        step = codec.step_of(payload)
        assert (step < 0.5) == capped
        error = np.abs(recon.view(np.float32) - data).max()
        # half a step, plus the float32 rounding of values up to ~4 (it was `* 1.0001`: 2.5e-8, below their ulp)
        assert (error <= step / 2 + np.spacing(np.abs(data).max())) == capped  # uncapped: the dead zone, 0.7


@pytest.mark.parametrize("changed", [1.0, 0.05])  # 0.05: residuals are mostly zero, gaps streams
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize(("dtype", "k"), [("torch.float32", -1), ("torch.bfloat16", -1), ("torch.float32", 1),
                                          ("torch.bfloat16", 0), ("torch.float32", -2)])
def test_log_moment_chain_decodes_like_level_by_level(with_zeros, dtype, k, changed):
    codec = get_codec("log2moment")
    params = {"dtype": dtype, "k": k}
    v = np.exp(RNG.normal(-14, 3, 20_000)).astype(np.float32)
    payloads, recon = [], None
    for _ in range(4):
        if with_zeros:
            v[RNG.integers(0, v.size, 500)] = 0  # zeros appear and disappear along the chain
            v[RNG.integers(0, v.size, 500)] = 1e-6
        payload, recon = codec.encode_lossy(_raw(v, dtype), recon, params)
        payloads.insert(0, payload)
        v = (v * np.exp(RNG.normal(0, 1.0, v.size) * (RNG.random(v.size) < changed))).astype(np.float32)
    assert codec.decode_chain(payloads, params, recon.size).tobytes() == recon.tobytes()
    assert codec._level_by_level(payloads, params, recon.size, None).tobytes() == recon.tobytes()
    with pytest.raises(CodecError):
        codec.decode_chain(payloads[:-1], params, recon.size)


def _clustered(count: int, step: float, seed: int) -> np.ndarray:
    """Values in three tight clusters that straddle the uniform grid: a codebook's best case."""
    rng = np.random.default_rng(seed)
    centers = np.array([-40.3, 0.2, 17.6]) * step
    return (centers[rng.integers(0, 3, count)] + rng.uniform(-0.45, 0.45, count) * step).astype(np.float32)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
def test_codebook_chunks_win_only_where_smaller_at_no_larger_error(dtype):
    codec, step = get_codec("deadzone"), 0.01
    values = _clustered(40_000, step, 1)
    raw = _raw(values, dtype)
    plain = {"dtype": dtype, "step": step, "rounding": 0.5}
    uniform, _ = codec.encode_lossy(raw, None, plain)
    payload, recon = codec.encode_lossy(raw, None, dict(plain, codebooks=True))
    assert payload[:3] == b"CB1" and len(payload) < 0.8 * len(uniform)
    target = to_float32(raw, dtype)
    # float16 rounds the reconstruction itself: bounded by half a step plus that rounding
    slack = 0 if dtype == "torch.float32" else float(np.abs(target).max()) * 2.0**-11
    assert float(np.abs(to_float32(recon, dtype) - target).max()) <= step / 2 + slack
    assert codec.decode(payload, None, plain, recon.size).tobytes() == recon.tobytes()
    gaussian = _raw(RNG.standard_normal(40_000).astype(np.float32), dtype)  # uniform levels are near optimal
    assert codec.encode_lossy(gaussian, None, dict(plain, codebooks=True))[0][:3] == b"DZ2"


def test_chains_mixing_codebook_and_uniform_levels_decode_like_level_by_level():
    codec, step, dtype = get_codec("deadzone"), 0.01, "torch.float16"
    params = {"dtype": dtype, "step": step, "rounding": 0.5, "codebooks": True}
    payloads, base = [], None
    for level in range(4):
        values = _clustered(30_000, step, 2) if level == 0 else to_float32(base, dtype) + (
            _clustered(30_000, step, 3 + level) if level % 2 else RNG.standard_normal(30_000).astype(np.float32) * 0.02)
        payload, base = codec.encode_lossy(_raw(values, dtype), base, params)
        payloads.insert(0, payload)
    assert {p[:3] for p in payloads} == {b"CB1", b"DZ2"}
    _decodes_like_level_by_level(codec, payloads, {"dtype": dtype}, base)


def test_damaged_codebook_payloads_are_codec_errors():
    codec, step = get_codec("deadzone"), 0.01
    payload, recon = codec.encode_lossy(_raw(_clustered(5_000, step, 4), "torch.float32"), None,
                                        {"dtype": "torch.float32", "step": step, "codebooks": True})
    assert payload[:3] == b"CB1"
    params = {"dtype": "torch.float32"}
    with pytest.raises(CodecError, match="shorter than its table"):
        codec.decode_chain([payload[:14]], params, recon.size)
    table_size = struct.unpack_from("<H", payload, 8)[0]
    shrunk = payload[:8] + struct.pack("<H", table_size - 1) + payload[10:]  # indices now point past it
    with pytest.raises(CodecError):
        codec.decode_chain([shrunk], params, recon.size)


def test_damaged_stream_headers_are_codec_errors_before_any_allocation():
    symbols = np.clip(np.round(RNG.standard_normal(5_000) * 3), -50, 50).astype(np.int32)
    payload = encode_symbols(symbols)
    method, count = _header(payload)
    assert method == PACKED and count == symbols.size
    huge = payload[:4] + struct.pack("<Q", 1 << 50) + payload[12:]
    with pytest.raises(CodecError, match="more than any chunk holds"):
        decode_symbols(huge)
    zero_width = payload[:12] + b"\x00" + payload[13:]  # the packed codes' width
    with pytest.raises(CodecError, match="width 0"):
        decode_symbols(zero_width)
    with pytest.raises(CodecError):  # a zstd stream with no body at all
        decode_symbols(MAGIC + bytes([0]) + struct.pack("<Q", 10))


def test_values_without_a_level_say_whether_the_step_or_the_base_made_them_nan():
    """A sharded save's NaN statistics, or a residual against a NaN parent, used to read "values up to nan"."""
    from ckptstore.codecs.deadzone import quantize

    with pytest.raises(UnquantizableError, match="its step is nan .the whole tensor holds NaN or inf"):
        quantize(np.ones(8, dtype=np.float32), float("nan"), 0.5)
    residual = np.ones(8, dtype=np.float32)
    residual[2] = np.nan
    with pytest.raises(UnquantizableError, match="residual against the parent holds NaN or inf"):
        quantize(residual, 0.5, 0.5)
    with pytest.raises(UnquantizableError, match="values up to 1e\\+10 are 2\\^31 or more steps"):
        quantize(np.full(8, 1e10, dtype=np.float32), 1e-3, 0.5)


def test_a_lattice_coarser_than_the_planned_step_does_not_coarsen_the_chunk():
    """A base's lattice coarser than this commit's planned step (a calibration retry's halved step, a finer knob)
    does not coarsen the chunk (mutation audit round 13, D2)."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4096).astype(np.float32)
    data = base + np.float32(1e-4) * rng.standard_normal(4096).astype(np.float32)
    params = {"dtype": "torch.float32", "step": 1e-5, "relative_step": 0.5, "grid_step": 1e-3}
    payload, rebuilt = DeadZoneCodec().encode_lossy(data, base, params)
    assert DeadZoneCodec().step_of(payload) <= np.float32(1e-5)
    assert np.abs(rebuilt.view(np.float32) - data).max() <= 1e-5


def test_the_writers_tightened_retry_rounds_to_nearest():
    """The writer's tightened retry rounds to nearest, whatever rounding was planned (mutation audit round 13, D4)."""
    data = np.random.default_rng(1).standard_normal(8192).astype(np.float32)
    params = {"dtype": "torch.float32", "step": 0.1, "rounding": 0.2, "tighten": 0.5}
    _, rebuilt = DeadZoneCodec().encode_lossy(data, None, params)
    assert np.abs(rebuilt.view(np.float32) - data).max() <= 0.5 * 0.05 * (1 + 1e-5)


def test_values_between_2_31_and_2_32_steps_are_refused_not_wrapped():
    """Levels past int32 are refused, not wrapped to negative ones (mutation audit round 13, D1)."""
    data = np.full(4096, 3.0e9, np.float32)
    with pytest.raises(UnquantizableError):
        DeadZoneCodec().encode_lossy(data, None, {"dtype": "torch.float32", "step": 1.0})


def test_a_pruned_v_entry_whose_parent_was_zero_keeps_its_own_level():
    """Pruning rebuilds an entry from its parent's level; where the parent's v was 0 there is none, and the pruned
    entry (a first gradient, far below the chunk's median) was restored at the chunk's median level instead
    (mutation audit round 13)."""
    codec = get_codec("log2moment")
    params = {"dtype": "torch.float32", "k": -2}
    parent = np.exp2(np.random.default_rng(3).uniform(-30, -10, 4096)).astype(np.float32)
    parent[:512] = 0  # entries that never had a gradient before this commit
    _, base = codec.encode_lossy(parent.view(np.uint8), None, params)
    now = parent.copy()
    now[:512] = np.float32(2.0**-60)
    payload, recon = codec.encode_lossy(now.view(np.uint8), base, params, {"prune": np.ones(now.size, dtype=bool)})
    assert np.abs(np.log2(recon.view(np.float32)[:512] / now[:512])).max() <= 2.0 ** -(params["k"] + 1) + 1e-6
    assert codec.decode(payload, base.copy(), params, recon.size).tobytes() == recon.tobytes()


@pytest.mark.parametrize("k", [-2, 0, 2])
def test_log_moments_stated_bound_is_half_a_level(k):
    """The bound the log-moment codec states (and the writer checks) is half a level of its grid: a reconstruction
    one whole level off must exceed it (mutation audit round 13)."""
    from ckptstore.codecs.logmoment import LogMomentCodec

    v = np.exp2(np.random.default_rng(0).uniform(-20, -5, 1024)).astype(np.float32)
    off = (v * np.float32(2.0 ** (2.0**-k))).astype(np.float32)  # one level up
    error, bound = LogMomentCodec.error_bound(v.view(np.uint8), None, off.view(np.uint8),
                                              {"dtype": "torch.float32", "k": k})
    assert np.all(error > bound) and np.all(bound < 2.0**-k)


def test_the_writers_tightened_retry_of_a_first_moment_rounds_to_nearest():
    """The writer's tightened retry of a normalized first moment rounds to nearest whatever rounding was planned:
    extreme's 0.4 kept its dead zone, each entry then off by up to 0.6 of the finer step
    (mutation audit round 13)."""
    from ckptstore.codecs.normmoment import NormalizedMomentCodec

    rng = np.random.default_rng(2)
    v = np.exp2(rng.uniform(-20, -10, 8192)).astype(np.float32)
    m = (np.sqrt(v) * rng.standard_normal(8192)).astype(np.float32)
    params = {"dtype": "torch.float32", "v_dtype": "torch.float32", "step": 0.8, "rounding": 0.2, "eps": 1e-8,
              "tighten": 0.5}
    _, recon = NormalizedMomentCodec().encode_lossy(m.view(np.uint8), v.view(np.uint8), params)
    error = np.abs(recon.view(np.float32).astype(np.float64) - m) / np.sqrt(v.astype(np.float64) + 1e-8)
    assert error.max() <= 0.5 * 0.8 * 0.5 * (1 + 1e-4)


def test_a_keyframe_chunk_keeps_its_planned_step_whatever_its_own_rms():
    """The fine-tune cap on a chunk's step (relative_step or settled_step of its RMS) is for residuals: applied to a
    keyframe, chunks of small entries (rarely used embedding rows) were coded finer than planned and marked capped
    (mutation audit round 13)."""
    data = (np.float32(1e-3) * np.random.default_rng(4).standard_normal(4096)).astype(np.float32)
    params = {"dtype": "torch.float32", "step": 0.01, "relative_step": 0.2, "settled_step": 1.0}
    payload, _ = DeadZoneCodec().encode_lossy(data.view(np.uint8), None, params)
    assert DeadZoneCodec().step_of(payload) == np.float32(0.01)


@pytest.mark.parametrize("k", [26, 40, -64, 2.0, "2", True])
def test_a_log2moment_grid_no_level_writes_is_refused_before_anything_is_allocated(k):
    """A record's k sized a 2**k-entry table: k=26 took 1 GB and 22 s for a 16-byte chunk, and a fetched record's
    params come from the remote (auditor helper 299)."""
    codec = get_codec("log2moment")
    values = np.array([1.0, 2.0, 0.5, 4.0], np.float32)
    payload = codec.encode(values.view(np.uint8), None, {"dtype": "torch.float32", "k": 2})
    with pytest.raises(CodecError, match="levels per octave is none a level writes"):
        codec.decode(payload, None, {"dtype": "torch.float32", "k": k}, values.nbytes)
    with pytest.raises(CodecError, match="levels per octave is none a level writes"):
        codec.decode_chain([payload], {"dtype": "torch.float32", "k": k}, values.nbytes)
    assert codec.decode(payload, None, {"dtype": "torch.float32", "k": 2}, values.nbytes).view(np.float32).tolist() \
        == values.tolist()
