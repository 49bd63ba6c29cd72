"""A torch.save zip split into its container and its storages, and put back together.

The container is every byte of the file that is not a storage record some stored tensor holds
exactly: zip headers, data.pkl, version records, alignment padding, and any storage no tensor
covers (a deflated record, or one only partly viewed). It is stored as one bytes entry with the
covered records' CRC-32s zeroed (they are kept in the record instead), so checkpoints of one layout
share one container; the covered records are spliced back from their tensors at checkout (a tensor
that views its whole record in another order of dimensions, channels_last or a transpose, with its
dimensions permuted back to that order: a sixth field of its splice), and the
CRCs filled in, which gives the committed file byte for byte when the tensors are exact. When they
are not (a lossy commit) each CRC is computed from the bytes written, so the file is a valid zip
of the same layout holding the lossy values.
"""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import CkptError
from ckptstore.formats import filemap
from ckptstore.formats.atomic import write_parts
from ckptstore.formats.torchfile import ZIP_ERRORS
from ckptstore.state import RawTensor, element_unit, raw_from_bytes, reserved_path

_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_CRC = struct.Struct("<L")
CONTAINER_PATH = "%container"  # no escaped key starts with a bare "%" (escape writes "%25"), so no collision


def container_path(prefix: str) -> str:
    """The entry that holds a file's container."""
    return reserved_path(prefix, CONTAINER_PATH)


def _central_offsets(data: mmap.mmap, zf: zipfile.ZipFile) -> list[int]:
    """Where each central directory record starts, in the order of zf.infolist()."""
    offsets, at = [], zf.start_dir
    for _ in zf.infolist():
        head = _CENTRAL.unpack_from(data, at)
        if head[0] != b"PK\x01\x02":
            raise ValueError("central directory record signature")
        offsets.append(at)
        at += _CENTRAL.size + head[10] + head[11] + head[12]
    return offsets


def _record(data: mmap.mmap, info: zipfile.ZipInfo, central: int) -> tuple[int, int, int, list[int]]:
    """(start, end, CRC-32) of a stored record's bytes, and every offset in the file that holds the CRC."""
    head = _LOCAL.unpack_from(data, info.header_offset)
    if head[0] != b"PK\x03\x04":
        raise ValueError(f"local header of {info.filename}")
    start = info.header_offset + _LOCAL.size + head[-2] + head[-1]
    end = start + info.file_size
    crc = _CRC.pack(info.CRC)
    places = [p for p in (info.header_offset + 14, central + 16) if data[p : p + 4] == crc]
    if info.flag_bits & 8:  # a data descriptor after the bytes, with or without its signature
        after = end + 4 if data[end : end + 4] == b"PK\x07\x08" else end
        places += [after] if data[after : after + 4] == crc else []
    return start, end, info.CRC, places


def _match_by_content(data: mmap.mmap, records: dict[str, tuple[int, int]], tensors: dict[str, RawTensor]
                      ) -> dict[str, str]:
    """For files torch.load read: a tensor of the record's size first, then its ends, and only then all its bytes.

    A matched tensor leaves the candidates, and torch numbers records in the order the pickle
    meets their tensors, so a file of many same-sized tensors is matched in about one pass.
    """
    by_size: dict[int, list[str]] = {}
    for path, raw in tensors.items():
        if raw.nbytes:
            by_size.setdefault(raw.nbytes, []).append(path)
    covers = {}
    for name, (start, end) in sorted(records.items(), key=lambda item: item[1]):
        candidates = by_size.get(end - start, [])
        head, tail = data[start : min(end, start + 64)], data[max(start, end - 64) : end]
        for i, path in enumerate(candidates):
            raw = tensors[path].data
            if (raw[:64].tobytes() == head and raw[-len(tail):].tobytes() == tail
                    and np.array_equal(raw, np.frombuffer(data, np.uint8, end - start, start))):
                covers[name] = candidates.pop(i)
                break
    return covers


def split(path: Path, prefix: str, tensors: dict[str, RawTensor], covers: dict[str, str] | None,
          orders: dict[str, list[int]] | None = None, parts: dict[str, tuple[int, int]] | None = None
          ) -> tuple[dict[str, Any], RawTensor] | None:
    """The container record and bytes of a torch.save zip; None where the zip cannot be split.

    `covers` maps a stored record's name to a tensor path holding exactly its bytes (the
    torch-free reader knows it from the tensors' views), in the order of dimensions `orders` gives
    where the record holds them permuted; without it, records are matched to the tensors by size
    and then content. `parts` gives (offset, length) in the record of the bytes its tensor holds
    where that is only part of it (a trimmed vocab): only those are cut, and the record's CRC stays
    in the container, so the tensor is kept exact (`left_in_container`) and not stored twice.
    """
    data = filemap.open_map(path)
    if data is None:
        return None
    size = len(data)
    try:
        return _split(data, size, zipfile.ZipFile(path), prefix, tensors, covers, orders or {}, parts or {})
    except ZIP_ERRORS:
        return None


