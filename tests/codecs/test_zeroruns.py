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


def _stretches(n: int, seed: int) -> np.ndarray:
    """Stretches of every density one after another (dense, sparse, zeros longer than 255), as in an
    XOR plane of weights, then moments: the decoder's eight-token steps start and stop inside them."""
    rng = np.random.default_rng(seed)
    plane, filled = np.zeros(n, np.uint8), 0
    while filled < n:
        length = int(rng.integers(1, 3000))
        density = float(rng.choice([0.0, 0.002, 0.3, 0.9, 1.0]))
        stretch = plane[filled:filled + length]
        stretch[...] = np.where(rng.random(stretch.size) < density, rng.integers(1, 256, stretch.size), 0)
        filled += length
    return plane


@pytest.mark.parametrize("seed", range(12))
def test_stretches_of_every_density_round_trip_exactly(seed):
    plane = _stretches(int(np.random.default_rng(seed).integers(1, 60_000)), seed)
    payload = zeroruns.encode(plane)
    for use_native in (True, False):
        out = np.full(plane.size, 0x5A, np.uint8)
        zeroruns.decode_into(payload, out, use_native=use_native)
        assert out.tobytes() == plane.tobytes(), use_native
        base = RNG.integers(0, 256, plane.size).astype(np.uint8)
        into = base.copy()
        zeroruns.decode_into(payload, into, xor=True, use_native=use_native)
        assert into.tobytes() == (base ^ plane).tobytes(), use_native


GUARD = 8 * 256  # as far past the plane as one eight-token step of the native decoder could reach


def test_mutated_payloads_decode_as_the_reference_does():
    """Whatever a damaged payload decodes to, or whether it is refused, the native decoder agrees with numpy's."""
    plane = _stretches(30_000, 99)
    payload = zeroruns.encode(plane)
    outcomes = {"decoded": 0, "refused": 0}
    for seed in range(600):
        rng = np.random.default_rng(seed)
        mutated = bytearray(payload)
        for at in rng.integers(zeroruns.RUNS_HEAD, len(payload), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        base = rng.integers(0, 256, plane.size).astype(np.uint8)
        results = []
        for use_native in (True, False):
            guarded = np.concatenate([base, np.full(GUARD, 0xA5, np.uint8)])  # bytes past the plane stay
            out = guarded[:plane.size]
            try:  # from an allocation of its own: ASan (scripts/fuzz_asan.sh) sees a read past its end
                zeroruns.decode_into(np.frombuffer(mutated, np.uint8).copy(), out, xor=True, use_native=use_native)
                results.append(out.tobytes())
            except ValueError:
                results.append(None)
            assert not np.any(guarded[plane.size:] != 0xA5), (seed, use_native)
        assert (results[0] is None) == (results[1] is None), seed
        assert results[0] == results[1], seed
        outcomes["refused" if results[0] is None else "decoded"] += 1
    assert min(outcomes.values()) > 0, outcomes


def _runs_payload(rows: int, gaps: np.ndarray, values: np.ndarray) -> bytes:
    """A zero-run payload written by hand from its gap tokens and bytes, which need not agree."""
    gap_payload = huffman.encode(gaps)
    head = np.array([rows, values.size, gaps.size, len(gap_payload)], "<u8").tobytes()
    return head + gap_payload + huffman.encode(values)


@pytest.mark.parametrize("use_native", [True, False])
def test_more_gap_tokens_than_bytes_are_refused(use_native):
    """Sixteen literal tokens for eight bytes: refused, never read past the bytes (ASan checks the native one)."""
    payload = _runs_payload(5000, np.zeros(16, np.uint8), np.ones(8, np.uint8))
    with pytest.raises(ValueError, match="past the plane|do not match"):
        zeroruns.decode_into(payload, np.zeros(5000, np.uint8), xor=True, use_native=use_native)
    fitting = _runs_payload(5000, np.zeros(8, np.uint8), np.ones(8, np.uint8))  # the same, agreeing
    out = np.zeros(5000, np.uint8)
    zeroruns.decode_into(fitting, out, use_native=use_native)
    assert out.tolist() == [1] * 8 + [0] * 4992


def test_threads_coding_planes_of_every_size_at_once_get_their_own_bytes():
    """Each thread keeps its own buffer for a plane's gaps and bytes (grown, never shared): four threads coding and
    decoding planes of different sizes at once, smaller after larger, all round trip exactly."""
    from concurrent.futures import ThreadPoolExecutor

    planes = [_stretches(size, seed) for seed, size in enumerate([200_000, 3_000, 90_000, 40, 150_000, 7_000])]

    def work(offset: int) -> bool:
        for k in range(24):
            plane = planes[(offset + k) % len(planes)]
            payload = zeroruns.encode(plane)
            out = np.empty(plane.size, np.uint8)
            zeroruns.decode_into(payload, out)
            if out.tobytes() != plane.tobytes() or len(payload) > zeroruns.coded_size(plane) + 2 * huffman.STREAMS:
                return False
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
