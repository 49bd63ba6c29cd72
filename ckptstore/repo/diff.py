"""`diff`: how each tensor path differs between two commits."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptstore.errors import CkptError
from ckptstore.formats import BLOB
from ckptstore.formats.safetensors_file import HEADER_PATH
from ckptstore.formats.torchcontainer import CONTAINER_PATH
from ckptstore.repo.checkout import restore
from ckptstore.repo.integrity import entry_records
from ckptstore.repo.refs import split_range
from ckptstore.repo.select import CONTAINERS, LEAVES_WITH_ENTRY, aliases, item_path
from ckptstore.repo.sharded import gather, is_sharded
from ckptstore.state import (
    BYTES_DTYPE,
    RawTensor,
    element_slices,
    escape,
    float64_values,
    join,
    readable_path,
)

if TYPE_CHECKING:
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.repository import Repository


def _two_ends(spec: str) -> tuple[str, str]:
    """The two commits of `A..B`; a clear refusal of one ref alone, or of `A...B` (git's diff from the merge base)."""
    split = split_range(spec)
    if split is None:
        raise CkptError(f"diff compares two commits: give `{spec} B` or `{spec}..B`, not {spec!r} alone")
    if split[2]:
        raise CkptError(f"{spec!r}: diff does not find merge bases (git's A...B); give the two commits: "
                        f"`ckpt diff {split[0]} {split[1]}`")
    return split[0], split[1]


@dataclass
class TensorDiff:
    """How one path differs between two commits."""

    path: str
    status: str  # added, removed, changed, unchanged; UNCOMPARED: a value beside a sharded commit and one of files
    dtype: str
    shape: tuple[int, ...]
    relative_l2: float | None
    stored_bytes: int
    was: tuple[str, tuple[int, ...]] | None = None  # the older commit's dtype and shape, where they changed

    @property
    def is_structure(self) -> bool:
        """Whether this row is a file format's own bytes (a torch zip's container, a safetensors header or gap)."""
        return format_own(self.path)

    @property
    def is_value(self) -> bool:
        """Whether this row is a non-tensor value (a step, a learning rate), not a tensor."""
        return self.dtype == VALUE

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a relative L2 that is not finite (an all-zero old tensor) is the string "inf" or "nan"."""
        rel = self.relative_l2
        if rel is not None and not math.isfinite(rel):
            rel = str(rel)
        return {"path": self.path, "status": self.status, "dtype": self.dtype, "shape": list(self.shape),
                "relative_l2": rel, "stored_bytes": self.stored_bytes,
                "old_dtype": self.was[0] if self.was else None, "old_shape": list(self.was[1]) if self.was else None}


def diff(repo: Repository, a: str, b: str | None = None) -> list[TensorDiff]:
    """Per tensor path: added, removed, changed or unchanged, with the relative L2 change.

    Then each non-tensor value (a step, a scheduler's numbers, RNG lists) that differs, as dtype
    VALUE: two checkpoints of the same weights at different steps are not the same checkpoint (beside a
    sharded commit and one of files, each value is listed UNCOMPARED: see _mixed_diff).
    Without `b`, `a` is git's `A..B` (an empty side is HEAD).
    """
    if b is None:
        a, b = _two_ends(a)
    old, new = repo.manifest(repo.resolve(a)), repo.manifest(repo.resolve(b))
    if is_sharded(old) and is_sharded(new):
        return _logical_diff(repo, old, new)
    if is_sharded(old) or is_sharded(new):
        return _mixed_diff(repo, old, new)
    resplit = _same_file_containers(old, new)
    old_at, new_at = _stored_at(old), _stored_at(new)
    changed = {p for p in new_at if p in old_at and new.entries[new_at[p]].tensor != old.entries[old_at[p]].tensor
               and p not in resplit}
    old_raw = restore(repo, old, paths=sorted({old_at[p] for p in changed}))
    new_raw = restore(repo, new, paths=sorted({new_at[p] for p in changed}))
    records = entry_records(repo, new)
    result = []
    for path in sorted(old_at.keys() | new_at.keys()):
        entry = new.entries[new_at[path]] if path in new_at else old.entries[old_at[path]]
        stored = records[entry.tensor].stored_bytes if path in new.entries else 0  # a tied path's under its entry's
        status, rel, was = "unchanged", 0.0, None
        if path not in old_at:
            status, rel = "added", None
        elif path not in new_at:
            status, rel = "removed", None
        elif path in changed:
            before, after = old_raw[old_at[path]], new_raw[new_at[path]]
            if not (old.dcp and new.dcp and _same_plain_value(path, before, after)):
                status, rel = "changed", relative_l2(before, after)
            older = old.entries[old_at[path]]
            was = _was((older.dtype, tuple(older.shape)), (entry.dtype, tuple(entry.shape)))
        result.append(TensorDiff(path, status, entry.dtype, entry.shape, rel, stored, was))
    return result + _value_changes(old, new)


def _stored_at(manifest: Manifest) -> dict[str, str]:
    """Each tensor path of the commit and the entry holding its bytes: itself, or for a tied one its first path."""
    found = {path: path for path in manifest.entries}
    found.update((path, entry) for path, entry in aliases(manifest).items() if entry in manifest.entries)
    return found


def _value_changes(old: Manifest, new: Manifest) -> list[TensorDiff]:
    """The non-tensor values of the two commits' skeletons that differ, added or removed, by path."""
    before, after = skeleton_values(old), skeleton_values(new)
    rows = []
    for path in sorted(before.keys() | after.keys()):
        if before.get(path) != after.get(path):
            status = "added" if path not in before else "removed" if path not in after else "changed"
            rows.append(TensorDiff(path, status, VALUE, (), None, 0))
    return rows


def skeleton_values(manifest: Manifest) -> dict[str, str]:
    """Each skeleton leaf that is no tensor as JSON text, and each container's kind (CONTAINERS), by path."""
    found: dict[str, str] = {}
    for record in manifest.files:
        if record.skeleton is not None:
            try:
                _walk(record.skeleton, record.name, found)
            except RecursionError:  # a forged manifest's nesting (commits nest at most MAX_DEPTH): its bytes differ
                found[record.name or "/"] = f"nested past Python's stack ({id(record)})"
    return found


def _walk(node: Any, path: str, found: dict[str, str]) -> None:
    kind = node[0] if isinstance(node, list) and node and isinstance(node[0], str) else None
    if kind in LEAVES_WITH_ENTRY or kind == BLOB:  # stored as entries (a file kept as bytes too): compared as those
        return
    if kind in CONTAINERS and len(node) > 1 and isinstance(node[1], list):
        found[path or "/"] = kind  # its items are rows of their own: a key added is one row, not two
        keyed = kind in ("dict", "odict")
        for index, item in enumerate(node[1]):
            if keyed and isinstance(item, list) and len(item) == 2:
                _walk(item[1], _below(path, item[0]), found)
            else:
                _walk(item, join(path, str(index)), found)
        extras = node[2] if kind == "odict" and len(node) > 2 and isinstance(node[2], dict) else {}
        where = f"{path}/%attrs" if path else "%attrs"  # an OrderedDict's attributes: state_dict()._metadata
        for item in extras.get("attrs", []) if isinstance(extras.get("attrs"), list) else []:
            if isinstance(item, list) and len(item) == 2:
                _walk(item[1], join(where, item[0]) if isinstance(item[0], str) else _below(where, item[0]), found)
        return
    found[path or "/"] = json.dumps(node, sort_keys=True)


def _below(path: str, key: Any) -> str:
    """The path flatten gave a dict item (select.item_path); a forged key's by its JSON, marked."""
    try:
        return item_path(path, key)
    except (CkptError, TypeError, ValueError, KeyError, IndexError, RecursionError):
        part = "%json:" + escape(json.dumps(key))
        return f"{path}/{part}" if path else part


VALUE = "value"  # a TensorDiff's dtype for a non-tensor value
def format_own(path: str) -> bool:
    """Whether `path` holds a file format's own bytes (a safetensors header, a torch.save zip's records, a gap).

    Nothing a user would miss from an export, nor count as a value a diff found changed.
    """
    last = path.rpartition("/")[2]
    gap = last.removeprefix("%gap")
    return last in (HEADER_PATH, CONTAINER_PATH) or (gap != last and gap.isascii() and gap.isdigit())


UNCOMPARED = "uncompared"  # a non-tensor value's status beside a sharded commit and one of files


def _same_file_containers(old: Manifest, new: Manifest) -> set[str]:
    """The container entries of torch.save files whose bytes both commits hold alike (the same digest).

    A newer ckptstore may split the same file otherwise (a transposed tensor's record taken out of
    the container): its container entry differs while the file does not.
    """
    return {record.container["entry"] for record in new.files if record.container
            and new.digests.get(record.name) is not None and old.digests.get(record.name) == new.digests[record.name]}


def _logical_diff(repo: Repository, old: Manifest, new: Manifest) -> list[TensorDiff]:
    """Two sharded commits, per logical tensor: saved at any world sizes, the same values are unchanged."""
    before, after = _items(old), _items(new)
    changed = {fqn for fqn in before.keys() & after.keys()
               if _stored_as(old, before[fqn]) != _stored_as(new, after[fqn])}
    whole_old, whole_new = gather(repo, old, changed)[0], gather(repo, new, changed)[0]
    keys = [item["key"] for fqn in changed for item in (before[fqn], after[fqn]) if item["type"] == "bytes"]
    items_old = restore(repo, old, paths=[k for k in keys if k in old.entries])
    items_new = restore(repo, new, paths=[k for k in keys if k in new.entries])
    records = entry_records(repo, new)
    result = []
    for fqn in sorted(before.keys() | after.keys()):
        item = after.get(fqn) or before[fqn]
        stored = sum(records[new.entries[key].tensor].stored_bytes for key in _keys(item)) if fqn in after else 0
        status, rel = ("added" if fqn in after else "removed"), None
        if fqn in before and fqn in after:
            status, rel = "unchanged", 0.0
            old_value = whole_old[fqn] if fqn in whole_old else items_old.get(before[fqn].get("key", ""))
            new_value = whole_new[fqn] if fqn in whole_new else items_new.get(after[fqn].get("key", ""))
            if fqn in changed and not _same_value(fqn, old_value, new_value):
                status, rel = "changed", relative_l2(old_value, new_value)
        if item["type"] == "tensor":
            was = _was(_dtype_shape(before.get(fqn)), _dtype_shape(item)) if fqn in after else None
            result.append(TensorDiff(fqn, status, item["dtype"], tuple(item["size"]), rel, stored, was))
        elif status != "unchanged":  # a non-tensor value, listed as a file commit's are: where it differs
            result.append(TensorDiff(fqn, status, VALUE, (), None, 0))
    return result


def _was(older: tuple[str, tuple[int, ...]] | None, newer: tuple[str, tuple[int, ...]] | None
         ) -> tuple[str, tuple[int, ...]] | None:
    """The older commit's (dtype, shape) of a tensor whose dtype or shape changed; None where either has none."""
    return older if older is not None and newer is not None and older != newer else None


def _dtype_shape(item: dict[str, Any] | None) -> tuple[str, tuple[int, ...]] | None:
    """A sharded commit's item as (dtype, shape); None for none, or a non-tensor item (a step: no dtype)."""
    return None if item is None or item["type"] != "tensor" else (item["dtype"], tuple(item["size"]))


def _mixed_diff(repo: Repository, old: Manifest, new: Manifest) -> list[TensorDiff]:
    """A sharded commit and one of files, per tensor under DCP's dotted names ("model.w" for "model/w").

    Non-tensor values are listed UNCOMPARED: the file side keeps them in its skeleton, DCP as items of
    its own flattening.
    """
    sharded_new = is_sharded(new)
    sharded_side, files_side = (new, old) if sharded_new else (old, new)
    paths = {readable_path(p).replace("/", "."): p for p, e in files_side.entries.items() if e.dtype != BYTES_DTYPE}
    items = {fqn: item for fqn, item in _items(sharded_side).items() if item["type"] == "tensor"}
    both = paths.keys() & items.keys()
    gathered = gather(repo, sharded_side, both)[0]
    restored = restore(repo, files_side, paths=[paths[name] for name in both])
    records = entry_records(repo, new)
    in_new = items if sharded_new else paths
    result = []
    for name in sorted(paths.keys() | items.keys()):
        keys = (_keys(items[name]) if sharded_new else [paths[name]]) if name in in_new else []
        status, rel = ("added" if name in in_new else "removed"), None
        if name in both:
            a, b = (restored[paths[name]], gathered[name]) if sharded_new else (gathered[name], restored[paths[name]])
            same = a.dtype == b.dtype and a.shape == b.shape and a.data.tobytes() == b.data.tobytes()
            status, rel = ("unchanged", 0.0) if same else ("changed", relative_l2(a, b))
        sharded = _dtype_shape(items.get(name))
        files = (files_side.entries[paths[name]].dtype, tuple(files_side.entries[paths[name]].shape)) \
            if name in paths else None
        older, newer = (files, sharded) if sharded_new else (sharded, files)
        dtype, shape = newer or older  # a removed tensor: as the older commit had it
        stored = sum(records[new.entries[key].tensor].stored_bytes for key in keys)
        result.append(TensorDiff(name, status, dtype, shape, rel, stored, _was(older, newer)))
    values = {fqn for fqn, item in _items(sharded_side).items() if item["type"] == "bytes"}
    values |= {readable_path(path).replace("/", ".") for path, value in skeleton_values(files_side).items()
               if value not in CONTAINERS}
    return result + [TensorDiff(name, UNCOMPARED, VALUE, (), None, 0) for name in sorted(values)]


def _items(manifest: Manifest) -> dict[str, dict[str, Any]]:
    return {item["fqn"]: item for item in manifest.dcp["items"]}


def _keys(item: dict[str, Any]) -> list[str]:
    return [item["key"]] if item["type"] == "bytes" else [key for _, _, key in item["chunks"]]


def _stored_as(manifest: Manifest, item: dict[str, Any]) -> list[Any]:
    """An item's layout and stored tensors: two items stored alike hold the same values."""
    if item["type"] == "bytes":
        return ["bytes", manifest.entries[item["key"]].tensor]
    chunks = [(offsets, manifest.entries[key].tensor) for offsets, _, key in item["chunks"]]
    return [item["dtype"], item["size"], *chunks]


def _same_value(fqn: str, old: RawTensor | None, new: RawTensor | None) -> bool:
    """Whether two items of sharded commits hold one value: the same bytes, or one plain value stored two ways."""
    if old is None or new is None:
        return False
    if old.dtype == new.dtype and old.shape == new.shape and old.data.tobytes() == new.data.tobytes():
        return True
    return _same_plain_value(fqn, old, new)


def _same_plain_value(path: str, old: RawTensor, new: RawTensor) -> bool:
    """Two non-tensor items of DCP commits stored differently (a JSON skeleton, DCP's pickle) that hold one value."""
    if old.dtype != BYTES_DTYPE or new.dtype != BYTES_DTYPE:
        return False
    from ckptstore.formats.dcpdir import same_items  # torch: only for a DCP commit's bytes items

    return same_items(path, old.data.tobytes(), new.data.tobytes())


def relative_l2(old: RawTensor, new: RawTensor) -> float | None:
    """||new - old|| / ||old|| in float64, a slice at a time; None unless both are floating-point tensors of one shape.

    Float64 copies of a whole multi-GB tensor, their difference and more ran out of memory.
    """
    if old.shape != new.shape or not (_floating(old) and _floating(new)):
        return None
    halved = False
    for a, b in zip(_slices(old), _slices(new), strict=True):
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return float("nan")  # no distance between NaN or infinite values (numpy would also warn)
        with np.errstate(over="ignore"):
            halved = halved or not np.isfinite(b - a).all()  # past float64's range: the change of halves is half
    norm, delta = _RunningNorm(), _RunningNorm()
    for a, b in zip(_slices(old), _slices(new), strict=True):
        norm.add(a)
        delta.add(b / 2 - a / 2 if halved else b - a)
    if not norm.ssq:
        return 0.0 if not delta.ssq else float("inf")
    return (2.0 if halved else 1.0) * (delta.scale / norm.scale) * math.sqrt(delta.ssq / norm.ssq)


def _floating(raw: RawTensor) -> bool:
    """Whether float64_values reads the tensor's dtype, asked of its first element alone."""
    return float64_values(next(element_slices(raw, elements=1), RawTensor(raw.dtype, (0,), raw.data[:0]))) is not None


def _slices(raw: RawTensor) -> Iterator[np.ndarray]:
    """The tensor's values as float64 slices, each made as it is asked for."""
    for part in element_slices(raw):
        values = float64_values(part)
        if values is not None:
            yield values


class _RunningNorm:
    """||x|| over slices as scale * sqrt(ssq): squares past 1e154 (or below 1e-154) would overflow (or vanish)."""

    def __init__(self) -> None:
        self.scale, self.ssq = 1.0, 0.0

    def add(self, values: np.ndarray) -> None:
        largest = float(np.abs(values).max(initial=0.0))
        if not largest:  # zeros add nothing
            return
        if not self.ssq:
            self.scale = largest
        elif largest > self.scale:
            self.ssq *= (self.scale / largest) ** 2
            self.scale = largest
        scaled = values / self.scale
        self.ssq += float(np.dot(scaled, scaled))
