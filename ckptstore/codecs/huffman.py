"""Order-0 Huffman coding of byte planes: the native coder (codecs/_huffman.c) and its contract.

Exponent planes are order-0 data (zstd finds few matches in them and spends its time in its own
Huffman stage); coding them with a plain Huffman code decoded several symbols per table lookup
restores them about twice as fast as zstd at the same size. The payload layout is described in
_huffman.c. Without the native module nothing is encoded this way, and payloads written elsewhere
still decode, slowly, in `_decode_python` (which is also the tests' reference).
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
    _decode_python(memoryview(payload), out)


def _canonical_codes(lengths: np.ndarray) -> dict[tuple[int, int], int]:
    """{(length, LSB-first code): byte} of the canonical code with these lengths."""
    codes, code, previous = {}, 0, 0
    for length, symbol in sorted((int(n), s) for s, n in enumerate(lengths) if n):
        code <<= length - previous
        previous = length
        reversed_code = int(format(code, f"0{length}b")[::-1], 2)
        codes[(length, reversed_code)] = symbol
        code += 1
    return codes


def _decode_python(payload: memoryview, out: np.ndarray) -> None:
    """Bit-by-bit reference decoder (slow): same checks, same results as the native one."""
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
    codes = _canonical_codes(lengths)
    bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")
    rows = out.size
    segment = -(-rows // STREAMS)
    start_byte = HEAD_BYTES
    for s in range(STREAMS):
        start, stop = min(segment * s, rows), min(segment * (s + 1), rows)
        position, end = 8 * start_byte, 8 * (start_byte + int(sizes[s]))
        for row in range(start, stop):
            if position > len(bits) - 64:
                raise ValueError("huffman: a stream runs past the payload")
            code = length = 0
            while (length, code) not in codes:  # a complete code ends within MAXBITS bits
                code |= int(bits[position + length]) << length
                length += 1
            out[row] = codes[(length, code)]
            position += length
        if position > end:
            raise ValueError("huffman: a stream decodes past its end")
        start_byte += int(sizes[s])
