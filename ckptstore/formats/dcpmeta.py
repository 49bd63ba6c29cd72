"""DCP's `Metadata` as plain JSON and back, so a sharded commit's manifest never holds a pickle.

The JSON (the manifest's `dcp` section, docs/format.md) keeps DCP's state_dict_metadata in order,
each tensor chunk together with the manifest path holding it (DCP's storage_data), and the
planner's data in a tagged form that tells tuples from lists. The keys and constants here are
torch-free (repo/sharded.py uses them); torch is imported by the functions that convert.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ckptstore.errors import CorruptObjectError, UnsupportedStateError
from ckptstore.state import escape

DCP_FORMAT_VERSION = 1  # of the manifest's `dcp` section; a reader refuses others

# A bytes item stored as ckptstore's JSON skeleton starts with this (a pickle starts with 0x80, a zip with "PK").
SKELETON_MAGIC = b"\x00ckpt-skeleton-v1\n"

METADATA_FILE = ".metadata"  # of a DCP directory (dcpdir.py)


def is_dcp_dir(path: str | os.PathLike) -> bool:
    """True for a folder holding DCP's `.metadata`: a checkpoint `dcp.save` wrote with its file system writer."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def shard_key(fqn: str, offsets: list[int], sizes: list[int]) -> str:
    """The manifest path of one tensor shard: the same key in the next commit is its base."""
    return f"{escape(fqn)}/%shard/{','.join(map(str, offsets))}/{','.join(map(str, sizes))}"


def bytes_key(fqn: str) -> str:
    """The manifest path of a bytes item (non-tensor state DCP serialized itself)."""
    return f"{escape(fqn)}/%bytes"


def _counts(values: Any) -> bool:
    """Whether `values` is a list of ints (16.0 compares equal to 16, but no array has 16.0 rows)."""
    return isinstance(values, list) and all(type(v) is int for v in values)


MAX_COMPARED = 1_000_000  # chunk pairs chunk_problem compares (about a second); a 64 x 64 grid of shards: 262,144


