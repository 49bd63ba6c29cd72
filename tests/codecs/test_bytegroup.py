import sys

import numpy as np
import pytest
import zstandard

from ckptstore.codecs import get_codec
from ckptstore.errors import CodecError

CODEC = get_codec("bytegroup")


def _floats(n, dtype, scale=0.02, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.uint8, np.int32])
def test_keyframe_round_trip_is_bit_exact(dtype):
    values = _floats(100_003, dtype) if np.dtype(dtype).kind == "f" else np.arange(100_003).astype(dtype)
    data = values.view(np.uint8)
    params = {"width": values.itemsize, "level": 1}
    payload = CODEC.encode(data, None, params)
    assert not CODEC.needs_base(payload)
    out = CODEC.decode(payload, None, params, data.size)
    assert out.tobytes() == data.tobytes()


def test_residual_round_trip_and_is_smaller_than_keyframe():
    base = _floats(200_000, np.float32)
    new = base + _floats(200_000, np.float32, scale=1e-6, seed=1)
    params = {"width": 4, "level": 1}
    residual = CODEC.encode(new.view(np.uint8), base.view(np.uint8), params)
    keyframe = CODEC.encode(new.view(np.uint8), None, params)
    assert CODEC.needs_base(residual)
    assert len(residual) < 0.8 * len(keyframe)
    out = CODEC.decode(residual, base.view(np.uint8).copy(), params, new.nbytes)
    assert out.tobytes() == new.tobytes()


def test_unrelated_base_falls_back_to_planes_that_need_no_base():
    base = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8)
    new = np.zeros(40_000, dtype=np.uint8)
    payload = CODEC.encode(new, base, {"width": 1})
    assert not CODEC.needs_base(payload)
    assert CODEC.decode(payload, None, {"width": 1}, new.size).tobytes() == new.tobytes()


def test_incompressible_data_is_stored_raw_not_larger():
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    payload = CODEC.encode(data, None, {"width": 4})
    assert len(payload) <= data.size + 64


def test_truncated_or_garbled_payload_raises_codec_error():
    data = _floats(10_000, np.float32).view(np.uint8)
    payload = CODEC.encode(data, None, {"width": 4})
    with pytest.raises(CodecError):
        CODEC.decode(payload[:-10], None, {"width": 4}, data.size)
    with pytest.raises(CodecError):
        CODEC.decode(b"XX" + payload[2:], None, {"width": 4}, data.size)
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("nope")


def test_residual_without_base_is_refused():
    base = _floats(10_000, np.float32)
    payload = CODEC.encode((base * 1.0001).view(np.uint8), base.view(np.uint8), {"width": 4})
    assert CODEC.needs_base(payload)
    with pytest.raises(CodecError, match="without its base"):
        CODEC.decode(payload, None, {"width": 4}, base.nbytes)


def test_chain_decode_matches_level_by_level_replay():
    levels = [_floats(50_000, np.float32)]
    for seed in range(1, 5):
        levels.append(levels[-1] + _floats(50_000, np.float32, scale=1e-4, seed=seed))
    params = {"width": 4}
    payloads = [CODEC.encode(levels[0].view(np.uint8), None, params)]
    payloads += [CODEC.encode(levels[i].view(np.uint8), levels[i - 1].view(np.uint8), params) for i in range(1, 5)]
    assert all(CODEC.needs_base(p) for p in payloads[1:])
    chained = CODEC.decode_chain(payloads[::-1], params, levels[0].nbytes)
    assert chained.tobytes() == levels[-1].tobytes()
    step_by_step = CODEC.decode(payloads[0], None, params, levels[0].nbytes)
    for payload in payloads[1:]:
        step_by_step = CODEC.decode(payload, step_by_step, params, levels[0].nbytes)
    assert step_by_step.tobytes() == levels[-1].tobytes()
    with pytest.raises(CodecError, match="without its base"):
        CODEC.decode_chain(payloads[:0:-1], params, levels[0].nbytes)


def test_grouped_base_planes_encode_exactly_like_the_raw_base():
    base = _floats(60_000, np.float32)
    new = base + _floats(60_000, np.float32, scale=1e-5, seed=7)
    params = {"width": 4}
    keyframe = CODEC.encode(base.view(np.uint8), None, params)
    planes = CODEC.decode_planes([keyframe], base.nbytes)
    assert [p.tobytes() for p in planes] == [base.view(np.uint8).reshape(-1, 4)[:, j].tobytes() for j in range(4)]
    from_planes = CODEC.encode(new.view(np.uint8), None, params, base_planes=planes)
    assert from_planes == CODEC.encode(new.view(np.uint8), base.view(np.uint8), params)
    assert CODEC.decode_chain([from_planes, keyframe], params, new.nbytes).tobytes() == new.tobytes()
    with pytest.raises(CodecError, match="base planes"):
        CODEC.encode(new.view(np.uint8), None, params, base_planes=planes[:3])


