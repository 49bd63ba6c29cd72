"""Named queries on commits and their parents."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptstore.errors import CkptError, CorruptRecordError, PrunedCommitError
from ckptstore.hashing import CommitId, ObjectId, TensorId, commit_id
from ckptstore.metadata.db import Tx
from ckptstore.metadata.tensors import dependents, tensors_in_objects

SHARDED_KIND = "dcp"  # a sharded (torch.distributed.checkpoint) commit's kind: nothing of it is written in place

_INT_KEY = re.compile(r"-?(0|[1-9][0-9]*)")  # the str form of an int key, as JSON writes it
_COLUMNS = ("id, manifest_object, message, author, created_at, step, metrics, kind, source_path, raw_bytes, "
            "stored_bytes, lossy")


@dataclass
class CommitInfo:
    """One commit's row, with its parents in order."""

    id: CommitId
    manifest_object: ObjectId
    message: str
    author: str
    created_at: float
    step: int | None
    metrics: dict[str, Any]
    kind: str
    source_path: str | None
    raw_bytes: int
    stored_bytes: int
    parents: list[CommitId] = field(default_factory=list)
    lossy: str | None = None
    pruned: bool = False  # removed by `ckpt prune`: the row stays (ids hash their parents), the data went; not hashed

    @property
    def sharded(self) -> bool:
        """A sharded (torch.distributed.checkpoint) commit: it has no files, so nothing of it is written in place."""
        return self.kind == SHARDED_KIND

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "parents": self.parents, "message": self.message, "author": self.author,
            "created_at": self.created_at, "step": self.step, "metrics": self.metrics, "kind": self.kind,
            "source_path": self.source_path, "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
            **({"lossy": self.lossy} if self.lossy else {}),
        }

    def computed_id(self, step: Any = None, metrics: dict | None = None) -> CommitId:
        """The id this commit's record hashes to: blake3 of its canonical JSON (docs/format.md).

        `step` and `metrics`, when given, stand in for the recorded ones (see `id_problem`).
        """
        record = self.to_json()
        record.pop("id")
        record["manifest"] = self.manifest_object
        if step is not None:
            record["step"] = step
        if metrics is not None:
            record["metrics"] = metrics
        return commit_id(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())

    def _spellings(self) -> list[tuple[Any, dict | None]]:
        """(step, metrics) as older commits may have hashed them, beside the recorded values.

        A whole-number step given as a float was hashed as one (`2.0`) and comes back from the
        database as an integer; metrics given with int keys were hashed in numeric key order and
        come back with str keys. Commits made now hash str keys and the step as recorded.
        """
        steps = [None] + ([float(self.step)] if isinstance(self.step, int) and not isinstance(self.step, bool) else [])
        metrics: list[dict | None] = [None]
        if self.metrics and all(isinstance(k, str) and _INT_KEY.fullmatch(k) for k in self.metrics):
            metrics.append({int(k): v for k, v in self.metrics.items()})
        return [(step, m) for step in steps for m in metrics]

    def id_problem(self, expected: CommitId | None = None) -> str | None:
        """Why this row is not the record of commit `expected` (default: its own id), or None when it is.

        Every spelling an older commit may have hashed is tried (`_spellings`).
        """
        if expected is not None and self.id != expected:
            return f"asked for commit {expected}, the database returned the row of {self.id}"
        try:
            if any(self.id == self.computed_id(step, metrics) for step, metrics in self._spellings()):
                return None
        except (TypeError, ValueError, OverflowError) as exc:  # a damaged row: values no record has
            return f"its row holds values no commit record has ({exc})"
        return ("its record (manifest, parents, message, author, time, step, metrics, sizes) does not hash to its id: "
                "the row was damaged or rewritten")

    def verified(self, expected: CommitId | None = None) -> CommitInfo:
        """This row, after checking that it is the record of `expected` (default: its own id)."""
        problem = self.id_problem(expected)
        if problem is not None:
            raise CorruptRecordError(f"commit {expected or self.id}", problem, [expected or self.id])
        return self


