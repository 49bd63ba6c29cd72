"""The Huffman plane coder (codecs/_huffman.c): round trips, code limits, and damaged payloads."""

import itertools

import numpy as np
import pytest

from ckptstore.codecs import huffman

RNG = np.random.default_rng(0)


def test_native_coder_is_built():
    assert huffman.native is not None, "ckptstore.codecs._huffman was not built"


def _planes(n: int) -> dict[str, np.ndarray]:
    fibonacci = [1, 1]
    while len(fibonacci) < 30:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])
    deep = np.array(fibonacci, float) / sum(fibonacci)  # an optimal code 29 bits deep
    signs = RNG.integers(0, 2, n)
    return {
        "uniform": RNG.integers(0, 256, n).astype(np.uint8),
        "constant": np.full(n, 7, np.uint8),
        "geometric": np.minimum(RNG.geometric(0.3, n), 255).astype(np.uint8),
        "exponent-like": (np.clip(RNG.normal(120, 2, n), 0, 127).astype(int) | signs << 7).astype(np.uint8),
        "deep": RNG.choice(30, n, p=deep).astype(np.uint8),
    }


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 19, 1000, 100_003])
def test_round_trip_is_exact_and_codes_stay_within_the_limit(n):
    for name, plane in _planes(n).items():
        payload = huffman.encode(plane)
        lengths = huffman.unpack_lengths(payload[: huffman.LENGTHS_BYTES]).astype(int)
        assert lengths.max() <= huffman.MAXBITS, name
        assert sum(2.0 ** -length for length in lengths if length) == 1.0, name  # a complete code
        assert len(payload) <= huffman.coded_size(plane), name
        out = np.empty(n, np.uint8)
        huffman.decode_into(payload, out)
        assert out.tobytes() == plane.tobytes(), name
        reference = np.zeros(n, np.uint8)  # the numpy decoder (fallback and reference) agrees
        huffman.decode_into(payload, reference, use_native=False)
        assert reference.tobytes() == plane.tobytes(), name


def test_skewed_planes_code_near_their_entropy():
    plane = _planes(200_000)["exponent-like"]
    p = np.bincount(plane, minlength=256) / plane.size
    entropy_bytes = -(p[p > 0] * np.log2(p[p > 0])).sum() * plane.size / 8
    assert entropy_bytes < len(huffman.encode(plane)) < 1.03 * entropy_bytes + 200


def _damaged(payload: bytes, at: int, value: bytes) -> bytes:
    return payload[:at] + value + payload[at + len(value):]


@pytest.mark.parametrize("use_native", [True, False])
def test_damaged_headers_are_refused(use_native):
    plane = _planes(600)["geometric"]
    payload = huffman.encode(plane)
    out = np.empty(plane.size, np.uint8)
    first_size = huffman.SIZES_AT
    cases = {
        "shorter than its header": payload[:100],
        "complete code": _damaged(payload, 0, bytes([0xBB])),  # lengths 11 and 11 for bytes 0 and 1
        "different number of bytes": _damaged(payload, huffman.ROWS_AT, (601).to_bytes(8, "little")),
        "add up": _damaged(payload, first_size, (1 << 20).to_bytes(4, "little")),
        "add up ": payload[:-1],
    }
    for problem, damaged in cases.items():
        with pytest.raises(ValueError, match=problem.strip()):
            huffman.decode_into(damaged, out, use_native=use_native)


@pytest.mark.parametrize("use_native", [True, False])
def test_stream_lengths_moved_between_streams_are_caught(use_native):
    plane = _planes(4000)["geometric"]
    payload = bytearray(huffman.encode(plane))
    sizes = np.frombuffer(bytes(payload[huffman.SIZES_AT : huffman.HEAD_BYTES]), "<u4").copy()
    sizes[0], sizes[1] = sizes[0] - 40, sizes[1] + 40  # the total still adds up
    payload[huffman.SIZES_AT : huffman.HEAD_BYTES] = sizes.astype("<u4").tobytes()
    with pytest.raises(ValueError, match="past its end"):
        huffman.decode_into(bytes(payload), np.empty(plane.size, np.uint8), use_native=use_native)


