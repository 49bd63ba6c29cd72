"""`gc` and `fsck`: remove what no commit needs; find and report damage without touching it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptstore.errors import CorruptObjectError
from ckptstore.metadata import liveness

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


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


def gc(repo: Repository, prune_unreachable: bool = False) -> GcReport:
    """Delete objects and tensor records no commit needs, and leftovers of interrupted writes.

    With `prune_unreachable`, commits no branch, tag or HEAD reaches are deleted first. Holds the
    repository lock alone, so no commit can be in flight.
    """
    report = GcReport()
    with repo.lock(exclusive=True, wait=False):
        report.temp_files_removed = repo.store.clear_tmp()
        with repo.db.write() as tx:
            if prune_unreachable:
                doomed = liveness.commit_ids(tx) - liveness.reachable_commits(tx)
                liveness.delete_commits(tx, doomed)
                report.commits_removed = len(doomed)
            live_tensors, live_objects = liveness.live(tx)
            dead_tensors = liveness.recorded_tensors(tx) - live_tensors
            liveness.delete_tensors(tx, dead_tensors)
            report.tensors_removed = len(dead_tensors)
            liveness.forget_objects_except(tx, live_objects)
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
    with repo.db.read() as tx:
        _, live_objects = liveness.live(tx)
        manifests = liveness.commit_manifests(tx)
        report.missing_records = sorted(liveness.referenced_tensors(tx) - liveness.recorded_tensors(tx))
    for oid in sorted(live_objects):
        report.objects_checked += 1
        try:
            repo.store.get(oid)
        except CorruptObjectError as exc:
            report.damaged_objects[oid] = exc.problem
    report.unreferenced_objects = sum(1 for oid in repo.store.iter_ids() if oid not in live_objects)
    for oid in report.damaged_objects:
        for cid in repo.commits_needing([oid]):
            report.broken_commits.setdefault(cid, []).append(oid)
    if full:
        _replay_all(repo, manifests, report)
    return report


def _replay_all(repo: Repository, manifests: list, report: FsckReport) -> None:
    """Fsck --full: replay every commit's tensors, checking each against its id."""
    from ckptstore.repo.checkout import restore

    for cid, manifest_oid in manifests:
        if manifest_oid in report.damaged_objects:
            continue
        manifest = repo.read_manifest(manifest_oid)
        try:
            restore(repo, manifest, by_id=True)
            report.tensors_verified += len(manifest.entries)
        except CorruptObjectError as exc:
            for oid in exc.object_ids:
                report.broken_commits.setdefault(cid, []).append(oid)
                report.damaged_objects.setdefault(oid, exc.problem)
