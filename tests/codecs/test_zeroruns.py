"""Zero-run coding of mostly-zero planes (codecs/_huffman.c): round trips, XOR in place, damaged payloads."""

import numpy as np
import pytest

from ckptstore.codecs import huffman, zeroruns

RNG = np.random.default_rng(1)


def _sparse(n: int, density: float, clustered: bool = False) -> np.ndarray:
    hits = RNG.random(n) < density
    if clustered:  # runs of changed bytes, as where a block of weights moved together
        hits = np.logical_or.reduce([np.roll(hits, k) for k in range(8)])
    return np.where(hits, RNG.integers(1, 16, n), 0).astype(np.uint8)


def _planes(n: int) -> dict[str, np.ndarray]:
    gaps = np.zeros(n, np.uint8)
    gaps[254::255] = 3  # nonzero bytes exactly 254 zeros apart: gap tokens just below the escape
    long_gaps = np.zeros(n, np.uint8)
    long_gaps[::510] = 9  # 509 zeros apart: one 255 token and a remainder of 254
    return {
        "zeros": np.zeros(n, np.uint8),
        "dense": RNG.integers(0, 256, n).astype(np.uint8),
        "sparse": _sparse(n, 0.08),
        "clustered": _sparse(n, 0.01, clustered=True),
        "rare": _sparse(n, 0.0005),
        "gaps-254": gaps,
        "gaps-509": long_gaps,
        "last-byte-only": np.concatenate([np.zeros(max(n - 1, 0), np.uint8), np.full(min(n, 1), 200, np.uint8)]),
    }


@pytest.mark.parametrize("n", [0, 1, 5, 255, 256, 1000, 100_003])
def test_round_trip_writes_or_xors_the_plane_exactly(n):
    for name, plane in _planes(n).items():
        payload = zeroruns.encode(plane)
        assert len(payload) <= zeroruns.coded_size(plane) + 2 * huffman.STREAMS, name
        for use_native in (True, False):  # the numpy decoder (fallback and reference) agrees
            out = np.full(n, 0xA5, np.uint8)
            zeroruns.decode_into(payload, out, use_native=use_native)
            assert out.tobytes() == plane.tobytes(), (name, use_native)
            base = RNG.integers(0, 256, n).astype(np.uint8)
            into = base.copy()
            zeroruns.decode_into(payload, into, xor=True, use_native=use_native)
            assert into.tobytes() == (base ^ plane).tobytes(), (name, use_native)


def test_sparse_planes_code_smaller_than_huffman():
    plane = _sparse(200_000, 0.08)
    assert len(zeroruns.encode(plane)) < 0.7 * len(huffman.encode(plane))


def _damaged(payload: bytes, at: int, value: bytes) -> bytes:
    return payload[:at] + value + payload[at + len(value):]


@pytest.mark.parametrize("use_native", [True, False])
def test_damaged_headers_are_refused(use_native):
    plane = _sparse(5000, 0.1)
    payload = zeroruns.encode(plane)
    out = np.empty(plane.size, np.uint8)
    u64 = lambda v: int(v).to_bytes(8, "little")  # noqa: E731
    cases = {
        "shorter than its header": payload[:20],
        "different number of bytes": _damaged(payload, 0, u64(5001)),
        "counts do not fit": _damaged(payload, 8, u64(6000)),
        "counts do not fit ": _damaged(payload, 24, u64(len(payload))),
        "huffman": payload[:-1],  # the value stream's sizes no longer add up
    }
    for problem, damaged in cases.items():
        with pytest.raises(ValueError, match=problem.strip()):
            zeroruns.decode_into(damaged, out, use_native=use_native)


@pytest.mark.parametrize("use_native", [True, False])
def test_gaps_that_overrun_the_plane_are_refused(use_native):
    """A payload coded for a longer plane, relabelled as a shorter one, runs past its end."""
    plane = np.zeros(3000, np.uint8)
    plane[-1] = 7
    payload = _damaged(zeroruns.encode(plane), 0, (2000).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="past the plane|do not match"):
        zeroruns.decode_into(payload, np.empty(2000, np.uint8), use_native=use_native)


def test_mutated_payloads_decode_or_are_refused_without_crashing():
    plane = _sparse(20_000, 0.1)
    payload = zeroruns.encode(plane)
    refused = 0
    for seed in range(3000):
        rng = np.random.default_rng(seed)
        mutated = bytearray(payload)
        for at in rng.integers(0, len(payload), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        try:
            zeroruns.decode_into(bytes(mutated), np.empty(plane.size, np.uint8), xor=bool(seed % 2))
        except ValueError:
            refused += 1
    assert refused > 0