def _split(data: mmap.mmap, size: int, zf: zipfile.ZipFile, prefix: str, tensors: dict[str, RawTensor],
           covers: dict[str, str] | None, orders: dict[str, list[int]], parts: dict[str, tuple[int, int]]
           ) -> tuple[dict[str, Any], RawTensor] | None:
    with zf:
        infos = zf.infolist()
        spans = {i.filename: _record(data, i, c) for i, c in zip(infos, _central_offsets(data, zf))
                 if i.compress_type == zipfile.ZIP_STORED and i.file_size and not i.flag_bits & 1}
    if covers is None:
        storages = {n: s[:2] for n, s in spans.items() if "/data/" in n and "/" not in n.split("/data/", 1)[0]}
        covers = _match_by_content(data, storages, tensors)
    for name, (offset, length) in parts.items():
        if name in spans:  # only the tensor's bytes are cut; one past the record's end keeps it whole
            start, end, crc, places = spans[name]
            spans[name] = (start + offset, start + offset + length, crc, places) if offset + length <= end - start \
                else None
    cut = sorted((spans[name], tensor_path, name) for name, tensor_path in covers.items() if spans.get(name))
    ends, at = [], 0
    for (start, end, _, _), _, _ in cut:
        if start < at or end > size:
            return None  # overlapping or out-of-file records: the file stays whole
        ends.append(end)
        at = end
    starts = [start for (start, _, _, _), _, _ in cut]
    for (_, _, _, places), _, _ in cut:
        for place in places:  # a local header inside another record's bytes (a forged but readable zip)
            following = bisect.bisect_right(ends, place)
            if following < len(starts) and starts[following] < place + 4:
                return None  # its CRC would be cut out with that record: the file stays whole
    lengths = list(itertools.accumulate((end - start for (start, end, _, _), _, _ in cut), initial=0))

    def inside(offset: int) -> int:  # an offset of the file, in the container (no CRC lies in a cut record)
        return offset - lengths[bisect.bisect_right(ends, offset)]

    splices = [[inside(start), end - start, tensor_path, crc, [] if name in parts else [inside(p) for p in places]]
               + ([orders[name]] if name in orders else []) for (start, end, crc, places), tensor_path, name in cut]
    bounds = [0, *[x for (start, end, _, _), _, _ in cut for x in (start, end)], size]
    blob = bytearray().join(data[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2))
    for _, _, _, _, places, *_ in splices:
        for place in places:  # CRCs live in the record; zeros here keep containers of one layout identical
            blob[place : place + 4] = bytes(4)
    return {"entry": container_path(prefix), "size": size, "splices": splices}, raw_from_bytes(blob)


def left_in_container(skeleton: Any, record: dict[str, Any]) -> set[str]:
    """A torch.save zip's tensor paths whose record's bytes or CRC the container keeps as committed.

    Checkout to a file writes such a record's committed bytes (a partly viewed or deflated one), or
    its committed CRC (a splice of part of a record fills in none), while a checkout into memory reads
    the tensor's own entry: a lossy commit keeps these exact so both agree.
    """
    spliced = {splice[2] for splice in record.get("splices", []) if splice[4]}
    found, stack = set(), [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            if node[:1] == ["tensor"] and len(node) > 1 and isinstance(node[1], str) and node[1] not in spliced:
                found.add(node[1])
            stack.extend(node)
    return found


def write(dest: str | os.PathLike, record: dict[str, Any], raw_of: Callable[[str], RawTensor],
          exact: bool = False) -> None:
    """Write the file back: the container with each storage record's tensor spliced in and its CRC-32 filled in.

    `exact` says the tensors are the committed ones (a lossless commit), so the committed CRCs
    stand; otherwise each spliced record's CRC is computed from the bytes written.
    """
    container = bytearray(raw_of(record["entry"]).data)
    records = [(splice[0], _record_bytes(raw_of(splice[2]), splice[5:], splice[2])) for splice in record["splices"]]
    for (_, data), (_, nbytes, tensor_path, crc, places, *_) in zip(records, record["splices"]):
        if data.size != nbytes:
            raise CkptError(f"tensor {tensor_path} holds {data.size} bytes where the committed file's record held "
                            f"{nbytes}: the manifest does not match its tensors; run `ckpt fsck`")
        value = _CRC.pack(crc if exact else zlib.crc32(data))
        for place in places:
            container[place : place + 4] = value
    if len(container) + sum(data.size for _, data in records) != record["size"]:
        raise CkptError(f"container {record['entry']} and its tensors do not make a file of the committed "
                        f"{record['size']} bytes: the manifest does not match its tensors; run `ckpt fsck`")
    container = np.frombuffer(container, np.uint8)
    parts, at = [], 0
    for offset, data in records:
        parts += [container[at:offset], data]
        at = offset
    parts.append(container[at:])
    write_parts(dest, parts)


def _record_bytes(raw: RawTensor, order: list, tensor_path: str) -> np.ndarray:
    """A tensor's bytes as its storage record holds them: in C order, or with its dimensions permuted to `order`."""
    if not order:
        return raw.data
    order = order[0] if len(order) == 1 else None
    if not (isinstance(order, list) and all(type(d) is int for d in order)
            and sorted(order) == list(range(len(raw.shape)))):
        raise CkptError(f"the container's order of tensor {tensor_path}'s dimensions ({order}) is not one of its "
                        f"{len(raw.shape)}: the manifest is damaged; run `ckpt fsck`")
    values = np.frombuffer(raw.data, element_unit(raw.itemsize)).reshape(raw.shape)
    return np.ascontiguousarray(values.transpose(order)).reshape(-1).view(np.uint8)
