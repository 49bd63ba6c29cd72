"""Lossless codec: byte planes, each stored raw, or coded whole or XORed with the base's plane.

Planes are all first bytes, then all second bytes, and so on; each plane takes whichever coding a
sample says is smallest, weighed by how fast it decodes (`PREFERENCE`): zstd, Huffman
(codecs/huffman.py, about 2x zstd's decoding speed on exponent planes, 4x on dense XOR planes), or
zero runs (codecs/zeroruns.py, for mostly-zero XOR planes: about 0.6 of Huffman's or zstd's size
there, XORed into the base in place). A chunk whose previous residual recorded its modes
(`plane_hints`) reuses them without sampling; a keyframe always samples, so choices are revisited
every chain.

Exponent bytes of floats are highly redundant and mostly unchanged between checkpoints, while
mantissa noise is not compressible at all; grouping bytes lets the coders see the first and lets
us skip the second cheaply. Chunk layout: b"BG1", width (u8), plane count (u16), then per plane
mode (u8) and payload length (u64), then the payloads in order.
"""

from __future__ import annotations

import functools
import struct
import threading
from typing import Any

import numpy as np
import zstandard

from ckptstore import threadlocal
from ckptstore.codecs import huffman, zeroruns
from ckptstore.codecs.planes import group, interleave
from ckptstore.errors import CodecError

MAGIC = b"BG1"
RAW, ZSTD, XOR_ZSTD, HUF, XOR_HUF, RUNS, XOR_RUNS = 0, 1, 2, 3, 4, 5, 6
# (XORed with the base's plane?, coder) of each coded mode
_MODES = {(False, "zstd"): ZSTD, (True, "zstd"): XOR_ZSTD, (False, "huffman"): HUF, (True, "huffman"): XOR_HUF,
          (False, "runs"): RUNS, (True, "runs"): XOR_RUNS}
_CODER = {mode: coder for (_, coder), mode in _MODES.items()}
XOR_MODES = frozenset(mode for (xor, _), mode in _MODES.items() if xor)
HUF_MODES = (HUF, XOR_HUF)
RUNS_MODES = (RUNS, XOR_RUNS)
_HEAD = struct.Struct("<3sBH")
MODE_NAMES = {RAW: "raw", ZSTD: "zstd", XOR_ZSTD: "xor-zstd", HUF: "huffman", XOR_HUF: "xor-huffman",
              RUNS: "runs", XOR_RUNS: "xor-runs"}
# Every payload layout `decode`/`decode_chain` accept; tests/fixtures holds one of each, forever.
DECODES = (*(f"plane:{name}" for name in MODE_NAMES.values()), "chain")
_PLANE = struct.Struct("<BQ")
SAMPLE_BYTES = 1 << 14
SAMPLES = 4
INCOMPRESSIBLE = 0.97
# An XOR plane ties checkout to the whole chain below it (each level decompressed and XORed), a
# plane stored whole needs only its own level; XOR is taken only when it is this much smaller.
# From-scratch runs' exponent planes XOR to 0.6-0.8 of their whole size, and decoding them at
# every level was most of a lossless checkout. On 6 commits of each benchmark run, against
# always taking the smaller: stored 2.1% (fp32) and 5.7% (bf16) more, checkout of a depth-2
# commit 25-40% faster; the fine-tune, whose XOR planes are 5x smaller, is unchanged.
XOR_GAIN = 0.6
# A coder's estimated size is divided by its preference before the sizes are compared.
# Huffman and zero runs are taken unless zstd is more than 4% smaller: on the benchmark runs'
# exponent planes Huffman is 1-3% larger and decodes 1.7x (dense) to 4x (XOR planes) faster; on
# the from-scratch runs' XOR planes zero runs are 40% smaller than zstd and decode 4x faster, on the
# fine-tune's (1.5% nonzero) as small as zstd and 2.7x faster, counting zstd's XOR pass.
PREFERENCE = {"zstd": 1.0, "huffman": 1.04, "runs": 1.04}
# Bytes a payload costs whatever its plane's size (headers, tables, padding): counted once per
# plane, not once per sample, or a 64 KiB sample makes zero runs' 352 look like a quarter of a
# sparse plane's payload.
FIXED_BYTES = {"zstd": 0, "huffman": huffman.HEAD_BYTES + huffman.PAD,
               "runs": zeroruns.RUNS_HEAD + 2 * (huffman.HEAD_BYTES + huffman.PAD)}
