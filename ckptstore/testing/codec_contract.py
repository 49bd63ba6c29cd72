"""The codec contract, as functions any codec's tests can call; every registered codec must pass them.

Round trips: lossless codecs give back every bit, with and without a base; lossy codecs decode to
exactly the reconstruction `encode_lossy` returned (the closed loop) and stay within the error
bound the codec states (`error_bound`). Damage: truncated or flipped payloads make `codec.decode`
raise a CkptError (never another exception, a crash or a hang) and `decode_checked` raise
CorruptObjectError unless what it returns is the undamaged chunk. A decoder in C could crash on
bad input, so the damage sweep runs as `python -m ckptstore.testing.codec_contract CODEC_ID`, in a
process of its own, where a segfault is reported instead of ending the test run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckptstore.codecs import capabilities, get_codec
from ckptstore.codecs.checked import decode_checked
from ckptstore.codecs.floats import from_float32, to_float32
from ckptstore.errors import CkptError, CorruptObjectError
from ckptstore.hashing import chunk_checksum

HEADER_BYTES = 64  # every bit of a payload's first bytes is flipped: headers and table starts live there
RANDOM_FLIPS = 1500
RANDOM_BYTES = 300


def check_lossless_round_trip(codec_id: str, data: np.ndarray, base: np.ndarray | None,
                              params: dict[str, Any]) -> bytes:
    """`decode(encode(data))` is `data`, bit for bit; also through `decode_chain` when offered. Returns the payload."""
    codec = get_codec(codec_id)
    payload = codec.encode(data, base, params)
    assert codec.needs_base(payload) in ((False,) if base is None else (False, True))
    decoded = codec.decode(payload, None if base is None else base.copy(), params, data.size)
    assert decoded.tobytes() == data.tobytes()
    if base is None and capabilities(codec_id).chain is not None:
        assert codec.decode_chain([payload], params, data.size).tobytes() == data.tobytes()
    return payload


def check_lossy_round_trip(codec_id: str, data: np.ndarray, base: np.ndarray | None,
                           params: dict[str, Any]) -> tuple[bytes, np.ndarray]:
    """Closed loop and error bound of one lossy chunk; returns (payload, reconstruction)."""
    codec = get_codec(codec_id)
    payload, rebuilt = codec.encode_lossy(data, base, params)
    assert rebuilt.dtype == np.uint8 and rebuilt.size == data.size
    decoded = codec.decode(payload, None if base is None else base.copy(), params, data.size)
    assert decoded.tobytes() == rebuilt.tobytes(), "decode differs from the encoder's reconstruction"
    error, bound = codec.error_bound(data, base, rebuilt, params)
    assert np.all(error <= bound), f"error {float(np.max(error - bound))} over the stated bound"
    return payload, rebuilt


def damaged(payload: bytes, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(what was done, damaged payload): truncations, every bit of the header flipped, random flips and bytes."""
    size = len(payload)
    cuts = range(size) if size <= 96 else sorted({*range(40), *np.linspace(40, size - 1, 56).astype(int)})
    for cut in cuts:
        yield f"truncated to {cut} bytes", payload[:cut]
    rng = np.random.default_rng(seed)
    header = [(i, b) for i in range(min(size, HEADER_BYTES)) for b in range(8)]
    spread = [(int(i), int(b)) for i, b in zip(rng.integers(0, size, RANDOM_FLIPS), rng.integers(0, 8, RANDOM_FLIPS))]
    for index, bit in header + spread:
        flipped = bytearray(payload)
        flipped[index] ^= 1 << bit
        yield f"bit {bit} of byte {index} flipped", bytes(flipped)
    for index in rng.integers(0, size, RANDOM_BYTES):
        replaced = bytearray(payload)
        replaced[index] = (replaced[index] + int(rng.integers(1, 256))) % 256
        yield f"byte {index} replaced", bytes(replaced)