def test_plane_hints_skip_sampling_and_fall_back_when_they_no_longer_pay():
    base = _floats(80_000, np.float32)
    new = base + _floats(80_000, np.float32, scale=1e-6, seed=3)
    data, base_bytes = new.view(np.uint8), base.view(np.uint8)
    sampled = CODEC.encode(data, base_bytes, {"width": 4})
    modes = CODEC.plane_modes(sampled)
    assert CODEC.encode(data, base_bytes, {"width": 4, "plane_hints": modes}) == sampled
    forced_raw = CODEC.encode(data, base_bytes, {"width": 4, "plane_hints": [0, 0, 0, 0]})
    assert CODEC.plane_modes(forced_raw) == [0, 0, 0, 0]
    noise = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
    fell_back = CODEC.encode(noise, base_bytes, {"width": 4, "plane_hints": [1, 1, 2, 2]})
    assert CODEC.plane_modes(fell_back) == [0, 0, 0, 0]  # hinted zstd no longer compresses: sampled again
    for payload, original in ((sampled, data), (forced_raw, data), (fell_back, noise)):
        assert CODEC.decode(payload, base_bytes.copy(), {"width": 4}, data.size).tobytes() == original.tobytes()


def test_plane_that_decompresses_to_the_wrong_size_is_a_codec_error():
    data = np.zeros(40_000, dtype=np.uint8)  # one compressible plane
    payload = CODEC.encode(data, None, {"width": 1})
    with pytest.raises(CodecError, match="expected 30000"):
        CODEC.decode_chain([payload], {"width": 1}, 30_000)  # the frame holds more than the chunk
    with pytest.raises(CodecError, match="expected 50000"):
        CODEC.decode_chain([payload], {"width": 1}, 50_000)
    garbled = bytearray(payload)
    garbled[-8:] = b"\xff" * 8
    with pytest.raises(CodecError, match="plane 0"):
        CODEC.decode_chain([bytes(garbled)], {"width": 1}, 40_000)


def _training_steps(n=60_000):
    """Weights before and after a step that moves some exponents: dense planes Huffman codes well, XOR or whole."""
    base = _floats(n, np.float32)
    return base, (base * (1 + _floats(n, np.float32, scale=0.3, seed=5))).astype(np.float32)


def test_exponent_planes_take_huffman_their_sparse_xor_zero_runs_and_round_trip():
    from ckptstore.codecs.bytegroup import HUF, XOR_RUNS

    base, new = _training_steps()  # 82% of the exponent bytes unchanged
    keyframe = CODEC.encode(base.view(np.uint8), None, {"width": 4})
    residual = CODEC.encode(new.view(np.uint8), base.view(np.uint8), {"width": 4})
    assert CODEC.plane_modes(keyframe)[3] == HUF and CODEC.plane_modes(residual)[3] == XOR_RUNS
    assert CODEC.decode_chain([residual, keyframe], {"width": 4}, new.nbytes).tobytes() == new.tobytes()
    hints = {"width": 4, "plane_hints": CODEC.plane_modes(residual)}
    assert CODEC.encode(new.view(np.uint8), base.view(np.uint8), hints) == residual


def test_without_the_native_coder_zstd_is_written_and_huffman_planes_still_decode(monkeypatch):
    from ckptstore.codecs import huffman
    from ckptstore.codecs.bytegroup import HUF, HUF_MODES, RUNS_MODES, XOR_ZSTD, ZSTD

    base, new = _training_steps(20_000)
    with_native = CODEC.encode(new.view(np.uint8), None, {"width": 4})
    assert HUF in CODEC.plane_modes(with_native)
    monkeypatch.setattr(huffman, "native", None)
    assert CODEC.decode(with_native, None, {"width": 4}, new.nbytes).tobytes() == new.tobytes()
    keyframe = CODEC.encode(base.view(np.uint8), None, {"width": 4})
    residual = CODEC.encode(new.view(np.uint8), base.view(np.uint8), {"width": 4, "plane_hints": [0, 0, 4, 6]})
    assert not set(CODEC.plane_modes(keyframe) + CODEC.plane_modes(residual)) & set(HUF_MODES + RUNS_MODES)
    assert {ZSTD, XOR_ZSTD} & set(CODEC.plane_modes(keyframe) + CODEC.plane_modes(residual))
    assert CODEC.decode_chain([residual, keyframe], {"width": 4}, new.nbytes).tobytes() == new.tobytes()