def test_garbage_streams_never_read_outside_the_payload():
    """Random stream bytes decode to something or are refused, but never crash or overrun."""
    plane = _planes(3000)["exponent-like"]
    payload = bytearray(huffman.encode(plane))
    refused = 0
    for seed in range(200):
        noise = np.random.default_rng(seed).integers(0, 256, len(payload) - huffman.HEAD_BYTES - huffman.PAD)
        payload[huffman.HEAD_BYTES : -huffman.PAD] = noise.astype(np.uint8).tobytes()
        out = np.empty(plane.size, np.uint8)
        try:
            huffman.decode_into(bytes(payload), out)
        except ValueError:
            refused += 1
    assert refused > 0  # noise decodes to more or fewer bits than the streams hold


def _quarters(n: int, order: tuple[int, ...]) -> np.ndarray:
    """A plane whose four quarters (the four streams' rows) hold planes of very different entropy."""
    kinds = [_planes(n)[name] for name in ("constant", "geometric", "exponent-like", "uniform")]
    quarter = -(-n // huffman.STREAMS)
    return np.concatenate([kinds[k][i * quarter:(i + 1) * quarter] for i, k in enumerate(order)])[:n]


@pytest.mark.parametrize("n", [4 * 40 + 3, 100_003])
def test_streams_that_run_out_at_different_times_decode_exactly(n):
    """The streams left when the fastest of the four runs out decode two at a time, then alone."""
    for order in itertools.permutations(range(huffman.STREAMS)):
        plane = _quarters(n, order)
        payload = huffman.encode(plane)
        out = np.empty(n, np.uint8)
        huffman.decode_into(payload, out)
        assert out.tobytes() == plane.tobytes(), order


def test_mutated_payloads_of_uneven_streams_decode_as_the_reference_does():
    """Whatever a damaged payload decodes to, or whether it is refused, the native decoder agrees with numpy's."""
    plane = _quarters(20_000, (3, 0, 2, 1))
    payload = huffman.encode(plane)
    refused = 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        mutated = bytearray(payload)
        for at in rng.integers(huffman.HEAD_BYTES, len(payload), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        native, reference = np.empty(plane.size, np.uint8), np.empty(plane.size, np.uint8)
        exact = np.frombuffer(mutated, np.uint8).copy()  # its own allocation: ASan sees a read past its end
        outcomes = []
        for out, use_native in ((native, True), (reference, False)):
            try:
                huffman.decode_into(exact, out, use_native=use_native)
                outcomes.append("decoded")
            except ValueError:
                outcomes.append("refused")
        assert outcomes[0] == outcomes[1], seed
        refused += outcomes[0] == "refused"
        if outcomes[0] == "decoded":
            assert native.tobytes() == reference.tobytes(), seed
    assert refused > 0


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)])
def test_a_last_stream_started_late_stops_at_the_payloads_end(order):
    """The last stream declared 64 bytes shorter starts 64 bytes late and needs more bits than remain: every decoding
    loop stops its loads at the payload's end (an allocation of exactly its size, where ASan in scripts/fuzz_asan.sh
    sees one byte past it) and the payload is refused."""
    plane = _quarters(40_000, order)
    payload = bytearray(huffman.encode(plane))
    sizes = np.frombuffer(bytes(payload[huffman.SIZES_AT : huffman.HEAD_BYTES]), "<u4").copy()
    sizes[2], sizes[3] = sizes[2] + 64, sizes[3] - 64
    payload[huffman.SIZES_AT : huffman.HEAD_BYTES] = sizes.astype("<u4").tobytes()
    for use_native in (True, False):
        with pytest.raises(ValueError, match="past"):
            huffman.decode_into(np.frombuffer(payload, np.uint8).copy(), np.empty(plane.size, np.uint8),
                                use_native=use_native)
