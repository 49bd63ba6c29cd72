"""Every registered codec against the codec contract (ckptstore/testing/codec_contract.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.codecs import REGISTRY, capabilities, get_codec
from ckptstore.codecs.checked import decode_checked
from ckptstore.codecs.floats import LOSSY_DTYPES, from_float32, to_float32
from ckptstore.errors import CodecError, CorruptObjectError, UnquantizableError
from ckptstore.hashing import chunk_checksum
from ckptstore.testing.codec_contract import check_lossless_round_trip, check_lossy_round_trip

LOSSLESS = sorted(cid for cid in REGISTRY if capabilities(cid).lossy is None)
LOSSY = sorted(cid for cid in REGISTRY if capabilities(cid).lossy is not None)
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL = np.array([0.0, -0.0, 1e-40, -1e-40, 65504.0, 1e-7, 3.0, -2.5], np.float32)  # zeros, subnormals, edges


def test_every_registered_codec_is_in_one_contract():
    assert set(LOSSLESS) | set(LOSSY) == set(REGISTRY) and LOSSLESS and LOSSY
    assert all(hasattr(REGISTRY[cid], "error_bound") for cid in LOSSY), "a lossy codec must state its error bound"


def _floats(draw, dtype: str, count: int, low: float, high: float) -> np.ndarray:
    """Raw bytes of `count` values: random magnitudes in [low, high], some special values mixed in."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    values = np.exp(rng.uniform(np.log(low), np.log(high), count)) * rng.choice([-1.0, 1.0], count)
    inside = [v for v in SPECIAL if v == 0 or low <= abs(v) <= high]  # where the codec's bound applies
    specials = draw(st.lists(st.sampled_from(inside), max_size=min(count, 4)))
    values[: len(specials)] = specials
    return from_float32(values.astype(np.float32), dtype).copy()