@pytest.mark.parametrize("native", [True, False])
def test_a_chain_of_zero_run_residuals_replays_exactly_with_and_without_the_native_coder(monkeypatch, native):
    from ckptstore.codecs import huffman
    from ckptstore.codecs.bytegroup import XOR_RUNS

    steps = [_floats(50_000, np.float32)]
    for seed in (7, 8):
        steps.append((steps[-1] * (1 + _floats(50_000, np.float32, scale=0.2, seed=seed))).astype(np.float32))
    payloads = [CODEC.encode(steps[0].view(np.uint8), None, {"width": 4})]
    for before, after in zip(steps, steps[1:]):
        payloads.insert(0, CODEC.encode(after.view(np.uint8), before.view(np.uint8), {"width": 4}))
    assert [CODEC.plane_modes(p)[3] for p in payloads[:2]] == [XOR_RUNS, XOR_RUNS]
    if not native:
        monkeypatch.setattr(huffman, "native", None)
    assert CODEC.decode_chain(payloads, {"width": 4}, steps[-1].nbytes).tobytes() == steps[-1].tobytes()
    planes = CODEC.decode_planes(payloads, steps[-1].nbytes)  # the GPU path's per-level planes
    assert planes[3].tobytes() == steps[-1].view(np.uint8)[3::4].tobytes()
    damaged = bytearray(payloads[0])
    damaged[-40:-32] = b"\xff" * 8
    with pytest.raises(CodecError, match="plane 3"):
        CODEC.decode_chain([bytes(damaged), *payloads[1:]], {"width": 4}, steps[-1].nbytes)


def test_damaged_huffman_plane_is_a_codec_error():
    _, new = _training_steps()
    payload = bytearray(CODEC.encode(new.view(np.uint8), None, {"width": 4}))
    payload[-16:-8] = b"\xff" * 8  # the last plane's fourth stream
    with pytest.raises(CodecError, match="plane 3"):
        CODEC.decode_chain([bytes(payload)], {"width": 4}, new.nbytes)
    exponents = np.ascontiguousarray(new.view(np.uint8)[3::4])
    one_plane = CODEC.encode(exponents, None, {"width": 1})
    with pytest.raises(CodecError, match="different number of bytes"):
        CODEC.decode_chain([one_plane], {"width": 1}, exponents.size - 1)


class _WithoutChainDecoder:
    """The native coder with its one-call chain decoder declining every chunk: the Python path runs."""

    def __init__(self, native):
        self._native = native

    def __getattr__(self, name):
        return getattr(self._native, name)

    @staticmethod
    def decode_chain(payloads, out, scratch):
        return False


def _chains() -> dict[str, tuple[list[bytes], np.ndarray]]:
    """Chains (newest payload first) and what they decode to: every plane mode the native decoder takes, and zstd."""
    steps = [_floats(30_000, np.float32)]
    for seed in (7, 8):
        steps.append((steps[-1] * (1 + _floats(30_000, np.float32, scale=0.2, seed=seed))).astype(np.float32))
    chains = {}
    for name, hints in {"zero runs": None, "xor huffman": [0, 0, 0, 4], "xor zstd": [0, 0, 0, 2]}.items():
        payloads = [CODEC.encode(steps[0].view(np.uint8), None, {"width": 4})]
        for before, after in zip(steps, steps[1:]):
            params = {"width": 4, **({"plane_hints": hints} if hints else {})}
            payloads.insert(0, CODEC.encode(after.view(np.uint8), before.view(np.uint8), params))
        chains[name] = (payloads, steps[-1].view(np.uint8))
    for dtype in (np.float16, np.float64, np.uint8):
        values = _floats(20_001, dtype) if np.dtype(dtype).kind == "f" else np.arange(20_001).astype(dtype)
        chains[f"keyframe {np.dtype(dtype).name}"] = ([CODEC.encode(values.view(np.uint8), None, {
            "width": values.itemsize})], values.view(np.uint8))
    return chains


def test_native_chain_decoder_matches_the_python_path(monkeypatch):
    from ckptstore.codecs import huffman
    from ckptstore.codecs.bytegroup import XOR_HUF, XOR_ZSTD

    chains = _chains()
    assert CODEC.plane_modes(chains["xor huffman"][0][0])[3] == XOR_HUF
    assert CODEC.plane_modes(chains["xor zstd"][0][0])[3] == XOR_ZSTD
    if sys.platform == "linux":  # libzstd.so.1 is part of every Linux distribution's base system
        assert huffman.native.ZSTD
    for name, (payloads, expected) in chains.items():  # one native call takes every chain, zstd too
        scratch = np.empty(expected.size * 2 + 64, dtype=np.uint8)
        taken = huffman.native.decode_chain(payloads, np.empty_like(expected), scratch)
        assert taken or not huffman.native.ZSTD, name
    native = {name: CODEC.decode_chain(p, {}, expected.size).tobytes() for name, (p, expected) in chains.items()}
    monkeypatch.setattr(huffman, "native", _WithoutChainDecoder(huffman.native))
    for name, (payloads, expected) in chains.items():
        assert native[name] == expected.tobytes(), name
        assert CODEC.decode_chain(payloads, {}, expected.size).tobytes() == native[name], name


