"""`gc` and `fsck`: remove what no commit needs; find and report damage without touching it."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import delete, select

from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import ObjectId
from ckptstore.metadata import write_transaction
from ckptstore.metadata.schema import (
    commit_parents,
    commit_tensors,
    commits,
    known_files,
    objects,
    refs,
    tensor_chunks,
    tensors,
)
from ckptstore.repo import catalog
from ckptstore.repo.progress import NoProgress
from ckptstore.repo.repository import Manifest, Repository


@dataclass
class GcReport:
    """What `gc` removed."""

    objects_removed: int = 0
    bytes_removed: int = 0
    tensors_removed: int = 0
    commits_removed: int = 0
    temp_files_removed: int = 0


@dataclass
class FsckReport:
    """Damage found by `fsck`; `ok` when there is none."""

    damaged_objects: dict[str, str] = field(default_factory=dict)
    broken_commits: dict[str, list[str]] = field(default_factory=dict)
    missing_records: list[str] = field(default_factory=list)
    unreferenced_objects: int = 0
    objects_checked: int = 0
    tensors_verified: int = 0

    @property
    def ok(self) -> bool:
        return not (self.damaged_objects or self.missing_records)


def _reachable_commits(conn) -> set[str]:
    parents: dict[str, list[str]] = {}
    for row in conn.execute(select(commit_parents)):
        parents.setdefault(row.commit_id, []).append(row.parent_id)
    stack = [r.commit_id for r in conn.execute(select(refs)) if r.commit_id]
    seen: set[str] = set()
    while stack:
        cid = stack.pop()
        if cid not in seen:
            seen.add(cid)
            stack.extend(parents.get(cid, []))
    return seen


def _live(conn) -> tuple[set[str], set[str]]:
    """Tensor ids and object ids that some commit in the database needs."""
    live_tensors = set(conn.execute(select(commit_tensors.c.tensor_id)).scalars())
    bases = dict(conn.execute(select(tensors.c.id, tensors.c.base_id)).all())
    frontier = set(live_tensors)
    while frontier:
        frontier = {bases[t] for t in frontier if bases.get(t)} - live_tensors
        live_tensors |= frontier
    live_objects = set(conn.execute(select(commits.c.manifest_object)).scalars())
    for tid, oid in conn.execute(select(tensor_chunks.c.tensor_id, tensor_chunks.c.object_id)):
        if tid in live_tensors:
            live_objects.add(oid)
    return live_tensors, live_objects


def gc(repo: Repository, prune_unreachable: bool = False) -> GcReport:
    """Delete objects and tensor records no commit needs, and leftovers of interrupted writes.

    With `prune_unreachable`, commits no branch, tag or HEAD reaches are deleted first. Holds the
    repository lock alone, so no commit can be in flight.
    """
    report = GcReport()
    with repo._lock(exclusive=True, wait=False):
        report.temp_files_removed = repo.store.clear_tmp()
        with write_transaction(repo.engine) as conn:
            if prune_unreachable:
                doomed = set(conn.execute(select(commits.c.id)).scalars()) - _reachable_commits(conn)
                for batch in catalog.batches(sorted(doomed)):
                    conn.execute(delete(commit_tensors).where(commit_tensors.c.commit_id.in_(batch)))
                    conn.execute(delete(commit_parents).where(commit_parents.c.commit_id.in_(batch)))
                    conn.execute(delete(known_files).where(known_files.c.commit_id.in_(batch)))
                    conn.execute(delete(commits).where(commits.c.id.in_(batch)))
                report.commits_removed = len(doomed)
            live_tensors, live_objects = _live(conn)
            dead_tensors = set(conn.execute(select(tensors.c.id)).scalars()) - live_tensors
            for batch in catalog.batches(sorted(dead_tensors)):
                conn.execute(delete(tensor_chunks).where(tensor_chunks.c.tensor_id.in_(batch)))
                conn.execute(delete(tensors).where(tensors.c.id.in_(batch)))
            report.tensors_removed = len(dead_tensors)
            dead_rows = set(conn.execute(select(objects.c.id)).scalars()) - live_objects
            for batch in catalog.batches(sorted(dead_rows)):
                conn.execute(delete(objects).where(objects.c.id.in_(batch)))
        for oid in list(repo.store.iter_ids()):
            if oid not in live_objects:
                report.bytes_removed += repo.store.size(oid)
                repo.store.delete(oid)
                report.objects_removed += 1
    return report


def fsck(repo: Repository, full: bool = False) -> FsckReport:
    """Verify every object a commit needs against its hash and list the commits any damage breaks.

    With `full`, also replay every tensor of every commit and check it against its chunk checksums
    and its tensor id.
    """
    report = FsckReport()
    with repo.engine.connect() as conn:
        _, live_objects = _live(conn)
        commit_rows = conn.execute(select(commits.c.id, commits.c.manifest_object)).all()
        recorded = set(conn.execute(select(tensors.c.id)).scalars())
        referenced = set(conn.execute(select(commit_tensors.c.tensor_id)).scalars())
    for oid in sorted(live_objects):
        report.objects_checked += 1
        try:
            repo.store.get(ObjectId(oid))
        except CorruptObjectError as exc:
            report.damaged_objects[oid] = exc.problem
    report.missing_records = sorted(referenced - recorded)
    report.unreferenced_objects = sum(1 for oid in repo.store.iter_ids() if oid not in live_objects)
    for oid in report.damaged_objects:
        for cid in repo.commits_needing([oid]):
            report.broken_commits.setdefault(cid, []).append(oid)
    if full:
        for cid, manifest_oid in commit_rows:
            if manifest_oid in report.damaged_objects:
                continue
            manifest = Manifest.from_bytes(repo.store.get(ObjectId(manifest_oid)))
            try:
                repo._restore(manifest, NoProgress(), by_id=True)
                report.tensors_verified += len(manifest.entries)
            except CorruptObjectError as exc:
                report.broken_commits.setdefault(cid, []).append(exc.object_id)
                report.damaged_objects.setdefault(exc.object_id, exc.problem)
    return report
