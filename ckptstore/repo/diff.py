"""`diff`: how each tensor path differs between two commits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckptstore.repo.checkout import restore
from ckptstore.repo.integrity import entry_records
from ckptstore.state import BYTES_DTYPE, RawTensor, float64_values

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


@dataclass
class TensorDiff:
    """How one path differs between two commits."""

    path: str
    status: str  # added, removed, changed, unchanged
    dtype: str
    shape: tuple[int, ...]
    relative_l2: float | None
    stored_bytes: int

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a relative L2 that is not finite (an all-zero old tensor) is the string "inf" or "nan"."""
        rel = self.relative_l2
        if rel is not None and not math.isfinite(rel):
            rel = str(rel)
        return {"path": self.path, "status": self.status, "dtype": self.dtype, "shape": list(self.shape),
                "relative_l2": rel, "stored_bytes": self.stored_bytes}


def diff(repo: Repository, a: str, b: str) -> list[TensorDiff]:
    """Per tensor path: added, removed, changed or unchanged, with the relative L2 change."""
    old, new = repo.manifest(repo.resolve(a)), repo.manifest(repo.resolve(b))
    changed = [p for p in new.entries if p in old.entries and new.entries[p].tensor != old.entries[p].tensor]
    old_raw, new_raw = restore(repo, old, paths=changed), restore(repo, new, paths=changed)
    records = entry_records(repo, new)
    result = []
    for path in sorted(set(old.entries) | set(new.entries)):
        entry = new.entries.get(path) or old.entries[path]
        stored = records[entry.tensor].stored_bytes if path in new.entries else 0
        status, rel = "unchanged", 0.0
        if path not in old.entries:
            status, rel = "added", None
        elif path not in new.entries:
            status, rel = "removed", None
        elif path in old_raw and not (old.dcp and new.dcp and _same_plain_value(path, old_raw[path], new_raw[path])):
            status, rel = "changed", relative_l2(old_raw[path], new_raw[path])
        result.append(TensorDiff(path, status, entry.dtype, entry.shape, rel, stored))
    return result


def _same_plain_value(path: str, old: RawTensor, new: RawTensor) -> bool:
    """Two non-tensor items of DCP commits stored differently (a JSON skeleton, DCP's pickle) that hold one value."""
    if old.dtype != BYTES_DTYPE or new.dtype != BYTES_DTYPE:
        return False
    from ckptstore.formats.dcpdir import same_items  # torch: only for a DCP commit's bytes items

    return same_items(path, old.data.tobytes(), new.data.tobytes())


def relative_l2(old: RawTensor, new: RawTensor) -> float | None:
    """||new - old|| / ||old|| in float64; None unless both are floating-point tensors of one shape."""
    a, b = float64_values(old), float64_values(new)
    if a is None or b is None or old.shape != new.shape:
        return None
    norm = float(np.linalg.norm(a))
    delta = float(np.linalg.norm(b - a))
    return delta / norm if norm else (0.0 if delta == 0 else float("inf"))