# the places in a row of _COLUMNS of the columns that hold numbers (SQLite keeps any value in any column)
_NUMBERS = {4: "created_at", 5: "step", 9: "raw_bytes", 10: "stored_bytes"}


def _info(row: tuple, parents: list[CommitId]) -> CommitInfo:
    cid, manifest, message, author, created, step, metrics, kind, source, raw, stored, lossy = row
    for place, column in _NUMBERS.items():  # a text there ended stats and log in "unexpected TypeError"
        if _no_number(row[place], column):
            raise CorruptRecordError(f"commit {cid}", f"its {column} {row[place]!r} is not a number", [cid])
    return CommitInfo(CommitId(cid), ObjectId(manifest), message, author, created, step, _metrics(cid, metrics),
                      kind, source, raw, stored, parents, lossy)


def _no_number(value: Any, column: str) -> bool:
    """Whether `value`, read from `column`, is not the number a commit record holds there (a step may be None)."""
    return not (value is None and column == "step") and (isinstance(value, bool) or
                                                          not isinstance(value, (int, float)))


def _info_noting(row: tuple, parents: list[CommitId], unparsed: dict[str, str] | None) -> CommitInfo:
    """`_info` of `row`; one whose metrics or numbers do not parse is noted in `unparsed` (None: raised).

    It is read without them: no metrics, no step, 0 for a time or a size.
    """
    try:
        return _info(row, parents)
    except CorruptRecordError as exc:
        if unparsed is None:
            raise
        unparsed[exc.what] = exc.problem
        stand_ins = {place: None if column == "step" else 0 for place, column in _NUMBERS.items()
                     if _no_number(row[place], column)}
        try:
            _metrics(row[0], row[6])
        except CorruptRecordError:
            stand_ins[6] = "{}"
        return _info(tuple(stand_ins.get(place, value) for place, value in enumerate(row)), parents)


def _metrics(cid: str, text: Any) -> dict[str, Any]:
    """A commit row's metrics column, parsed; a damaged one is the commit's damage."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        raise CorruptRecordError(f"commit {cid}", f"its metrics {text!r} do not parse", [cid]) from None


def all_parents(tx: Tx) -> dict[CommitId, list[CommitId]]:
    """Every commit's parents in order, in one pass (repositories hold thousands, not millions)."""
    parents: dict[CommitId, list[CommitId]] = {}
    for cid, parent in tx.rows("SELECT commit_id, parent_id FROM commit_parents ORDER BY commit_id, position"):
        parents.setdefault(CommitId(cid), []).append(CommitId(parent))
    return parents


def all_commits(tx: Tx, unparsed: dict[str, str] | None = None) -> dict[CommitId, CommitInfo]:
    """Every commit with its parents.

    A row whose metrics do not parse is CorruptRecordError; where `unparsed` is given, its problem goes
    there instead (by "commit ID") and the row is read with no metrics, so fsck lists it and checks the rest.
    """
    parents, pruned = all_parents(tx), pruned_ids(tx)
    found = {CommitId(row[0]): _info_noting(row, parents.get(row[0], []), unparsed)
             for row in tx.rows(f"SELECT {_COLUMNS} FROM commits")}
    for cid in pruned & found.keys():
        found[cid].pruned = True
    return found


def all_metrics(tx: Tx) -> dict[CommitId, dict[str, Any]]:
    """Every commit's metrics, without building whole commit records (retention after each commit reads them)."""
    return {CommitId(cid): _metrics(cid, metrics) for cid, metrics in tx.rows("SELECT id, metrics FROM commits")}


def pruned_ids(tx: Tx) -> set[CommitId]:
    """Commits `ckpt prune` removed (their rows stay)."""
    return {CommitId(c) for c in tx.column("SELECT commit_id FROM pruned_commits")}


def removed(tx: Tx, cid: CommitId) -> str:
    """How commit `cid` was removed ("pruned": `ckpt prune`, "deleted": `ckpt gc --prune`), or "" while it is kept."""
    if tx.first("SELECT 1 FROM commits WHERE id = ?", (cid,)) is None:
        return "deleted"
    return "pruned" if tx.first("SELECT 1 FROM pruned_commits WHERE commit_id = ?", (cid,)) is not None else ""


