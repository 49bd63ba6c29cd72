"""Zero-run coding of mostly-zero byte planes: the native coder (codecs/_huffman.c) and its contract.

The XOR of an exponent plane with its parent's is 85-95% zeros; Huffman spends at least a bit on
each zero and zstd little less. Coding the gaps between nonzero bytes and the bytes themselves (two
Huffman streams) takes about 0.6 of either's size on the benchmark runs' XOR planes, and decoding
touches only the nonzero bytes, so they are XORed into the base plane in place. The payload layout
is described in _huffman.c. Without the native module nothing is encoded this way; payloads
decode in numpy (`_decode_numpy`, also the tests' reference).
"""

from __future__ import annotations

import numpy as np

from ckptstore.codecs import huffman

RUNS_HEAD = 32
RUN_TOKEN = 255  # a gap token standing for 255 zeros with no byte after them


def encode(plane: np.ndarray) -> bytes:
    """The plane (contiguous uint8) as gap tokens and nonzero bytes, each Huffman-coded; needs the native module."""
    if huffman.native is None:
        raise RuntimeError("zeroruns: encoding needs the native module ckptstore.codecs._huffman")
    return huffman.native.encode_runs(plane)


def coded_size(plane: np.ndarray) -> int:
    """An upper bound (within 2 * huffman.STREAMS bytes) on the size `encode` gives `plane`."""
    if huffman.native is None:
        raise RuntimeError("zeroruns: sizing needs the native module ckptstore.codecs._huffman")
    return huffman.native.runs_size(plane)


def decode_into(payload: bytes | memoryview, out: np.ndarray, xor: bool = False, use_native: bool = True) -> None:
    """Write the plane into `out` (contiguous uint8, its size), or XOR it into `out`; ValueError if damaged."""
    if huffman.native is not None and use_native:
        huffman.native.decode_runs(payload, out, xor)
        return
    _decode_numpy(memoryview(payload), out, xor)


def _decode_numpy(payload: memoryview, out: np.ndarray, xor: bool) -> None:
    """The same decoding and checks as the native coder, in numpy."""
    if len(payload) < RUNS_HEAD:
        raise ValueError("huffman: zero-run payload is shorter than its header")
    rows, nonzero, tokens, gap_size = (int(v) for v in np.frombuffer(payload, "<u8", 4))
    if rows != out.size:
        raise ValueError("huffman: zero-run payload holds a different number of bytes than its destination")
    if nonzero > rows or tokens > rows or nonzero > tokens or gap_size > len(payload) - RUNS_HEAD:
        raise ValueError("huffman: zero-run counts do not fit the plane")
    gaps = np.empty(tokens, np.uint8)
    values = np.empty(nonzero, np.uint8)
    huffman.decode_into(payload[RUNS_HEAD : RUNS_HEAD + gap_size], gaps, use_native=False)
    huffman.decode_into(payload[RUNS_HEAD + gap_size :], values, use_native=False)
    literal = gaps != RUN_TOKEN
    if int(np.count_nonzero(literal)) != nonzero:
        raise ValueError("huffman: zero-run tokens and bytes do not match")
    # each literal's position: the zeros before it (all gaps so far) plus the literals before it
    positions = np.cumsum(gaps, dtype=np.int64)[literal] + np.arange(nonzero, dtype=np.int64)
    if nonzero and positions[-1] >= rows:
        raise ValueError("huffman: zero-run gaps run past the plane")
    if tokens and int(np.sum(gaps, dtype=np.int64)) + nonzero > rows:
        raise ValueError("huffman: zero-run tokens and bytes do not match")
    if not xor:
        out[...] = 0
    out[positions] ^= values