HUF_MIN_ROWS = 1 << 10  # below this, the 160 bytes of header and padding and the table setup outweigh the gain
RUNS_DENSITY = 0.5  # zero runs are not tried on samples with more nonzero bytes than this (each costs two symbols)

_local = threading.local()


# At the fast levels, few and long matches: byte planes are mostly literals, and zstd's short
# matches on them cost more to code (and to decode) than the literals they replace. Measured on
# three benchmark runs' planes: 2.5-3% smaller, encoding 1.2-1.6x and decoding 1.2-2.8x faster.
FEW_MATCHES = {"min_match": 7, "search_log": 1, "hash_log": 6}


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        tuning = FEW_MATCHES if level <= 1 else {}
        params = zstandard.ZstdCompressionParameters.from_level(level, **tuning)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompress_into(frame: memoryview, dst: np.ndarray) -> int:
    """Decompress one zstd frame into the contiguous `dst`; returns how many bytes the frame held.

    At most dst.size + 1 are counted, enough to notice a frame larger than `dst`.
    """
    reader = threadlocal.decompressor().stream_reader(frame, read_size=max(len(frame), 1))
    target, got = memoryview(dst).cast("B"), 0
    while got < len(target):
        count = reader.readinto(target[got:])
        if not count:
            return got
        got += count
    return got + len(reader.read(1))


@functools.lru_cache(maxsize=256)
def _sample_slices(rows: int) -> tuple[slice, ...]:
    """A few blocks spread over a plane: enough to guess which mode compresses best.

    Cached: a checkpoint has few distinct plane sizes, and linspace costs more than the slicing.
    """
    if rows <= SAMPLES * SAMPLE_BYTES:
        return (slice(0, rows),)
    starts = np.linspace(0, rows - SAMPLE_BYTES, SAMPLES).astype(np.int64)
    return tuple(slice(int(s), int(s) + SAMPLE_BYTES) for s in starts)


def _planes(data: np.ndarray, width: int) -> np.ndarray:
    return data.reshape(-1, width)


def _native_fits(rows: int) -> bool:
    """Whether a plane of `rows` bytes may be Huffman- or zero-run-coded here (needs the native coder)."""
    return huffman.native is not None and rows >= HUF_MIN_ROWS


def _code(data: np.ndarray, mode: int, compressor: zstandard.ZstdCompressor) -> bytes:
    """`data` (a plane, or its XOR with the base's) coded as `mode` says."""
    coder = _CODER[mode]
    if coder == "huffman":
        return huffman.encode(data)
    return zeroruns.encode(data) if coder == "runs" else compressor.compress(data)


def _sample_sizes(sample: np.ndarray, rows: int, compressor: zstandard.ZstdCompressor
                  ) -> dict[str, tuple[int, bytes | None]]:
    """Each coder that may code a plane of `rows` bytes: its size on `sample` (and zstd's payload)."""
    payload = compressor.compress(sample)
    sizes: dict[str, tuple[int, bytes | None]] = {"zstd": (len(payload), payload)}
    if _native_fits(rows):
        sizes["huffman"] = (huffman.coded_size(sample), None)
        if np.count_nonzero(sample) <= RUNS_DENSITY * sample.size:
            sizes["runs"] = (zeroruns.coded_size(sample), None)
    return sizes


