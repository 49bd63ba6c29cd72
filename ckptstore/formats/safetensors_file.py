"""safetensors files, parsed directly so that checkout writes back the very same bytes.

The 8-byte length and JSON header are kept verbatim as a blob; every tensor (and any gap between
tensors' data) becomes an entry, in file order.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import CheckpointFormatError
from ckptstore.formats.atomic import write_parts
from ckptstore.state import BYTES_DTYPE, RawTensor, join, raw_from_bytes

DTYPES = {
    "F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16",
    "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
    "U64": "torch.uint64", "U32": "torch.uint32", "U16": "torch.uint16", "U8": "torch.uint8",
    "BOOL": "torch.bool", "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
    "C64": "torch.complex64",
}
HEADER_PATH = "%header"
MAX_HEADER = 100 << 20


def looks_like_safetensors(path: str | os.PathLike) -> bool:
    """An 8-byte little-endian header length followed by a JSON object."""
    with open(path, "rb") as handle:
        head = handle.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return struct.unpack("<Q", head[:8])[0] <= min(MAX_HEADER, os.path.getsize(path) - 8)


def read(path: str | os.PathLike, prefix: str) -> tuple[Any, dict[str, RawTensor]]:
    """Split a safetensors file into its verbatim header and its tensors, in data order."""
    path = Path(path)
    size = path.stat().st_size
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.empty(0, dtype=np.uint8)
    if size < 8:
        raise CheckpointFormatError(f"{path} is too short to be a safetensors file")
    header_len = struct.unpack("<Q", data[:8].tobytes())[0]
    start = 8 + header_len
    if start > size:
        raise CheckpointFormatError(f"{path}: header claims {header_len} bytes, file has {size}: truncated")
    try:
        header = json.loads(data[8:start].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: safetensors header is not valid JSON: {exc}") from None
    tensors = {join(prefix, HEADER_PATH): raw_from_bytes(np.array(data[:start]))}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            spans.append((begin, end, name, info["dtype"], tuple(int(d) for d in info["shape"])))
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: malformed header entry for {name!r}") from None
    spans.sort()
    order, cursor = [], 0
    for begin, end, name, dtype, shape in spans:
        if begin < cursor or start + end > size:
            raise CheckpointFormatError(f"{path}: tensor {name!r} lies outside the file: truncated?")
        if begin > cursor:
            order.append(_gap(tensors, prefix, data[start + cursor : start + begin], len(order)))
        entry = join(prefix, name)
        tensors[entry] = RawTensor(DTYPES.get(dtype, BYTES_DTYPE), shape, data[start + begin : start + end])
        if tensors[entry].dtype == BYTES_DTYPE:
            tensors[entry].shape = (end - begin,)
        order.append([name, entry])
        cursor = end
    if start + cursor < size:
        order.append(_gap(tensors, prefix, data[start + cursor :], len(order)))
    return ["safetensors", join(prefix, HEADER_PATH), order], tensors


def _gap(tensors: dict[str, RawTensor], prefix: str, span: np.ndarray, index: int) -> list:
    path = join(prefix, f"%gap{index}")
    tensors[path] = raw_from_bytes(span)
    return [None, path]


def write(path: str | os.PathLike, skeleton: Any, raw_of) -> None:
    """Write the file back byte for byte; `raw_of(path)` returns each entry's RawTensor."""
    _, header_path, order = skeleton
    write_parts(path, (raw_of(entry).data for entry in [header_path, *(e for _, e in order)]))


def as_state(skeleton: Any, value_of) -> dict[str, Any]:
    """The tensors by name, as safetensors.torch.load_file returns them."""
    return {name: value_of(entry) for name, entry in skeleton[2] if name is not None}
