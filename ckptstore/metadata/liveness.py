"""Named queries for gc and fsck: what the refs reach, what commits need, and removing the rest."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata.commits import all_parents
from ckptstore.metadata.db import Tx
from ckptstore.metadata.refs import tip_commits
from ckptstore.metadata.tables import SINCE, TABLES
from ckptstore.metadata.tensors import dependents

_KEPT = "WHERE id NOT IN (SELECT commit_id FROM pruned_commits)"  # a pruned commit's manifest is gone


def reachable_commits(tx: Tx) -> set[CommitId]:
    """Commits some branch, tag or detached HEAD reaches through parents."""
    return reached_from(tx, tip_commits(tx))


def reached_from(tx: Tx, starts: Iterable[CommitId],
                 parents: Mapping[CommitId, list[CommitId]] | None = None) -> set[CommitId]:
    """`starts` and every commit they reach through parents (`all_parents`, read here unless given)."""
    return reached(starts, all_parents(tx) if parents is None else parents)


def reached(starts: Iterable[str], parents: Mapping[str, list[str]]) -> set[str]:
    """`starts` and every commit they reach through `parents` (a walk of the history in memory)."""
    stack, seen = list(starts), set()
    while stack:
        cid = stack.pop()
        if cid not in seen:
            seen.add(cid)
            stack.extend(parents.get(cid, []))
    return seen


def commit_ids(tx: Tx) -> set[CommitId]:
    return {CommitId(c) for c in tx.column("SELECT id FROM commits")}


def commit_manifests(tx: Tx) -> list[tuple[CommitId, ObjectId]]:
    """(commit, manifest object) of every commit."""
    return [(CommitId(c), ObjectId(m)) for c, m in tx.rows(f"SELECT id, manifest_object FROM commits {_KEPT}")]


def delete_commits(tx: Tx, doomed: set[CommitId]) -> None:
    """Remove commits and everything that names them (their tensors' records stay until gc)."""
    ordered = sorted(doomed, key=str)
    for table, column in (("commit_tensors", "commit_id"), ("commit_parents", "commit_id"),
                          ("known_files", "commit_id"), ("pruned_commits", "commit_id"), ("commits", "id")):
        tx.execute_in(f"DELETE FROM {table} WHERE {column} IN ({{ids}})", ordered)


def live(tx: Tx, named: Iterable[TensorId] = ()) -> tuple[set[TensorId], set[ObjectId]]:
    """Tensor ids and object ids that some commit in the database needs.

    `named` adds tensors known to be needed otherwise (those the manifests list, in case rows of
    commit_tensors were lost).
    """
    live_tensors = {TensorId(t) for t in tx.column("SELECT tensor_id FROM commit_tensors")} | set(named)
    bases = dict(tx.rows("SELECT id, base_id FROM tensors"))
    frontier = set(live_tensors)
    while frontier:
        frontier = {bases[t] for t in frontier if bases.get(t)} - live_tensors
        live_tensors |= frontier
    live_objects = {ObjectId(o) for o in tx.column(f"SELECT manifest_object FROM commits {_KEPT}")}
    for tid, oid in tx.rows("SELECT tensor_id, object_id FROM tensor_chunks"):
        if tid in live_tensors:
            live_objects.add(oid)
    return live_tensors, live_objects


def recorded_tensors(tx: Tx) -> set[TensorId]:
    return {TensorId(t) for t in tx.column("SELECT id FROM tensors")}


def referenced_tensors(tx: Tx) -> set[TensorId]:
    """Tensors some commit lists."""
    return {TensorId(t) for t in tx.column("SELECT DISTINCT tensor_id FROM commit_tensors")}


def delete_tensors(tx: Tx, doomed: set[TensorId]) -> None:
    ordered = sorted(doomed, key=str)
    tx.execute_in("DELETE FROM tensor_chunks WHERE tensor_id IN ({ids})", ordered)
    tx.execute_in("DELETE FROM unchecked_tensors WHERE tensor_id IN ({ids})", ordered)
    tx.execute_in("DELETE FROM tensors WHERE id IN ({ids})", ordered)


def forget_objects_except(tx: Tx, keep: set[ObjectId]) -> None:
    """Drop the size rows of objects not in `keep`."""
    dead = sorted(set(tx.column("SELECT id FROM objects")) - keep, key=str)
    tx.execute_in("DELETE FROM objects WHERE id IN ({ids})", dead)


def commit_tensor_lists(tx: Tx) -> dict[CommitId, set[TensorId]]:
    """The tensors each commit's rows (commit_tensors) list."""
    listed: dict[CommitId, set[TensorId]] = {}
    for cid, tid in tx.rows("SELECT commit_id, tensor_id FROM commit_tensors"):
        listed.setdefault(CommitId(cid), set()).add(TensorId(tid))
    return listed


def all_refs(tx: Tx) -> list[tuple[str, str, CommitId | None, str | None]]:
    """Every ref as (name, kind, commit it names or None, branch HEAD is on or None)."""
    return [(name, kind, CommitId(cid) if cid is not None else None, target)
            for name, kind, cid, target in tx.rows("SELECT name, kind, commit_id, target FROM refs")]


def storage_problems(tx: Tx, limit: int = 10) -> list[str]:
    """Tables of ours that are gone, and what the engine's own integrity check finds wrong with pages and indexes.

    Checkout finds rows through indexes and gc reads some from them: an index that disagrees with
    its table can hide rows from one and not the other. SQLite checks its file; a PostgreSQL
    server checks its own pages, so there only missing tables are found.
    """
    present = tx.backend.tables(tx)
    revision = tx.scalar("SELECT version_num FROM alembic_version") if "alembic_version" in present else None
    missing = [f"table {name} is missing" for name in TABLES
               if name not in present and not (name in SINCE and revision is not None and revision < SINCE[name])]
    return missing + tx.backend.storage_problems(tx, limit)


def commits_with_tensors(tx: Tx, tensor_ids: set[TensorId]) -> list[CommitId]:
    """Commits that list any of `tensor_ids` or a tensor whose chain passes through one of them."""
    needed = dependents(tx, tensor_ids)
    rows = tx.rows_in("SELECT DISTINCT commit_id FROM commit_tensors WHERE tensor_id IN ({ids})", needed)
    return sorted((CommitId(r[0]) for r in rows), key=str)