class ByteGroupCodec:
    """Byte planes coded with zstd or Huffman, with XOR residual planes when a base is given."""

    codec_id = "bytegroup"

    def encode(self, data: np.ndarray, base: np.ndarray | None, params: dict[str, Any],
               base_planes: list[np.ndarray] | None = None) -> bytes:
        """Compress `data`, residual per plane against `base` (raw bytes) or `base_planes` (grouped).

        Giving the base already grouped (as `decode_planes` returns it) saves a transpose each way.
        """
        width = int(params["width"])
        if data.size % width:
            raise CodecError(f"bytegroup: {data.size} bytes is not a multiple of width {width}")
        if base_planes is None and base is not None:
            base_planes = list(group(base, width))
        return b"".join(self.encode_grouped_parts(group(data, width), base_planes, params)[0])

    def encode_grouped_parts(self, grouped: np.ndarray, base_planes: list[np.ndarray] | None,
                             params: dict[str, Any]) -> tuple[list[bytes | memoryview], list[int]]:
        """`encode` of data grouped into byte planes ((width, rows), as `group` gives), in parts, with plane modes.

        The parts are consecutive: the header, then each plane's payload.

        The writer groups a chunk itself to keep its planes as the next commit's base (repo/planecache.py),
        and hands the parts to the store as they are: joining them copied every stored byte.
        """
        width = int(params["width"])
        compressor = _compressor(int(params.get("level", 1)))
        if grouped.shape[0] != width:
            raise CodecError(f"bytegroup: {grouped.shape[0]} planes given for width {width}")
        if base_planes is not None and (len(base_planes) != width or any(b.size != grouped.shape[1]
                                                                          for b in base_planes)):
            raise CodecError("bytegroup: base planes do not match the chunk's layout")
        hints = params.get("plane_hints")
        headers, payloads, modes = [_HEAD.pack(MAGIC, width, width)], [], []
        for j in range(width):
            plane = grouped[j]
            base_plane = base_planes[j] if base_planes is not None else None
            hinted = self._hinted_plane(plane, base_plane, compressor, hints[j]) if hints else None
            mode, payload = hinted or self._compress_plane(plane, base_plane, compressor)
            headers.append(_PLANE.pack(mode, len(payload)))
            payloads.append(payload)
            modes.append(mode)
        return [b"".join(headers), *payloads], modes

    @staticmethod
    def _hinted_plane(plane: np.ndarray, base_plane: np.ndarray | None, compressor: zstandard.ZstdCompressor,
                      hint: int) -> tuple[int, bytes | memoryview] | None:
        """The plane in the mode this chunk's previous residual chose, without sampling.

        None when that mode does not apply or no longer compresses; the caller then samples.
        """
        if hint == RAW:
            return RAW, plane.data
        xor = hint in XOR_MODES
        if xor and base_plane is None:
            return None
        coder = _CODER[hint] if _native_fits(plane.size) else "zstd"
        mode = _MODES[(xor, coder)]
        payload = _code(plane ^ base_plane if xor else plane, mode, compressor)
        limit = INCOMPRESSIBLE * (XOR_GAIN if xor else 1.0)
        return (mode, payload) if len(payload) < limit * plane.size else None

    def plane_modes(self, payload: bytes) -> list[int]:
        """How each plane of a chunk was stored (RAW, or a coded mode of `_MODES`)."""
        return [mode for mode, _, _ in self._parse(payload)[1]]

    @staticmethod
    def _compress_plane(plane: np.ndarray, base_plane: np.ndarray | None,
                        compressor: zstandard.ZstdCompressor) -> tuple[int, bytes | memoryview]:
        """Store the plane in the mode whose sample codes smallest (RAW when nothing compresses).

        XOR must beat the others by XOR_GAIN, since it makes decoding the plane walk the chain;
        each coder's size counts divided by its PREFERENCE.

        Samples are taken at the same places for each mode; the XOR plane is computed in full only
        when it wins, and a sample that is the whole plane is not compressed twice.
        """
        if plane.size == 0:  # an empty tensor: nothing to code
            return RAW, plane.data
        picks = _sample_slices(plane.size)
        whole = len(picks) == 1
        samples = {False: plane if whole else np.concatenate([plane[s] for s in picks])}
        if base_plane is not None:
            samples[True] = plane ^ base_plane if whole else np.concatenate(
                [plane[s] ^ base_plane[s] for s in picks])
        best_mode, best_score, best_payload = RAW, float("inf"), None
        for xor, sample in samples.items():
            for coder, (size, payload) in _sample_sizes(sample, plane.size, compressor).items():
                fixed = min(FIXED_BYTES[coder], size)
                ratio = ((size - fixed) / max(sample.size, 1) + fixed / plane.size) / (XOR_GAIN if xor else 1.0)
                score = ratio / PREFERENCE[coder]
                if ratio < INCOMPRESSIBLE and score < best_score:
                    best_mode, best_score, best_payload = _MODES[(xor, coder)], score, payload
        if best_mode == RAW:
            return RAW, plane.data
        if best_payload is None or not whole:
            best_payload = _code(plane ^ base_plane if best_mode in XOR_MODES else plane, best_mode, compressor)
        if len(best_payload) >= plane.size:
            return RAW, plane.data
        return best_mode, best_payload

    def _parse(self, payload: bytes) -> tuple[int, list[tuple[int, int, int]]]:
        if len(payload) < _HEAD.size:
            raise CodecError(f"bytegroup: payload of {len(payload)} bytes is truncated")
        magic, width, count = _HEAD.unpack_from(payload)
        if magic != MAGIC or not width or count != width or len(payload) < _HEAD.size + count * _PLANE.size:
            raise CodecError("bytegroup: payload does not start with a valid header")
        planes, offset = [], _HEAD.size + count * _PLANE.size
        for j in range(count):
            mode, length = _PLANE.unpack_from(payload, _HEAD.size + j * _PLANE.size)
            if mode != RAW and mode not in _CODER:
                raise CodecError(f"bytegroup: plane {j} has unknown mode {mode}")
            planes.append((mode, offset, length))
            offset += length
        if offset != len(payload):
            raise CodecError(f"bytegroup: payload is {len(payload)} bytes, header says {offset}")
        return width, planes

    def declared_bytes(self, payload: bytes | memoryview, params: dict[str, Any]) -> tuple[int, int] | None:
        """The raw size `payload` says it decodes to (width x its first plane's rows), twice; None: it does not say.

        Zero and constant planes code to a few hundred bytes whatever their size, so only a payload's
        own word bounds a record's claim before a buffer that large is taken (replay.py).
        """
        try:
            width, planes = self._parse(bytes(payload))
        except CodecError:
            return None
        mode, offset, length = planes[0]
        plane = bytes(memoryview(payload)[offset : offset + length])
        if mode == RAW:
            return width * length, width * length
        if mode in RUNS_MODES or mode in HUF_MODES:  # rows: a u64 at the start of its header, or after the lengths
            at = 0 if mode in RUNS_MODES else huffman.ROWS_AT
            rows = int.from_bytes(plane[at : at + 8], "little") if len(plane) >= at + 8 else None
            return (width * rows, width * rows) if rows is not None else None
        try:
            rows = zstandard.frame_content_size(plane)
        except zstandard.ZstdError:
            return None
        return (width * rows, width * rows) if rows >= 0 else None

    def needs_base(self, payload: bytes) -> bool:
        """True when a plane is XOR-coded; read off the plane modes, every chunk's first question.

        A header that does not add up is left to `_parse` to name.
        """
        if len(payload) >= _HEAD.size:
            magic, width, count = _HEAD.unpack_from(payload)
            end = _HEAD.size + count * _PLANE.size
            if magic == MAGIC and width and count == width and len(payload) >= end:
                return not XOR_MODES.isdisjoint(payload[_HEAD.size : end : _PLANE.size])
        return any(mode in XOR_MODES for mode, _, _ in self._parse(payload)[1])

    @staticmethod
    def _plane(payload: bytes, plane: tuple[int, int, int], rows: int, j: int) -> np.ndarray:
        """One stored plane, not yet XORed: a raw plane as a view of the payload, else a new array."""
        if plane[0] == RAW:
            return ByteGroupCodec._raw_plane(payload, plane, rows, j)
        data = np.empty(rows, dtype=np.uint8)
        ByteGroupCodec._plane_into(payload, plane, rows, j, data)
        return data

    @staticmethod
    def _raw_plane(payload: bytes, plane: tuple[int, int, int], rows: int, j: int) -> np.ndarray:
        """A plane stored raw, as a read-only view of the payload."""
        _, offset, length = plane
        if length != rows:
            raise CodecError(f"bytegroup: plane {j} has {length} bytes, expected {rows}")
        return np.frombuffer(payload, np.uint8, rows, offset)

    @staticmethod
    def _native_into(payload: bytes, plane: tuple[int, int, int], j: int, dst: np.ndarray, xor: bool) -> None:
        """Decode a Huffman or zero-run plane into `dst`, or (zero runs only) XOR it into `dst`."""
        mode, offset, length = plane
        data = memoryview(payload)[offset : offset + length]
        try:
            if mode in RUNS_MODES:
                zeroruns.decode_into(data, dst, xor=xor)
            else:
                huffman.decode_into(data, dst)
        except ValueError as exc:
            raise CodecError(f"bytegroup: plane {j} does not decode: {exc}") from None

    @staticmethod
    def _plane_into(payload: bytes, plane: tuple[int, int, int], rows: int, j: int, dst: np.ndarray) -> None:
        """Write one stored plane (raw or coded, not yet XORed) into the contiguous `rows` bytes `dst`."""
        mode, offset, length = plane
        if mode == RAW:
            dst[...] = ByteGroupCodec._raw_plane(payload, plane, rows, j)
            return
        if mode in HUF_MODES or mode in RUNS_MODES:
            ByteGroupCodec._native_into(payload, plane, j, dst, xor=False)
            return
        try:
            got = _decompress_into(memoryview(payload)[offset : offset + length], dst)
        except zstandard.ZstdError as exc:
            raise CodecError(f"bytegroup: plane {j} does not decompress: {exc}") from None
        if got != rows:
            raise CodecError(f"bytegroup: plane {j} decompresses to {got} bytes or more, expected {rows}")

    def _chain_layout(self, payloads: list[bytes], nbytes: int
                      ) -> tuple[list[list[tuple[int, int, int]]], int, list[int]]:
        """A chain's layout: each payload's planes (mode, offset, length) and the rows per plane.

        Also, for each plane, the index of the newest level that stores it whole (the levels above
        it XOR into it).
        """
        parsed = [self._parse(p) for p in payloads]
        width = parsed[0][0]
        if any(w != width for w, _ in parsed) or nbytes % width:
            raise CodecError("bytegroup: chain levels disagree on the element width")
        levels = [planes for _, planes in parsed]
        wholes = []
        for j in range(width):
            whole = next((i for i, planes in enumerate(levels) if planes[j][0] not in XOR_MODES), None)
            if whole is None:
                raise CodecError("bytegroup: residual chunk decoded without its base")
            wholes.append(whole)
        return levels, nbytes // width, wholes

    def plane_levels(self, payloads: list[bytes], nbytes: int) -> list[list[np.ndarray]]:
        """For each byte plane of a chain (newest payload first), the arrays that rebuild it.

        The first array is the plane from the newest level that stores it whole; XORing the rest
        into it, in order, gives the plane. Only this entropy-decoding step needs the CPU, so a
        device can take the arrays and do the XOR and interleaving itself. Mantissa planes (stored
        raw at every level) come back as one read-only view of the payload.
        """
        levels, rows, wholes = self._chain_layout(payloads, nbytes)
        return [[self._plane(payloads[level], levels[level][j], rows, j) for level in range(whole, -1, -1)]
                for j, whole in enumerate(wholes)]

    def decode_planes(self, payloads: list[bytes], nbytes: int) -> list[np.ndarray]:
        """The byte planes of a chunk from its chain, newest payload first, each a residual of the next."""
        planes = []
        for arrays in self.plane_levels(payloads, nbytes):
            plane = arrays[0]
            for residual in arrays[1:]:
                plane = np.bitwise_xor(plane, residual, out=plane if plane.flags.writeable else None)
            planes.append(plane)
        return planes

    def decode_chain(self, payloads: list[bytes], params: dict[str, Any], nbytes: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """Decode a chunk from its chain (newest payload first) into `out`, interleaving the planes.

        Each plane is rebuilt in a reused per-thread buffer (decompressing into fresh memory costs
        a page fault per 4 KiB); a plane stored raw by the newest level is read from the payload in
        place. One interleaving pass then writes `out`. With the native coder, chains are decoded in
        one call (`_huffman.decode_chain`, the same steps in C; chains with zstd planes only where
        it found the system's libzstd, `_huffman.ZSTD`).
        """
        out = np.empty(nbytes, dtype=np.uint8) if out is None else out
        width = payloads[0][3] if len(payloads[0]) > 3 else 0
        scratch = threadlocal.scratch("chain", 0, (width + 1) * (nbytes // width) if width else 0)
        if huffman.native is not None:
            try:
                if huffman.native.decode_chain(payloads, out, scratch):
                    return out
            except ValueError as exc:
                raise CodecError(f"bytegroup: {exc}") from None
        levels, rows, wholes = self._chain_layout(payloads, nbytes)
        residual = scratch[width * rows :]
        planes = []
        for j, whole in enumerate(wholes):
            if whole == 0 and levels[0][j][0] == RAW:
                planes.append(self._raw_plane(payloads[0], levels[0][j], rows, j))
                continue
            plane = scratch[j * rows : (j + 1) * rows]
            self._plane_into(payloads[whole], levels[whole][j], rows, j, plane)
            for level in range(whole - 1, -1, -1):
                if levels[level][j][0] == XOR_RUNS:  # only its nonzero bytes are XORed in
                    self._native_into(payloads[level], levels[level][j], j, plane, xor=True)
                    continue
                self._plane_into(payloads[level], levels[level][j], rows, j, residual)
                np.bitwise_xor(plane, residual, out=plane)
            planes.append(plane)
        interleave(planes, out)
        return out

    def decode(
        self, payload: bytes, base: np.ndarray | None, params: dict[str, Any], nbytes: int
    ) -> np.ndarray:
        if not self.needs_base(payload):
            return self.decode_chain([payload], params, nbytes, base)
        if base is None or base.size != nbytes:
            raise CodecError("bytegroup: residual chunk decoded without its base")
        width, planes = self._parse(payload)
        grid = _planes(base, width)
        for j, plane in enumerate(planes):
            data = self._plane(payload, plane, nbytes // width, j)
            if plane[0] in XOR_MODES:
                grid[:, j] ^= data
            else:
                grid[:, j] = data
        return base