def _tiles_as_grid(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether the chunks are the cells of one grid over the tensor, each once: then they tile it exactly."""
    if not size or not boxes or not all(math.prod(sizes) for _, sizes in boxes):
        return False
    cuts = [sorted({offsets[d] for offsets, _ in boxes}) for d in range(len(size))]
    if math.prod(len(c) for c in cuts) != len(boxes) or any(c[0] != 0 for c in cuts):
        return False
    ends = [dict(zip(c, [*c[1:], whole])) for c, whole in zip(cuts, size)]  # each cut's cell ends at the next
    cells = {tuple(offsets) for offsets, _ in boxes}
    return len(cells) == len(boxes) and all(ends[d][o] == o + n for offsets, sizes in boxes
                                           for d, (o, n) in enumerate(zip(offsets, sizes)))


def chunk_problem(item: dict[str, Any]) -> str | None:
    """Why a tensor item's chunks cannot tile its size exactly (out of bounds, overlapping, leaving gaps), or None.

    A load writes each chunk at its offsets and reads nothing else: a chunk outside the tensor
    cannot be placed, and a gap would come back as whatever the reader's buffer held.
    """
    size = item["size"]
    if not _counts(size):
        return f"its size {size!r} is not a list of counts"
    boxes = []
    for offsets, sizes, _ in item["chunks"]:
        if not (_counts(offsets) and _counts(sizes)):
            return f"a chunk's offsets {offsets!r} or sizes {sizes!r} are not lists of counts"
        if len(offsets) != len(size) or len(sizes) != len(size):
            return f"a chunk at {offsets} of sizes {sizes} has another rank than the tensor's {size}"
        if any(o < 0 or n < 0 or o + n > whole for o, n, whole in zip(offsets, sizes, size)):
            return f"the chunk at {offsets} of sizes {sizes} lies outside the tensor's {size}"
        boxes.append((offsets, sizes))
    if _tiles_as_grid(size, boxes):  # every mesh of shards (FSDP x TP x EP): checked in one pass
        return None
    volume, covered = math.prod(size), sum(math.prod(sizes) for _, sizes in boxes)
    # a sweep along the dimension the chunks split most: each chunk is compared only with those it
    # could overlap there (a few, for shards along any one dimension), not with every other chunk
    axis = max(range(len(size)), key=lambda d: len({o[d] for o, _ in boxes}), default=None)
    boxes.sort(key=lambda box: box[0][axis] if axis is not None else 0)
    open_boxes: list[tuple[list[int], list[int]]] = []
    compared = 0
    for offsets, sizes in boxes:
        if not math.prod(sizes):
            continue
        open_boxes = [(o, n) for o, n in open_boxes if axis is None or o[axis] + n[axis] > offsets[axis]]
        compared += len(open_boxes)
        if compared > MAX_COMPARED:  # chunks laid out as no save writes them (a staircase): quadratic, refused
            return (f"its {len(boxes)} chunks are too many to check in this layout (over {MAX_COMPARED:,} "
                    "comparisons; a grid of shards is checked at once)")
        for other, other_sizes in open_boxes:
            if all(o < p + m and p < o + n for o, n, p, m in zip(offsets, sizes, other, other_sizes)):
                return f"the chunks at {other} and {offsets} overlap"
        open_boxes.append((offsets, sizes))
    return None if covered == volume else f"its chunks cover {covered} of its {volume} elements"


def to_json(metadata: Any) -> dict[str, Any]:
    """The JSON form of DCP's `metadata`; its storage_data is rebuilt from the items on load, not stored."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def named(value: Any, kind: type, what: str, fqn: str) -> str:
        # a damaged or foreign .metadata that dcp.load shrugs off must not become a commit checkout refuses
        if not isinstance(value, kind):
            raise TypeError(f"{fqn}: its {what} is {value!r}, not a {kind.__module__}.{kind.__name__}")
        return str(value)

    items = []
    for fqn, stored in metadata.state_dict_metadata.items():
        if isinstance(stored, BytesStorageMetadata):
            items.append({"fqn": fqn, "type": "bytes", "key": bytes_key(fqn)})
            continue
        props = stored.properties
        items.append({
            "fqn": fqn, "type": "tensor", "dtype": named(props.dtype, torch.dtype, "dtype", fqn),
            "size": list(stored.size), "layout": named(props.layout, torch.layout, "layout", fqn),
            "requires_grad": bool(props.requires_grad),
            "memory_format": named(props.memory_format, torch.memory_format, "memory format", fqn),
            "pin_memory": bool(props.pin_memory),
            "chunks": [[list(c.offsets), list(c.sizes), shard_key(fqn, list(c.offsets), list(c.sizes))]
                       for c in stored.chunks],
        })
    meta = metadata.storage_meta
    return {"version": DCP_FORMAT_VERSION, "dcp_version": metadata.version, "items": items,
            "planner_data": _tagged(metadata.planner_data, "planner_data"),
            "storage_meta": None if meta is None else {
                "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)}}


def from_json(data: dict[str, Any], manifest_oid: str) -> Any:
    """The `Metadata` that `to_json` described; storage_data maps each item's index to its manifest path.

    The caller has checked the section's version (repo/sharded.py's check_format).
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    try:
        state: dict[str, Any] = {}
        storage: dict[Any, str] = {}
        for item in data["items"]:
            fqn = item["fqn"]
            if item["type"] == "bytes":
                state[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = item["key"]
                continue
            props = TensorProperties(dtype=_torch_attr(item["dtype"], torch.dtype),
                                     layout=_torch_attr(item["layout"], torch.layout),
                                     requires_grad=bool(item["requires_grad"]),
                                     memory_format=_torch_attr(item["memory_format"], torch.memory_format),
                                     pin_memory=bool(item["pin_memory"]))
            chunks = []
            for offsets, sizes, key in item["chunks"]:
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                storage[MetadataIndex(fqn, offsets)] = key
            state[fqn] = TensorStorageMetadata(props, torch.Size(item["size"]), chunks)
        meta = data["storage_meta"]
        return Metadata(state, _untagged(data["planner_data"]), storage,
                        None if meta is None else StorageMeta(**meta), data["dcp_version"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(manifest_oid, f"a manifest whose DCP metadata is missing or mangling a field "
                                               f"({exc!r})") from None


def _torch_attr(name: str, kind: type) -> Any:
    """`torch.float32` -> torch.float32, only for attributes of the expected kind."""
    import torch

    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise ValueError(f"{name!r} is not a {kind.__name__} this torch {torch.__version__} knows")
    return value


def _tagged(value: Any, where: str) -> Any:
    """JSON that keeps tuples, lists and dict keys apart: scalars as themselves, containers tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return ["tuple", [_tagged(v, where) for v in value]]
    if isinstance(value, list):
        return ["list", [_tagged(v, where) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[_tagged(k, where), _tagged(v, where)] for k, v in value.items()]]
    raise UnsupportedStateError(f"DCP {where} holds a {type(value).__name__}; ckptstore stores DCP metadata as "
                                "JSON (never pickle): use a planner whose planner_data is plain data")


def _untagged(value: Any) -> Any:
    """The value `_tagged` wrote."""
    if not isinstance(value, list):
        return value
    tag, items = value
    if tag == "tuple":
        return tuple(_untagged(v) for v in items)
    if tag == "list":
        return [_untagged(v) for v in items]
    if tag == "dict":
        return {_untagged(k): _untagged(v) for k, v in items}
    raise ValueError(f"unknown tag {tag!r} in planner_data")