def kept_with_manifest(tx: Tx, oid: str) -> bool:
    """Whether a commit that `ckpt prune` has not removed names manifest `oid`."""
    return bool(tx.rows_in("SELECT id FROM commits WHERE manifest_object IN ({ids}) AND id NOT IN "
                           "(SELECT commit_id FROM pruned_commits)", [oid]))


def readable_manifest(info: CommitInfo) -> ObjectId:
    """The manifest object of commit `info`; PrunedCommitError when `ckpt prune` removed it."""
    if info.pruned:
        raise PrunedCommitError(f"commit {info.id[:12]} was removed by `ckpt prune`: its place in the history, "
                                "message and metrics stay, its tensors are gone. Check out a kept commit "
                                "(`ckpt log` marks the pruned ones)")
    return info.manifest_object


def commit_info(tx: Tx, cid: CommitId) -> CommitInfo:
    """Commit `cid`'s row, checked against its id, so damaged or rewritten metadata is an error, not another commit."""
    row = tx.first(f"SELECT {_COLUMNS} FROM commits WHERE id = ?", (cid,))
    if row is None:
        raise CkptError(f"metadata has no commit {cid}; run `ckpt fsck`")
    info = _info(row, parents_of(tx, cid)).verified(cid)
    info.pruned = tx.first("SELECT 1 FROM pruned_commits WHERE commit_id = ?", (cid,)) is not None
    return info


def parents_of(tx: Tx, cid: CommitId) -> list[CommitId]:
    return [CommitId(p) for p in tx.column(
        "SELECT parent_id FROM commit_parents WHERE commit_id = ? ORDER BY position", (cid,))]


def nth_parent(tx: Tx, cid: CommitId, n: int) -> CommitId | None:
    """Parent number `n` (0: the first) of `cid`, or None."""
    found = tx.scalar("SELECT parent_id FROM commit_parents WHERE commit_id = ? AND position = ?", (cid, n))
    return CommitId(found) if found else None


def with_prefix(tx: Tx, prefix: str, limit: int = 10) -> list[CommitId]:
    """Commits whose id starts with `prefix` (a lowercase hex string), at most `limit`."""
    return [CommitId(c) for c in tx.column("SELECT id FROM commits WHERE id LIKE ? LIMIT ?", (prefix + "%", limit))]


def manifest_object(tx: Tx, cid: CommitId) -> ObjectId:
    """The object holding commit `cid`'s manifest (the row checked against its id, as in `commit_info`).

    Raises PrunedCommitError for a commit `ckpt prune` removed.
    """
    return readable_manifest(commit_info(tx, cid))


def insert_commit(tx: Tx, info: CommitInfo, tensor_ids: Iterable[TensorId]) -> None:
    tx.execute(f"INSERT INTO commits ({_COLUMNS}) VALUES ({', '.join('?' * 12)})", (
        info.id, info.manifest_object, info.message, info.author, info.created_at, info.step,
        json.dumps(info.metrics, sort_keys=True), info.kind, info.source_path, info.raw_bytes, info.stored_bytes,
        info.lossy))
    tx.executemany("INSERT INTO commit_parents (commit_id, position, parent_id) VALUES (?, ?, ?)",
                   [(info.id, position, parent) for position, parent in enumerate(info.parents)])
    tx.insert_ignore("commit_tensors", ("commit_id", "tensor_id"), [(info.id, t) for t in set(tensor_ids)])


def commits_needing(tx: Tx, object_ids: Iterable[ObjectId]) -> list[CommitId]:
    """Commits whose checkout reads any of `object_ids` (directly or through a delta chain)."""
    object_ids = list(object_ids)
    needed = dependents(tx, tensors_in_objects(tx, object_ids))
    cids = {r[0] for r in tx.rows_in("SELECT DISTINCT commit_id FROM commit_tensors WHERE tensor_id IN ({ids})",
                                     needed)}
    cids |= {r[0] for r in tx.rows_in("SELECT id FROM commits WHERE manifest_object IN ({ids})", object_ids)}
    return sorted(CommitId(c) for c in cids)