def test_native_chain_decoder_refuses_damage_like_the_python_path(monkeypatch):
    from ckptstore.codecs import huffman

    payloads, expected = _chains()["zero runs"]
    cases = {
        "truncated": [payloads[0][:4], *payloads[1:]],
        "valid header": [b"BG2" + payloads[0][3:], *payloads[1:]],
        "header says": [payloads[0][:-1], *payloads[1:]],
        "unknown mode": [payloads[0][:6] + b"\x09" + payloads[0][7:], *payloads[1:]],
        "without its base": payloads[:1],
        "disagree on the element width": [payloads[0], CODEC.encode(expected[:60_000], None, {"width": 2})],
        "plane 3 does not decode": [payloads[0][:-12] + b"\xff" * 4 + payloads[0][-8:], *payloads[1:]],
    }
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(huffman, "native", _WithoutChainDecoder(huffman.native))
        for problem, chain in cases.items():
            with pytest.raises(CodecError, match=problem):
                CODEC.decode_chain(chain, {}, expected.size)


def test_native_chain_decoder_refuses_damaged_zstd_planes_like_the_python_path(monkeypatch):
    from ckptstore.codecs import huffman
    from ckptstore.codecs.bytegroup import _HEAD, _PLANE

    payloads, expected = _chains()["xor zstd"]
    top = payloads[0]
    offset = _HEAD.size + 4 * _PLANE.size + sum(_PLANE.unpack_from(top, _HEAD.size + j * _PLANE.size)[1]
                                               for j in range(3))
    frame = top[offset:]  # plane 3, the XOR zstd one, is last
    assert frame[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame's magic

    def with_frame(new: bytes) -> list[bytes]:
        header = bytearray(top[:offset])
        _PLANE.pack_into(header, _HEAD.size + 3 * _PLANE.size, _PLANE.unpack_from(top, _HEAD.size + 3 * _PLANE.size)[0],
                         len(new))
        return [bytes(header) + new, *payloads[1:]]

    cases = {
        "not a frame": with_frame(b"\x00" * len(frame)),
        "frame cut short": with_frame(frame[:-5]),
        "bytes after the frame": with_frame(frame + b"\x00\x01"),
        "frame of another size": with_frame(zstandard.ZstdCompressor().compress(b"\x01" * 100)),
    }
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(huffman, "native", _WithoutChainDecoder(huffman.native))
        for chain in cases.values():
            with pytest.raises(CodecError, match="plane 3"):
                CODEC.decode_chain(chain, {}, expected.size)
    assert CODEC.decode_chain(with_frame(frame), {}, expected.size).tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", ["zero runs", "xor zstd"])
def test_mutated_chains_decode_as_the_python_path_does_or_are_refused(monkeypatch, name):
    from ckptstore.codecs import huffman

    payloads, expected = _chains()[name]
    native, python = huffman.native, _WithoutChainDecoder(huffman.native)
    refused = 0
    for seed in range(600):
        rng = np.random.default_rng(seed)
        level = int(rng.integers(0, len(payloads)))
        mutated = bytearray(payloads[level])
        for at in rng.integers(0, len(mutated), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        chain = [bytes(mutated) if i == level else p for i, p in enumerate(payloads)]
        results = []
        for coder in (native, python):
            monkeypatch.setattr(huffman, "native", coder)
            try:
                results.append(CODEC.decode_chain(chain, {}, expected.size).tobytes())
            except CodecError:
                results.append(None)
        refused += results[0] is None
        assert results[0] == results[1] or None in results, seed  # never two different decodings
    assert refused > 0


def test_a_large_sparse_xor_plane_takes_zero_runs_though_each_sample_is_small():
    """Headers count once per plane: four 16 KiB samples must not weigh zero runs' 352 bytes as if each were a plane."""
    from ckptstore.codecs.bytegroup import XOR_RUNS, _compressor

    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, 1 << 21).astype(np.uint8)
    residual = np.where(rng.random(base.size) < 0.005, rng.integers(1, 4, base.size), 0).astype(np.uint8)
    payload = CODEC.encode(base ^ residual, base, {"width": 1})
    assert CODEC.plane_modes(payload) == [XOR_RUNS]
    assert len(payload) < 0.6 * len(_compressor(1).compress(residual))  # what zstd would have stored
    assert CODEC.decode(payload, base.copy(), {"width": 1}, base.size).tobytes() == (base ^ residual).tobytes()