def check_damage_refused(codec_id: str, payload: bytes, base: np.ndarray | None, params: dict[str, Any],
                         nbytes: int, seed: int = 0) -> list[str]:
    """Decode every damaged version of `payload`; the problems found (empty: the contract holds)."""
    codec = get_codec(codec_id)
    good = codec.decode(payload, None if base is None else base.copy(), params, nbytes).tobytes()
    checksum = chunk_checksum(good)
    problems = []
    for what, bad in damaged(payload, seed):
        try:
            codec.decode(bad, None if base is None else base.copy(), params, nbytes)
        except CkptError:
            pass
        except Exception as exc:  # the contract: nothing but CkptError escapes a decoder
            problems.append(f"{codec_id}, {what}: decode raised {type(exc).__name__}: {exc}")
        try:
            out = decode_checked(codec_id, bad, None if base is None else base.copy(), params, nbytes, checksum)
        except CorruptObjectError as exc:
            if "payload" not in str(exc):
                problems.append(f"{codec_id}, {what}: the error does not name the payload: {exc}")
        except Exception as exc:
            problems.append(f"{codec_id}, {what}: decode_checked raised {type(exc).__name__}: {exc}")
        else:
            if out.tobytes() != good:
                problems.append(f"{codec_id}, {what}: decode_checked returned wrong bytes")
    return problems


def _floats(rng: np.random.Generator, n: int, dtype: str, scale: float = 0.02) -> np.ndarray:
    return from_float32(rng.standard_normal(n).astype(np.float32) * np.float32(scale), dtype).copy()


def sample_chunks(codec_id: str, seed: int = 0) -> list[tuple[bytes, np.ndarray | None, dict[str, Any], int]]:
    """A few valid (payload, base, params, nbytes) of each layout a registered codec writes today."""
    rng, codec = np.random.default_rng(seed), get_codec(codec_id)
    chunks = []
    if codec_id == "bytegroup":
        weights = _floats(rng, 1500, "torch.float32")
        moved = weights.copy()
        moved[rng.integers(0, moved.size, 200)] ^= np.uint8(1)
        skewed = np.minimum(rng.geometric(0.3, 4096), 255).astype(np.uint8)
        sparse = np.where(rng.random(4096) < 0.1, skewed, 0).astype(np.uint8)
        for data, base, width in ((weights, None, 4), (moved, weights, 4), (skewed, None, 1), (sparse, None, 1),
                                  (skewed ^ sparse, skewed, 1)):
            params = {"width": width, "level": 1}
            chunks.append((codec.encode(data, base, params), base, params, data.size))
        return chunks
    if codec_id == "log2moment":
        cases = [({"dtype": "torch.float32", "k": 2}, 1e-3), ({"dtype": "torch.bfloat16", "k": -1}, 1e-3)]
    elif codec_id == "normmoment":
        cases = [({"dtype": "torch.float32", "v_dtype": "torch.float32", "step": 0.05, "eps": 1e-16}, 1e-3)]
    else:
        cases = [({"dtype": "torch.float32", "step": 0.004}, 0.02), ({"dtype": "torch.bfloat16", "step": 0.004}, 0.02),
                 ({"dtype": "torch.float32", "step": 0.001, "codebooks": True}, 0.0)]
    for params, scale in cases:
        chunks += _lossy_samples(codec, rng, params, scale)
    return chunks


def _lossy_samples(codec, rng: np.random.Generator, params: dict[str, Any], scale: float) -> list:
    dtype, n = params["dtype"], 700
    if codec.codec_id == "log2moment":
        first = from_float32(rng.standard_normal(n).astype(np.float32) ** 2 * np.float32(scale), dtype).copy()
        first[::31] = 0
    elif scale == 0.0:  # clustered values: the codebook layout
        first = from_float32(rng.choice(np.array([-0.3, -0.1, 0.05, 0.2], np.float32), n), dtype).copy()
    else:
        first = _floats(rng, n, dtype, scale)
    if codec.codec_id == "normmoment":
        base = from_float32(rng.standard_normal(n).astype(np.float32) ** 2 * np.float32(1e-6), dtype).copy()
        return [(codec.encode_lossy(first, base, params)[0], base, params, first.size)]
    payload, rebuilt = codec.encode_lossy(first, None, params)
    later = from_float32(np.abs(to_float32(first, dtype) * np.float32(1.1)), dtype).copy()
    return [(payload, None, params, first.size), (codec.encode_lossy(later, rebuilt, params)[0], rebuilt, params,
                                                  first.size)]


def damage_sweep(codec_id: str) -> list[str]:
    """Every sample chunk of `codec_id`, damaged every way `damaged` knows; the problems found."""
    problems = []
    for seed, (payload, base, params, nbytes) in enumerate(sample_chunks(codec_id)):
        problems += check_damage_refused(codec_id, payload, base, params, nbytes, seed)
    return problems


def main(argv: list[str]) -> int:
    """Run the damage sweep for the codec ids given; print each problem; exit 1 if there were any."""
    problems = [p for codec_id in argv for p in damage_sweep(codec_id)]
    for problem in problems[:50]:
        print(problem)
    print(f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
