"""Copying commit and tensor records between two repositories' databases (push, fetch, clone).

Rows are copied as they are: every table's key is a content id, so a row the other side has
already is the same row, and inserting is `ON CONFLICT DO NOTHING`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.metadata.commits import all_parents
from ckptstore.metadata.db import Tx
from ckptstore.records import TensorRecord

# (table, the column its rows are selected by), in an order that inserts parents before children
COMMIT_TABLES = (("commits", "id"), ("commit_parents", "commit_id"), ("commit_tensors", "commit_id"),
                 ("pruned_commits", "commit_id"))  # a pruned commit travels as one: its row, no manifest
TENSOR_TABLES = (("tensors", "id"), ("tensor_chunks", "tensor_id"))


@dataclass
class RecordSet:
    """Rows of some commits and tensors, and the objects they name."""

    rows: dict[str, tuple[list[str], list[tuple]]] = field(default_factory=dict)
    objects: dict[ObjectId, int] = field(default_factory=dict)  # id -> stored size (0 where unknown)
    manifests: set[ObjectId] = field(default_factory=set)  # those of `objects` that are the commits' manifests

    def column(self, table: str, name: str) -> set[str]:
        """Every value of column `name` in the rows of `table`."""
        columns, rows = self.rows[table]
        at = columns.index(name)
        return {row[at] for row in rows}

    def projected(self, table: str, names: tuple[str, ...]) -> list[tuple]:
        """The rows of `table` with columns `names`, in that order."""
        columns, rows = self.rows[table]
        at = [columns.index(name) for name in names]
        return [tuple(row[i] for i in at) for row in rows]

    def tensor_records(self, problems: dict[TensorId, str]) -> dict[TensorId, TensorRecord]:
        """The tensor records these rows make, read as a database's are; damaged ones go to `problems`."""
        chunks = sorted(self.projected("tensor_chunks", tensor_rows.CHUNK_COLUMNS),
                        key=lambda row: (str(row[0]), row[1] if type(row[1]) is int else -1))  # a damaged one: text
        return tensor_rows.parse_records(self.projected("tensors", tensor_rows.RECORD_COLUMNS), chunks, problems)


def present_commits(tx: Tx, cids: Iterable[CommitId]) -> set[CommitId]:
    """Those of `cids` this database records."""
    return {CommitId(r[0]) for r in tx.rows_in("SELECT id FROM commits WHERE id IN ({ids})", cids)}


def pruned(tx: Tx, cids: Iterable[CommitId]) -> set[CommitId]:
    """Those of `cids` this database records as pruned (their row kept, their data gone)."""
    return {CommitId(r[0]) for r in tx.rows_in("SELECT commit_id FROM pruned_commits WHERE commit_id IN ({ids})",
                                               cids)}


def unprune(tx: Tx, cids: Iterable[CommitId]) -> None:
    """Clear the pruned mark of `cids`: their data came back whole."""
    tx.execute_in("DELETE FROM pruned_commits WHERE commit_id IN ({ids})", sorted(cids))


def present_tensors(tx: Tx, tids: Iterable[TensorId]) -> set[TensorId]:
    """Those of `tids` this database records."""
    return {TensorId(r[0]) for r in tx.rows_in("SELECT id FROM tensors WHERE id IN ({ids})", tids)}


def chunk_objects(tx: Tx, tids: Iterable[TensorId]) -> dict[TensorId, frozenset[str]]:
    """The objects each of `tids` is recorded in (its chunks')."""
    found: dict[TensorId, set[str]] = {}
    for tid, oid in tx.rows_in("SELECT tensor_id, object_id FROM tensor_chunks WHERE tensor_id IN ({ids})", tids):
        found.setdefault(TensorId(tid), set()).add(str(oid))
    return {tid: frozenset(oids) for tid, oids in found.items()}


def ancestors(tx: Tx, tips: Iterable[CommitId], stop: set[CommitId] = frozenset()) -> list[CommitId]:
    """Commits reachable from `tips` through parents, not walking past those in `stop`; oldest first."""
    parents = all_parents(tx)
    order: list[CommitId] = []
    seen: set[CommitId] = set()
    stack = [c for c in tips if c not in stop]
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen.add(cid)
        order.append(cid)
        stack += [p for p in parents.get(cid, []) if p not in stop and p not in seen]
    return order[::-1]


def tensors_of(tx: Tx, cids: Iterable[CommitId],
               present: Callable[[set[TensorId]], set[TensorId]] = lambda tids: set()) -> set[TensorId]:
    """The tensors the commits name, with every base down their delta chains.

    Not those `present` says the other side has, nor their bases: where its retention re-encoded a
    base as a keyframe, the links below it were sent again for nothing.
    """
    named = {TensorId(r[0]) for r in tx.rows_in("SELECT tensor_id FROM commit_tensors WHERE commit_id IN ({ids})",
                                                cids)}
    found = named - present(named)
    frontier = set(found)
    while frontier:
        bases = {TensorId(r[0]) for r in tx.rows_in("SELECT base_id FROM tensors WHERE id IN ({ids}) AND base_id "
                                                    "IS NOT NULL", frontier)} - found
        frontier = bases - present(bases)
        found |= frontier
    return found


