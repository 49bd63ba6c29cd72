"""Named queries for `ckpt prune`: mark commits pruned, and switch a tensor to a new encoding of the same bytes."""

from __future__ import annotations

from collections.abc import Iterable

from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata.db import Tx


def listed_tensors(tx: Tx, except_commits: Iterable[CommitId] = ()) -> set[TensorId]:
    """Tensors some commit lists (commit_tensors), leaving out the commits in `except_commits`."""
    left_out = set(except_commits)
    return {TensorId(t) for c, t in tx.rows("SELECT commit_id, tensor_id FROM commit_tensors") if c not in left_out}


def all_bases(tx: Tx) -> dict[TensorId, TensorId | None]:
    """Every tensor record's base (None for a keyframe)."""
    return {TensorId(t): TensorId(b) if b else None for t, b in tx.rows("SELECT id, base_id FROM tensors")}


def all_depths(tx: Tx) -> dict[TensorId, int]:
    """Every tensor record's depth as recorded (links down to its keyframe)."""
    return {TensorId(t): d for t, d in tx.rows("SELECT id, depth FROM tensors")}


def set_depths(tx: Tx, depths: dict[TensorId, int]) -> None:
    """Record new depths of tensors whose chains a prune shortened."""
    tx.executemany("UPDATE tensors SET depth = ? WHERE id = ?", [(d, t) for t, d in sorted(depths.items())])


def mark_pruned(tx: Tx, commits: Iterable[CommitId], when: float) -> None:
    """Mark `commits` pruned: their rows and parents stay, the rows that say what data they need go."""
    ordered = sorted(set(commits), key=str)
    tx.insert_ignore("pruned_commits", ("commit_id", "pruned_at"), [(c, when) for c in ordered])
    for table in ("commit_tensors", "known_files"):
        tx.execute_in(f"DELETE FROM {table} WHERE commit_id IN ({{ids}})", ordered)


def chunk_objects(tx: Tx) -> dict[TensorId, list[tuple[ObjectId, int | None]]]:
    """Each tensor record's chunks as (object, payload length; None where the chunk is the whole object)."""
    found: dict[TensorId, list[tuple[ObjectId, int | None]]] = {}
    for tid, oid, length in tx.rows("SELECT tensor_id, object_id, length FROM tensor_chunks"):
        found.setdefault(TensorId(tid), []).append((ObjectId(oid), length))
    return found