@pytest.mark.parametrize("codec_id", LOSSLESS)
@EXAMPLES
@given(data=st.data())
def test_lossless_round_trip_is_bit_exact_with_and_without_a_base(codec_id, data):
    width = data.draw(st.sampled_from([1, 2, 4, 8]))
    rows = data.draw(st.one_of(st.integers(1, 9), st.integers(10, 5000)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    kind = data.draw(st.sampled_from(["random", "skewed", "floats", "zeros"]))
    if kind == "floats":  # special values included: lossless means NaN payloads and -0.0 too
        raw = np.concatenate([SPECIAL, [np.nan, np.inf, -np.inf], rng.standard_normal(rows * width)])
        raw = raw.astype(np.float32).view(np.uint8)[: rows * width].copy()
    elif kind == "skewed":
        raw = np.minimum(rng.geometric(0.3, rows * width), 255).astype(np.uint8)
    else:
        raw = rng.integers(0, 256, rows * width).astype(np.uint8) if kind == "random" else np.zeros(rows * width,
                                                                                                     np.uint8)
    params = {"width": width, "level": data.draw(st.sampled_from([1, 3]))}
    check_lossless_round_trip(codec_id, raw, None, params)
    moved = raw.copy()
    moved[rng.integers(0, moved.size, max(1, moved.size // 20))] ^= np.uint8(rng.integers(1, 256))
    check_lossless_round_trip(codec_id, moved, raw, params)


def _lossy_params(draw, codec_id: str, dtype: str) -> dict:
    if codec_id == "log2moment":
        return {"dtype": dtype, "k": draw(st.integers(-2, 3))}
    step = draw(st.sampled_from([1e-4, 3e-3, 0.05, 0.7]))
    rounding = draw(st.sampled_from([0.5, 0.35]))
    if codec_id == "normmoment":
        return {"dtype": dtype, "v_dtype": draw(st.sampled_from(LOSSY_DTYPES)), "step": step, "rounding": rounding,
                "eps": 1e-16}
    return {"dtype": dtype, "step": step, "rounding": rounding, "codebooks": draw(st.booleans())}


def _lossy_chunks(draw, codec_id: str, params: dict, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(first, later, base of the first) inputs for a codec, in ranges where its bound applies."""
    dtype = params["dtype"]
    if codec_id == "log2moment":  # non-negative, reconstructions normal numbers of the dtype
        low, high = (1e-3, 1e3) if dtype == "torch.float16" else (1e-30, 1e30)
        first = from_float32(_abs(_floats(draw, dtype, count, low, high), dtype), dtype).copy()
        return first, from_float32(_abs(first, dtype) * np.float32(1.3), dtype).copy(), None
    first = _floats(draw, dtype, count, 1e-6, 10.0)
    later = from_float32(_abs(first, dtype) * np.float32(0.9) + np.float32(1e-3), dtype).copy()
    if codec_id == "normmoment":  # Adam's step m / sqrt(v) stays within a few units (levels fit int32)
        spread = np.random.default_rng(count).uniform(0.1, 10.0, count).astype(np.float32)
        v = (to_float32(first, dtype) * spread) ** 2 + np.float32(1e-12)
        return first, later, from_float32(v, params["v_dtype"]).copy()
    return first, later, None


def _abs(raw: np.ndarray, dtype: str) -> np.ndarray:
    return np.abs(to_float32(raw, dtype))


@pytest.mark.parametrize("codec_id", LOSSY)
@EXAMPLES
@given(data=st.data())
def test_lossy_decode_is_the_encoders_reconstruction_within_the_stated_bound(codec_id, data):
    dtype = data.draw(st.sampled_from(LOSSY_DTYPES))
    params = _lossy_params(data.draw, codec_id, dtype)
    count = data.draw(st.one_of(st.integers(1, 7), st.integers(8, 3000)))
    first, later, base = _lossy_chunks(data.draw, codec_id, params, count)
    if codec_id == "normmoment":  # always against the second moment of the same commit
        check_lossy_round_trip(codec_id, first, base, params)
        return
    _, rebuilt = check_lossy_round_trip(codec_id, first, None, params)
    check_lossy_round_trip(codec_id, later, rebuilt, params)  # closed loop against the reconstruction


@pytest.mark.parametrize("codec_id", LOSSY)
def test_lossy_codecs_refuse_non_finite_values(codec_id):
    params = {"dtype": "torch.float32", "k": 2, "step": 0.01, "v_dtype": "torch.float32", "eps": 1e-16}
    values = np.array([1.0, np.nan, np.inf, 2.0], np.float32).view(np.uint8)
    base = np.ones(4, np.float32).view(np.uint8) if codec_id == "normmoment" else None
    with pytest.raises(CodecError):
        get_codec(codec_id).encode_lossy(values, base, params)


@pytest.mark.parametrize("codec_id", ["deadzone", "normmoment"])
def test_values_no_int32_level_or_float32_holds_are_refused_not_wrapped(codec_id):
    """m over a second moment that underflowed to zero, or weights near float32's largest: no silent garbage."""
    base = np.zeros(4, np.float32).view(np.uint8) if codec_id == "normmoment" else None  # v = 0
    params = {"dtype": "torch.float32", "step": 0.25, "v_dtype": "torch.float32", "eps": 1e-30}
    far = np.array([1e-3, -2e-3, 5.0, -1.0], np.float32)  # / sqrt(1e-30) or / 0.25: past 2^31 steps for m
    said = "second moment is 0 where the first is not" if codec_id == "normmoment" else "2\\^31"  # the cause
    with pytest.raises(UnquantizableError, match=said):
        get_codec(codec_id).encode_lossy(far.view(np.uint8) if codec_id == "normmoment" else
                                         np.full(4, 1e9, np.float32).view(np.uint8), base, params)
    if codec_id == "deadzone":  # levels fit, but level x step rounds past float32's largest
        huge = np.array([3.4e38, -3.4e38, 3.39e38, 1.0], np.float32)
        with pytest.raises(UnquantizableError, match="overflows"):
            get_codec(codec_id).encode_lossy(huge.view(np.uint8), None, {**params, "step": 2e38})


@pytest.mark.slow
@pytest.mark.parametrize("codec_id", sorted(REGISTRY))
def test_damaged_payloads_are_refused_and_never_crash(codec_id):
    """In a process of its own: a decoder in C that segfaults or hangs is reported, not fatal to the run."""
    try:
        done = subprocess.run([sys.executable, "-W", "ignore", "-m", "ckptstore.testing.codec_contract", codec_id],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{codec_id}: the damage sweep hung (over 120 s)")
    assert done.returncode >= 0, f"{codec_id}: the damage sweep crashed with signal {-done.returncode}"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("0 problems")


def test_decode_checked_names_the_object_and_catches_a_silent_change():
    codec, params = get_codec("bytegroup"), {"width": 4, "level": 1}
    data = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint8)  # random: planes stored raw
    payload = bytearray(codec.encode(data, None, params))
    checksum = chunk_checksum(data)
    assert decode_checked("bytegroup", bytes(payload), None, params, data.size, checksum).tobytes() == data.tobytes()
    payload[-1] ^= 1  # a raw plane's byte: the codec cannot tell, the checksum can
    assert codec.decode(bytes(payload), None, params, data.size).tobytes() != data.tobytes()
    with pytest.raises(CorruptObjectError, match="obj123.*checksum"):
        decode_checked("bytegroup", bytes(payload), None, params, data.size, checksum, object_id="obj123")
    with pytest.raises(CorruptObjectError, match="payload.*bytegroup"):
        decode_checked("bytegroup", bytes(payload[:20]), None, params, data.size, checksum)