def bases_below(tx: Tx, tids: Iterable[TensorId]) -> dict[TensorId, TensorId]:
    """Each tensor down the delta chains of `tids` (them included) -> its base, as `tx`'s side records them."""
    base_of: dict[TensorId, TensorId] = {}
    frontier = set(tids)
    while frontier:
        rows = {TensorId(t): TensorId(b) for t, b in tx.rows_in("SELECT id, base_id FROM tensors WHERE id IN ({ids}) "
                                                                 "AND base_id IS NOT NULL", frontier)}
        base_of.update(rows)
        frontier = set(rows.values()) - base_of.keys()
    return base_of


def _select(tx: Tx, table: str, column: str, ids: list[str]) -> tuple[list[str], list[tuple]]:
    """Every column of the rows of `table` whose `column` is in `ids` (the schema both sides share names them)."""
    from ckptstore.metadata import schema

    columns = [c.name for c in schema.metadata.tables[table].columns]
    names = ", ".join(f'"{c}"' for c in columns)
    return columns, tx.rows_in(f'SELECT {names} FROM {table} WHERE "{column}" IN ({{ids}})', ids)


def records(tx: Tx, cids: list[CommitId], tids: set[TensorId]) -> RecordSet:
    """The rows of commits `cids` and tensors `tids`, and the objects they need (manifests and chunks)."""
    found = RecordSet()
    for table, column in COMMIT_TABLES:
        found.rows[table] = _select(tx, table, column, list(cids))
    for table, column in TENSOR_TABLES:
        found.rows[table] = _select(tx, table, column, sorted(tids))
    pruned = found.column("pruned_commits", "commit_id")
    columns, rows = found.rows["commits"]
    found.manifests = {ObjectId(row[columns.index("manifest_object")]) for row in rows
                       if row[columns.index("id")] not in pruned}
    needed = found.manifests | {ObjectId(o) for o in found.column("tensor_chunks", "object_id")}
    sizes = dict(tx.rows_in("SELECT id, size FROM objects WHERE id IN ({ids})", sorted(needed)))
    found.objects = {oid: int(sizes.get(oid, 0)) for oid in needed}
    return found


def outside_work_tree(found: RecordSet) -> list[str]:
    """The commits in `found` made of files outside their work tree (an absolute source path)."""
    columns, rows = found.rows["commits"]
    where, cid = columns.index("source_path"), columns.index("id")
    return [row[cid] for row in rows if isinstance(row[where], str) and row[where].startswith("/")]


def insert(tx: Tx, found: RecordSet) -> None:
    """Insert every row of `found` that this database lacks, and the objects' size rows.

    Each tensor's depth is made this database's (`_depths_here`) before it goes in.
    """
    _depths_here(tx, found)
    for table, (columns, rows) in found.rows.items():
        if rows:
            tx.insert_ignore(table, columns, rows)
    sized = [(oid, size) for oid, size in found.objects.items() if size]
    if sized:
        tx.insert_ignore("objects", ("id", "size"), sized)


def _depths_here(tx: Tx, found: RecordSet) -> None:
    """Set each tensor row's depth to the length of its delta chain in this database.

    The sender's depth counts its own chain: where its retention re-encoded a base as a keyframe that
    is still a residual here, the copied depth was short, and this side's chains then grew past
    max_chain with every push, unseen. A base this database has already ends the walk at its depth.
    """
    columns, rows = found.rows["tensors"]
    if not rows:
        return
    at_id, at_base, at_depth = columns.index("id"), columns.index("base_id"), columns.index("depth")
    received = {row[at_id]: row for row in rows}
    outside = sorted({row[at_base] for row in rows if row[at_base] and row[at_base] not in received})
    depth: dict[str, int] = {tid: int(d) for tid, d in tx.rows_in("SELECT id, depth FROM tensors WHERE id IN ({ids})",
                                                                    outside)}
    for tid in received:
        chain: list[str] = []  # links above `tid` whose depth waits for its
        walked: set[str] = set()
        while tid not in depth:
            row = received.get(tid)
            base = row[at_base] if row is not None else None
            if row is None or base is None or base == tid or base in walked:
                # a keyframe; a base recorded on neither side, or a forged loop: the sender's word for it
                depth[tid] = _depth_said(row[at_depth]) if row is not None and base is not None else 0
                break
            chain.append(tid)
            walked.add(tid)
            tid = base
        for link in reversed(chain):
            depth[link] = depth[received[link][at_base]] + 1
    found.rows["tensors"] = (columns, [(*row[:at_depth], depth[row[at_id]], *row[at_depth + 1:]) for row in rows])


def _depth_said(value: object) -> int:
    """A sender's depth for a forged loop, as a depth this database can hold (a hostile one: text, 10**30)."""
    try:
        return min(max(int(value), 0), 1 << 31)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return 0
