"""Order-0 Huffman coding of byte planes: the native coder (codecs/_huffman.c) and its contract.

Exponent planes are order-0 data (zstd finds few matches in them and spends its time in its own
Huffman stage); coding them with a plain Huffman code decoded several symbols per table lookup
restores them about twice as fast as zstd at the same size. The payload layout is described in
_huffman.c. Without the native module nothing is encoded this way, and payloads written elsewhere
still decode in numpy (`_decode_numpy`, a few MB/s against the native 2 GB/s; also the tests' reference).
"""

from __future__ import annotations

import numpy as np

try:
    from ckptstore.codecs import _huffman as native
except ImportError:  # built without a C compiler
    native = None

MAXBITS = 11
STREAMS = 4
PAD = 8
LENGTHS_BYTES = 128
ROWS_AT = LENGTHS_BYTES
SIZES_AT = ROWS_AT + 8
HEAD_BYTES = SIZES_AT + 4 * STREAMS


def unpack_lengths(packed: bytes | memoryview) -> np.ndarray:
    data = np.frombuffer(packed, np.uint8, LENGTHS_BYTES)
    lengths = np.empty(256, dtype=np.uint8)
    lengths[0::2], lengths[1::2] = data & 15, data >> 4
    return lengths


def encode(plane: np.ndarray) -> bytes:
    """The plane (contiguous uint8) Huffman-coded with a code fitted to it; needs the native module."""
    if native is None:
        raise RuntimeError("huffman: encoding needs the native module ckptstore.codecs._huffman")
    return native.encode(plane)


def coded_size(plane: np.ndarray) -> int:
    """An upper bound (within STREAMS bytes) on the size `encode` gives `plane`, without coding it."""
    if native is None:
        raise RuntimeError("huffman: sizing needs the native module ckptstore.codecs._huffman")
    return native.coded_size(plane)


def decode_into(payload: bytes | memoryview, out: np.ndarray, use_native: bool = True) -> None:
    """Decode a plane into `out` (contiguous uint8, the plane's size); ValueError if the payload is damaged."""
    if native is not None and use_native:
        native.decode(payload, out)
        return
    _decode_numpy(memoryview(payload), out)


def _window_table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For every MAXBITS-bit window (LSB first), the byte its first code stands for and that code's length."""
    symbols = np.zeros(1 << MAXBITS, np.uint8)
    widths = np.zeros(1 << MAXBITS, np.int64)
    code, previous = 0, 0
    for length, symbol in sorted((int(n), s) for s, n in enumerate(lengths) if n):  # canonical order
        code <<= length - previous
        previous = length
        reversed_code = int(format(code, f"0{length}b")[::-1], 2)
        symbols[reversed_code :: 1 << length] = symbol
        widths[reversed_code :: 1 << length] = length
        code += 1
    return symbols, widths


def _decode_numpy(payload: memoryview, out: np.ndarray) -> None:
    """The same decoding and checks as the native coder, in numpy (the fallback and the tests' reference).

    Every bit position of a stream is decoded as if a code started there; the codes actually read
    are the path from the stream's first bit, found by pointer doubling (log2(rows) passes) instead
    of a Python loop per symbol.
    """
    if len(payload) < HEAD_BYTES + PAD:
        raise ValueError("huffman: payload is shorter than its header")
    lengths = unpack_lengths(payload[:LENGTHS_BYTES])
    if lengths.max() > MAXBITS or sum(1 << (MAXBITS - int(n)) for n in lengths if n) != 1 << MAXBITS:
        raise ValueError("huffman: code lengths do not form a complete code")
    if int(np.frombuffer(payload, "<u8", 1, ROWS_AT)[0]) != out.size:
        raise ValueError("huffman: payload holds a different number of bytes than its destination")
    sizes = np.frombuffer(payload, "<u4", STREAMS, SIZES_AT).astype(np.int64)
    if HEAD_BYTES + int(sizes.sum()) + PAD != len(payload):
        raise ValueError("huffman: stream lengths do not add up to the payload's size")
    table_symbols, table_widths = _window_table(lengths)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little").astype(np.int64)
    segment = -(-out.size // STREAMS)
    first_bit = 8 * HEAD_BYTES
    for s in range(STREAMS):
        start, stop = min(segment * s, out.size), min(segment * (s + 1), out.size)
        span = 8 * int(sizes[s])
        if stop > start:
            windows = np.zeros(span, np.int64)
            for i in range(MAXBITS):  # the stream is followed by at least PAD bytes, so these exist
                windows |= bits[first_bit + i : first_bit + i + span] << i
            path = _code_starts(table_widths[windows], stop - start)
            if path is None:
                raise ValueError("huffman: a stream decodes past its end")
            out[start:stop] = table_symbols[windows[path]]
        first_bit += span


def _code_starts(widths: np.ndarray, count: int) -> np.ndarray | None:
    """The first `count` positions of the chain 0, w[0], w[0] + w[w[0]], ... (None if it leaves the stream).

    jump[p] = p + widths[p] (the end, len(widths), is a sink); after pass k every position within
    2**(k + 1) - 1 steps of 0 is marked, so log2(count) passes of vectorized work suffice.
    """
    size = widths.size
    jump = np.minimum(np.arange(size, dtype=np.int64) + widths, size)
    jump = np.append(jump, size)
    marked = np.zeros(size + 1, bool)
    marked[0] = True
    steps = 1
    while steps < count + 1:
        marked[jump[np.flatnonzero(marked)]] = True
        jump = jump[jump]
        steps *= 2
    starts = np.flatnonzero(marked[:size])
    if starts.size < count:
        return None
    ends_at = starts[count - 1] + widths[starts[count - 1]]
    return starts[:count] if ends_at <= size else None
