"""safetensors files, parsed directly so that checkout writes back the very same bytes.

The 8-byte length and JSON header are kept verbatim as a blob; every tensor (and any gap between
tensors' data) becomes an entry, in file order.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import CheckpointFormatError, MalformedSkeletonError, UnsupportedStateError, listing
from ckptstore.formats import filemap
from ckptstore.formats.atomic import write_parts
from ckptstore.state import (
    BYTES_DTYPE,
    INT64_END,
    TORCH_ITEMSIZE,
    RawTensor,
    is_utf8,
    join,
    raw_from_bytes,
    reserved_path,
)

DTYPES = {
    "F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16",
    "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
    "U64": "torch.uint64", "U32": "torch.uint32", "U16": "torch.uint16", "U8": "torch.uint8",
    "BOOL": "torch.bool", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
    "F8_E4M3FNUZ": "torch.float8_e4m3fnuz", "F8_E5M2FNUZ": "torch.float8_e5m2fnuz", "F8_E8M0": "torch.float8_e8m0fnu",
    "C64": "torch.complex64", "F4": "torch.float4_e2m1fn_x2",
}
# safetensors counts F4's 4-bit values; torch's float4_e2m1fn_x2 holds two in each element: its last dimension is half
PACKED = {"F4": 2}
BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}  # sub-byte codes a tensor kept as its bytes may have: their size checked
# unescaped (state.reserved_path), so no tensor name can take it; before 3 December 2026 it was escaped
# ("%25header", which a tensor named "%header" took), and older skeletons still name their own entries
HEADER_PATH = "%header"
MAX_HEADER = 100 << 20
HEADER_PEEK = 4096  # header bytes read to find its "{" past any leading whitespace


def header_start(head: bytes) -> bytes:
    """The first byte of a safetensors header past any JSON whitespace (b"" if none is read yet): b"{" in one.

    The safetensors library reads a header padded with leading spaces, so it is one; `head` holds the 8-byte
    length and up to HEADER_PEEK bytes of the header.
    """
    return head[8:8 + int.from_bytes(head[:8], "little")].lstrip(b" \t\r\n")[:1]


def looks_like_safetensors(path: str | os.PathLike) -> bool:
    """An 8-byte little-endian header length followed by a JSON object."""
    with open(path, "rb") as handle:
        head = handle.read(8 + HEADER_PEEK)
    if header_start(head) != b"{":
        return False
    return struct.unpack("<Q", head[:8])[0] <= min(MAX_HEADER, os.path.getsize(path) - 8)


def read(path: str | os.PathLike, prefix: str) -> tuple[Any, dict[str, RawTensor]]:
    """Split a safetensors file into its verbatim header and its tensors, in data order.

    Every entry is checked against the file before any byte is used: offsets in order and inside
    the data, no two tensors sharing bytes, and a shape that fills exactly its bytes.
    """
    path = Path(path)
    size = path.stat().st_size
    data = filemap.array(path)
    header, start = _header(path, data, size)
    tensors = {reserved_path(prefix, HEADER_PATH): raw_from_bytes(np.array(data[:start]))}
    spans = sorted(_span(path, name, info, size - start) for name, info in header.items() if name != "__metadata__")
    order, cursor, last = [], 0, None
    for begin, end, name, dtype, shape in spans:
        if begin < cursor:
            raise CheckpointFormatError(f"{path}: tensors {last!r} and {name!r} overlap in the file's data")
        if begin > cursor:
            order.append(_gap(tensors, prefix, data[start + cursor : start + begin], len(order)))
        entry = join(prefix, name)
        kind = DTYPES.get(dtype, BYTES_DTYPE) if shape is not None else BYTES_DTYPE  # as are dtypes torch lacks
        tensors[entry] = RawTensor(kind, shape if kind != BYTES_DTYPE else (end - begin,),
                                   data[start + begin : start + end])
        order.append([name, entry])
        cursor, last = end, name
    if start + cursor < size:
        order.append(_gap(tensors, prefix, data[start + cursor :], len(order)))
    return ["safetensors", reserved_path(prefix, HEADER_PATH), order], tensors


def _header(path: Path, data: np.ndarray, size: int) -> tuple[dict, int]:
    """The parsed JSON header and where the data begins."""
    if size < 8:
        raise CheckpointFormatError(f"{path} is too short to be a safetensors file")
    header_len = struct.unpack("<Q", data[:8].tobytes())[0]
    if header_len > MAX_HEADER:
        raise CheckpointFormatError(f"{path}: header claims {header_len} bytes, more than the "
                                    f"{MAX_HEADER >> 20} MiB safetensors allows: not a safetensors file?")
    start = 8 + header_len
    if start > size:
        raise CheckpointFormatError(f"{path}: header claims {header_len} bytes, file has {size}: truncated")
    try:
        header = json.loads(data[8:start].tobytes(), object_pairs_hook=_unique)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: safetensors header is not a JSON object")
    return header, start


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    counts = collections.Counter(key for key, _ in pairs)
    if len(counts) != len(pairs):  # json keeps the last silently; which tensor is meant is unknowable
        repeated = sorted(k for k, n in counts.items() if n > 1)  # counted once each: keys.count was quadratic
        raise ValueError(f"the names {listing([repr(k) for k in repeated], 5)} each appear more than once")
    return dict(pairs)


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value < INT64_END


def _span(path: Path, name: str, info: Any, data_size: int) -> tuple[int, int, str, str, tuple[int, ...] | None]:
    """(begin, end, name, dtype, torch shape) of one header entry, checked against the data's size (None: no shape)."""
    try:
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError):
        raise CheckpointFormatError(f"{path}: malformed header entry for {name!r}") from None
    if (type(dtype) is not str or type(shape) is not list or not all(map(_is_count, shape))
            or not _is_count(math.prod(shape))
            or type(offsets) is not list or len(offsets) != 2 or not all(map(_is_count, offsets))):
        raise CheckpointFormatError(f"{path}: malformed header entry for {name!r}: dtype, shape or data_offsets "
                                    "is not what safetensors writes")
    begin, end = offsets
    if begin > end:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has reversed data_offsets [{begin}, {end}]")
    if end > data_size:
        raise CheckpointFormatError(f"{path}: tensor {name!r} ends at byte {end} of the data, which has "
                                    f"{data_size}: truncated?")
    if dtype not in DTYPES:
        return begin, end, name, dtype, tuple(shape)
    per = PACKED.get(dtype, 1)  # values a torch element holds
    needed = math.prod(shape) * TORCH_ITEMSIZE[DTYPES[dtype]]  # bytes, times the values a byte packs
    if needed != per * (end - begin):
        whole, part = divmod(needed, per)
        raise CheckpointFormatError(f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs "
                                    f"{whole}{'.5' if part else ''} bytes, its data_offsets give {end - begin}")
    if per == 1:
        return begin, end, name, dtype, tuple(shape)
    if not shape or shape[-1] % per:  # no torch shape holds it: kept as its bytes
        return begin, end, name, dtype, None
    return begin, end, name, dtype, (*shape[:-1], shape[-1] // per)


def _gap(tensors: dict[str, RawTensor], prefix: str, span: np.ndarray, index: int) -> list:
    path = reserved_path(prefix, f"%gap{index}")
    tensors[path] = raw_from_bytes(span)
    return [None, path]


def write(path: str | os.PathLike, skeleton: Any, raw_of) -> None:
    """Write the file back byte for byte; `raw_of(path)` returns each entry's RawTensor."""
    _, header_path, order = skeleton
    check_header(skeleton, raw_of(header_path).data.tobytes(), raw_of)  # a forged manifest's file is not written
    write_parts(path, (raw_of(entry).data for entry in [header_path, *(e for _, e in order)]))


def check_header(skeleton: Any, header: bytes, entry_of: Callable[[str], Any]) -> None:
    """MalformedSkeletonError unless the stored `header` describes exactly the entries `skeleton` writes after it.

    `entry_of(path)` gives an entry's dtype and shape. A forged manifest could pair a header with other
    entries: the file written would name offsets past its data or tensors sharing bytes, or checkout's
    state would give one tensor's values under another's name. The header is read as `read` reads a file.
    """
    _, _, order = skeleton
    written = [(name, entry_of(entry)) for name, entry in order]
    sizes = [_entry_bytes(entry) for _, entry in written]
    label = Path("the stored header")
    try:
        parsed, start = _header(label, np.frombuffer(header, dtype=np.uint8), len(header) + sum(sizes))
        if start != len(header):
            raise CheckpointFormatError(f"{label} holds {len(header)} bytes where its length says {start}")
        spans = sorted(_span(label, name, info, sum(sizes)) for name, info in parsed.items() if name != "__metadata__")
    except CheckpointFormatError as exc:
        raise MalformedSkeletonError(str(exc)) from None
    described, cursor = [], 0
    for begin, end, name, dtype, shape in spans:
        if begin < cursor:
            raise MalformedSkeletonError(f"its header has tensor {name!r:.60} overlap the one before it")
        if begin > cursor:
            described.append((None, BYTES_DTYPE, (begin - cursor,)))
        kind = DTYPES.get(dtype, BYTES_DTYPE) if shape is not None else BYTES_DTYPE
        described.append((name, kind, shape if kind != BYTES_DTYPE else (end - begin,)))
        cursor = end
    if cursor < sum(sizes):
        described.append((None, BYTES_DTYPE, (sum(sizes) - cursor,)))
    stored = [(name, entry.dtype, tuple(entry.shape)) for name, entry in written]
    if described != stored:
        first = next((i for i, (a, b) in enumerate(zip(described, stored)) if a != b), min(len(described), len(stored)))
        raise MalformedSkeletonError(f"its header describes {described[first] if first < len(described) else 'no'} "
                                     f"part {first} of the data, its skeleton writes "
                                     f"{stored[first] if first < len(stored) else 'none'} there")


def _entry_bytes(entry: Any) -> int:
    """The bytes a safetensors entry writes: a torch dtype's elements, or its bytes."""
    itemsize = 1 if entry.dtype == BYTES_DTYPE else TORCH_ITEMSIZE.get(entry.dtype)
    if itemsize is None:
        raise MalformedSkeletonError(f"a safetensors entry of dtype {entry.dtype!r:.40}, which no header names")
    return itemsize * math.prod(entry.shape)


def header_dtypes(header: RawTensor) -> dict[str, tuple[str, list[int]]]:
    """Each entry's safetensors dtype and shape in a committed header (damaged: none).

    A dtype torch lacks (F6_E2M3) is kept as its bytes, and written anew under them (`write_tensors`).
    """
    found = _header_json(header)
    return {name: (entry["dtype"], list(entry["shape"])) for name, entry in found.items()
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)}


def header_metadata(header: RawTensor) -> dict[str, str] | None:
    """The `__metadata__` of a committed header (its verbatim bytes), for a file written anew from part of it."""
    found = _header_json(header).get("__metadata__")
    return found if isinstance(found, dict) and all(isinstance(v, str) for v in found.values()) else None


def _header_json(header: RawTensor) -> dict[str, Any]:
    """A committed header's JSON object; {} where it is damaged (checked at commit: it loses only what it held)."""
    data = np.asarray(header.data).tobytes()
    try:
        found = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    except (struct.error, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def as_state(skeleton: Any, value_of) -> dict[str, Any]:
    """The tensors by name, as safetensors.torch.load_file returns them."""
    return {name: value_of(entry) for name, entry in skeleton[2] if name is not None}


SAFETENSORS_DTYPES = {name: code for code, name in DTYPES.items()}  # torch dtype name -> safetensors code


def _refuse_misfit(name: str, code: Any, shape: Any, nbytes: int) -> None:
    """Refuse a committed header's dtype and shape for a tensor kept as bytes unless they fit its `nbytes`.

    Only a damaged header (or one a remote forged) gets here: the file written would be one safetensors refuses.
    """
    bits = BITS.get(code) if isinstance(code, str) else None
    if bits is None and isinstance(code, str) and code in DTYPES:
        bits = 8 * TORCH_ITEMSIZE[DTYPES[code]] // PACKED.get(code, 1)
    whole = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    if bits is None or not whole or -(-math.prod(shape) * bits // 8) != nbytes:
        raise CheckpointFormatError(f"{name}: the committed header's dtype {code!r:.40} and shape {shape!r:.80} do "
                                    f"not describe its {nbytes} stored bytes (a dtype this ckptstore does not know, "
                                    "or a damaged header): check the whole file out instead")


def write_tensors(path: str | os.PathLike, tensors: dict[str, RawTensor], metadata: dict[str, str] | None = None,
                  as_committed: Mapping[str, tuple[str, list[int]]] | None = None) -> None:
    """Write `tensors` (torch dtypes) as a new safetensors file, atomically; names in the given order.

    `metadata` becomes the header's `__metadata__` (string to string, as safetensors requires); a tensor
    kept as its bytes (a dtype torch lacks) is written under its dtype and shape in `as_committed`.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, raw in tensors.items():
        if name == "__metadata__":
            raise UnsupportedStateError("a tensor named '__metadata__' cannot be a safetensors entry (the name is "
                                        "the format's own); export with --format torch")
        if not is_utf8(name):  # a lone surrogate: json writes it, the safetensors library refuses the whole file
            raise UnsupportedStateError(f"{name.encode('utf-8', 'backslashreplace').decode()}: the name is no valid "
                                        "text, which a safetensors header must be; export with --format torch")
        if raw.dtype == BYTES_DTYPE and name in (as_committed or {}):
            code, shape = as_committed[name]
            _refuse_misfit(name, code, shape, raw.nbytes)
            header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + raw.nbytes]}
            offset += raw.nbytes
            continue
        code = SAFETENSORS_DTYPES.get(raw.dtype)
        if code is None:
            raise UnsupportedStateError(f"{name}: safetensors has no type for {raw.dtype}; export with --format torch")
        shape = list(raw.shape)
        if code in PACKED:
            if not shape:
                raise UnsupportedStateError(f"{name}: safetensors has no shape for a 0-d {raw.dtype}; export with "
                                            "--format torch")
            shape[-1] *= PACKED[code]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads it
    write_parts(path, [len(text).to_bytes(8, "little"), text, *(raw.data for raw in tensors.values())])
