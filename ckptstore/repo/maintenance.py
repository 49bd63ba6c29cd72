"""`gc` and `fsck`: remove what no commit needs; find and report damage without touching it."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore import faults
from ckptstore.errors import (
    CkptError,
    CorruptObjectError,
    DiskFullError,
    LostLockError,
    ReadOnlyRepoError,
    StoreUnavailableError,
)
from ckptstore.hashing import ObjectId
from ckptstore.metadata import liveness
from ckptstore.objectstore.fallback import FallbackStore, held_here
from ckptstore.warn import warn_caller

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
    damaged_records: dict[str, str] = field(default_factory=dict)  # "commit ID", "tensor ID", "ref NAME": problem
    unchecked: list[str] = field(default_factory=list)  # a lazy clone's objects not held here, its origin unreachable
    unchecked_why: str = ""
    newer: list[str] = field(default_factory=list)  # commits a newer ckptstore wrote: their manifests not read here
    unreadable: dict[str, str] = field(default_factory=dict)  # objects this user may not read: their paths

    @property
    def ok(self) -> bool:
        return not (self.damaged_objects or self.missing_records or self.damaged_records or self.unchecked
                    or self.newer or self.unreadable)


def gc(repo: Repository, prune_unreachable: bool = False, wait: bool = True) -> GcReport:
    """Delete objects and tensor records no commit needs, and leftovers of interrupted writes.

    With `prune_unreachable`, commits no branch, tag or HEAD reaches are deleted first. Holds the
    repository lock alone, so no commit can be in flight: it waits for those in flight to end,
    and commits that start meanwhile wait for it. Refuses, deleting nothing, while the
    records that say what the remaining commits need are damaged: what they lost track of may
    be the only copy. `wait` False: RepoLockedError at once instead of waiting.
    """
    cleared = clear_tmp_for_room(repo, "gc", wait)
    try:
        with repo.lock(exclusive=True, wait=wait):
            report = collect(repo, prune_unreachable)
    except LostLockError as exc:
        if exc.deleting:  # its line names the object deleted as the lock went, and says to run fsck
            raise
        # the database's words are a commit's ("a gc elsewhere may have removed what it wrote"): gc holds it alone
        raise LostLockError(f"gc stopped before deleting anything: the repository lock on {repo.db.where} was lost "
                            f"({exc.ended}); nothing was deleted or changed: run `ckpt gc` again", exc.ended) from None
    except DiskFullError as exc:  # its advice is to run gc: the database's write needs room of its own first
        raise DiskFullError(f"{str(exc).partition(';')[0]}; gc changed nothing: its database write needs room there "
                            "before it frees any (up to the database's own size): make some and run it again"
                            ) from None
    report.temp_files_removed += cleared
    return report


def clear_tmp_for_room(repo: Repository, verb: str, wait: bool = True) -> int:
    """On a full disk, remove the store's leftovers of interrupted writes before gc or prune; returns how many.

    The database is read-only while its disk is full (metadata/db.py), so gc, whose first step
    clears them, was refused, though a killed commit's leftovers are often what filled the disk.
    Cleared under the exclusive file lock (no write is in progress), then the disk is looked at
    again; still full, the refusal names what was cleared.
    """
    if not repo.db.full:
        return 0
    from ckptstore.repo import owner
    from ckptstore.repo.lock import repo_lock

    owner.refuse_anothers(repo)  # deletes only in its own store, as gc itself
    tmp = getattr(held_here(repo.store), "tmp", None)
    with repo_lock(repo.dir / "lock", exclusive=True, wait=wait):
        size = _bytes_under(tmp)
        removed = repo.store.clear_tmp()
    try:
        repo.db.refuse_writes(verb)
    except ReadOnlyRepoError as exc:
        raise ReadOnlyRepoError(f"{exc}. {verb} first removed what interrupted writes left in {tmp or 'the store'} "
                                f"({removed} file(s), {size:,} bytes), and the disk is still full: free some space "
                                "there and run it again") from None
    return removed


def _bytes_under(folder: Path | None) -> int:
    """The bytes of the files under `folder` (none where it is missing)."""
    total = 0
    for parent, _, files in os.walk(folder) if folder is not None else ():
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total


def collect(repo: Repository, prune_unreachable: bool = False) -> GcReport:
    """`gc`'s work, for a caller that holds the repository lock exclusively (gc itself, `prune`)."""
    from ckptstore.repo import integrity  # numpy and the replay layer: not for every CLI start

    report = GcReport()
    # under the exclusive lock no write is in progress: the leftovers go first, freeing room on a
    # full disk for the database write below
    report.temp_files_removed = repo.store.clear_tmp()
    faults.point("gc:tmp-cleared")
    with repo.db.write() as tx:
        tx.may_idle()  # it reads manifests and lists the store in it: minutes on a big bucket
        if prune_unreachable:
            doomed = liveness.commit_ids(tx) - liveness.reachable_commits(tx)
            liveness.delete_commits(tx, doomed)
            report.commits_removed = len(doomed)
        # pruned commits' ids only where their parents decide what goes (unreachable commits): liveness is the rows'
        findings = integrity.check_metadata(tx, repo.store, pruned_ids=prune_unreachable)
        if findings.problems:
            raise refusal(findings.problems, repo.db.where)
        live_tensors, live_objects = liveness.live(tx, findings.named_tensors)
        stored = dict(repo.store.iter_sizes())
        missing = missing_objects(repo, live_objects - findings.unreadable_manifests, stored.keys())
        if missing:
            raise refusal(missing, repo.db.where)
        dead_tensors = liveness.recorded_tensors(tx) - live_tensors
        liveness.delete_tensors(tx, dead_tensors)
        report.tensors_removed = len(dead_tensors)
        liveness.forget_objects_except(tx, live_objects)
    faults.point("gc:db-committed")
    _forget_damage_of_absent(repo, stored.keys())
    _delete_garbage(repo, {oid: size for oid, size in stored.items()
                           if oid not in live_objects and oid not in findings.unreadable_manifests}, report)
    return report


def _delete_garbage(repo: Repository, garbage: dict[ObjectId, int], report: GcReport) -> None:
    """Delete `garbage` (object: size), renewing gc's delete lease before each delete and ending it after.

    The lease ends however this stops (Ctrl-C, SIGTERM, any error, the lock lost) unless a delete may still land:
    the error came out of a delete (one retried against a throttling bucket lands minutes later). With the lock's
    session gone it is ended from another, only if no other gc wrote one since (`Database.confirm_locks`).
    Else every writer on every machine would wait it out, minutes, for nothing.
    """
    refused: list[PermissionError] = []
    deleted = None  # the lock lost during a delete (retried for a minute on a throttling bucket) is said with it
    lease = delete_lease(repo)
    sending = False  # a delete was sent and has not returned: it may land after this stops
    try:
        for oid, size in garbage.items():
            # one query on a shared database (the lease renewed in it); none on a local
            repo.db.confirm_locks(deleting=True, deleted=deleted, lease_s=lease)
            sending = True
            try:
                repo.store.delete(oid)
            except PermissionError as exc:  # another user's folder (their umask): the rest of the garbage still goes
                sending = False  # refused: nothing in flight
                refused.append(exc)
                continue
            sending = False
            deleted = oid
            faults.point("gc:object-deleted")
            report.bytes_removed += size
            report.objects_removed += 1
        if refused:
            _say_left(refused)
        if deleted is not None or refused and lease is not None:  # a gc that lost the lock during its last delete
            # did not end well; one that did ends its lease, so that no commit waits for it (a Ctrl-C in this
            # round trip too: it is in the try, and the except below ends it)
            repo.db.confirm_locks(deleting=True, deleted=deleted, lease_s=None if lease is None else 0.0)
    except LostLockError:
        raise  # found at a renewal, between deletes: confirm_locks ended the lease already where it could
    except BaseException:
        if lease is not None and not sending:
            # best effort, the original exception said whatever this meets (its session gone: ended from another
            # where it is still ours)
            with contextlib.suppress(Exception):
                repo.db.confirm_locks(deleting=True, lease_s=0.0)
        raise


LEASE_MARGIN_S = 10.0  # past the store's own bound: a delete sent a moment after its lease was renewed


def delete_lease(repo: Repository) -> float | None:
    """Seconds gc's delete lease runs past each renewal: the longest a delete may take to land; None for none.

    A bucket's delete is retried, and can land minutes after it was sent: a gc whose lock went meanwhile
    leaves commits elsewhere to wait that out (metadata/db.py). A local folder's delete lands at once, and
    a local (SQLite) gc's file lock cannot be lost: no lease, and no cost.
    """
    lands_within = getattr(held_here(repo.store), "delete_lands_within", None)
    return None if lands_within is None else lands_within + LEASE_MARGIN_S


def _forget_damage_of_absent(repo: Repository, stored: Iterable[ObjectId]) -> None:
    """Take off damage marks of objects not stored, and learn the others', so each delete below takes its own off.

    A bucket's markers are removed by the process that listed them: another machine's marker of an
    object gc deletes (or an earlier gc did) stayed, and each later commit loaded the records it reused.
    """
    damage = getattr(held_here(repo.store), "damage", None)
    if damage is not None:
        damage.discard(damage.ids() - set(stored))


def _say_left(refused: list[PermissionError]) -> None:
    """Warn that objects no commit needs stayed for want of permission: how many, and the first one's path."""
    warn_caller(f"{len(refused)} object(s) no commit needs were left in place: this user may not delete them "
                f"(permission denied on {refused[0].filename}); run `ckpt gc` again as a user who may")


def missing_objects(repo: Repository, needed: set[ObjectId], stored: Iterable[ObjectId]) -> dict[str, str]:
    """Objects that live records name and the store lacks, as damage (a wrong name makes the right object garbage).

    A lazy clone's store lacks what its origin keeps for it: none of its own count as missing.
    """
    if held_here(repo.store) is not repo.store:
        return {}
    unlisted = sorted(needed - set(stored), key=str)
    cut_short = next((oid for oid in unlisted[:8] if repo.store.has(oid)), None)  # asked alone, it is there
    if cut_short is not None:
        raise StoreUnavailableError(f"{repo.store.url} left object {cut_short[:12]} out of its listing, though it "
                                    "holds it (a listing cut short: check the S3 server, or any proxy before it); "
                                    "nothing was deleted, since what the listing misses cannot be told garbage")
    return {f"object {oid}": "needed, and not in the store" for oid in unlisted}


def refuse_newer(newer: list[str], verb: str) -> None:
    """Raise where commits a newer ckptstore wrote are among those kept: what they need is not known here."""
    if newer:
        named = ", ".join(cid[:12] for cid in newer[:3])
        raise CkptError(f"{verb} refused to delete anything: {len(newer)} commit(s) ({named}) were written by a newer "
                        "ckptstore, whose manifests this one cannot read or check. Nothing else was found damaged: "
                        "upgrade ckptstore, then run it again")


def refusal(problems: dict[str, str], where: str, verb: str = "gc") -> CkptError:
    """Why gc (or prune) deletes nothing: the first damaged records, and how many more."""
    shown = "; ".join(f"{what}: {problem}" for what, problem in list(problems.items())[:2])
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    return CkptError(f"{verb} refused to delete anything: the repository is damaged ({shown}{more}), so it cannot "
                     "tell which objects are still needed and could delete the only copy. Run `ckpt fsck` for the full "
                     f"list; repair or restore the metadata ({where}) or the lost objects from a backup first")


def fsck(repo: Repository, full: bool = False) -> FsckReport:
    """Verify every object a commit needs against its hash, and the records against their ids and each other.

    Commit ids are recomputed from their rows, manifests checked against their commits, and every
    tensor's chunk records must cover its bytes; the commits any damage breaks are listed. With
    `full`, also replay every tensor of every commit and check it against its chunk checksums and
    its tensor id.

    It takes no lock (a long `--full` would hold back a gc, and the commits queued behind it):
    damage found is confirmed against the metadata as it is at the end, so what a gc or prune
    removed meanwhile is not reported.
    """
    from ckptstore.repo import integrity

    report = FsckReport()
    with repo.db.read() as tx:
        findings = integrity.check_metadata(tx, repo.store)
        _, live_objects = liveness.live(tx, findings.named_tensors)
        manifests = liveness.commit_manifests(tx)
        report.missing_records = sorted(liveness.referenced_tensors(tx) - liveness.recorded_tensors(tx), key=str)
    report.damaged_records, report.newer = findings.problems, list(findings.newer_manifests)
    for what, problem in integrity.skeleton_problems(repo, findings.manifests).items():
        report.damaged_records.setdefault(what, problem)
    _check_objects(repo, live_objects, report)
    report.unreferenced_objects = sum(1 for oid in repo.store.iter_ids() if oid not in live_objects)
    for oid in report.damaged_objects:
        for cid in repo.commits_needing([oid]):
            report.broken_commits.setdefault(cid, []).append(oid)
    _commits_broken_by_records(repo, report)
    replayed = _replay_all(repo, manifests, report, live_objects) if full else set()
    if not report.ok:
        _forget_what_was_removed(repo, report, replayed)
    return report


def _check_objects(repo: Repository, live_objects: Iterable[ObjectId], report: FsckReport) -> None:
    """Read every object the commits need, verified against its id.

    A lazy clone reads what it lacks from its origin, without keeping it (kept, one fsck made it a full
    clone: auditor 403); once the origin cannot be reached, the rest are checked here alone, and those
    not held here are counted as unchecked, not called damaged.
    """
    reading = _reading_only(repo)
    store, origin_lost = reading or repo.store, False
    for oid in sorted(live_objects, key=str):
        report.objects_checked += 1
        try:
            store.get(oid)
        except StoreUnavailableError as exc:
            if reading is None or origin_lost:  # its own store: nothing to check without it
                raise
            report.unchecked.append(oid)
            report.unchecked_why, store, origin_lost = str(exc), held_here(repo.store), True
        except PermissionError as exc:  # another user's file (their umask): said, and the rest still checked
            report.unreadable[oid] = exc.filename or str(exc)
        except OSError as exc:  # a failing disk (EIO): this object is lost here, the rest still checked
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # the process's limit, not the object: said as such
                raise
            where = f" at {exc.filename}" if exc.filename else ""
            report.damaged_objects[oid] = f"unreadable ({exc.strerror or exc}{where})"
        except CorruptObjectError as exc:
            if not origin_lost or exc.problem != "missing":
                report.damaged_objects[oid] = exc.problem
            else:
                report.unchecked.append(oid)


def _forget_what_was_removed(repo: Repository, report: FsckReport, replayed: Set[str] = frozenset()) -> None:
    """Drop findings about commits, tensors and objects that a gc or prune removed while fsck ran.

    `replayed`: the commits whose replay (--full) found damage: of a commit pruned since, that is its tensors
    going, not damage, though its row stays.
    """
    with repo.db.read() as tx:
        commits = {cid for cid, _ in liveness.commit_manifests(tx)}  # neither removed nor pruned
        rows = liveness.commit_ids(tx)  # pruned ones too: their rows (id, message, metrics) are still checked
        _, needed = liveness.live(tx)
        tensors = liveness.recorded_tensors(tx) | liveness.referenced_tensors(tx)
    report.damaged_objects = {oid: why for oid, why in report.damaged_objects.items() if oid in needed}
    report.unreadable = {oid: path for oid, path in report.unreadable.items() if oid in needed}
    report.broken_commits = {cid: oids for cid, oids in report.broken_commits.items() if cid in commits}
    report.missing_records = [tid for tid in report.missing_records if tid in tensors]
    kept = {"commit": {cid for cid in rows if cid in commits or cid not in replayed}, "tensor": tensors}
    report.damaged_records = {what: why for what, why in report.damaged_records.items()
                              if what.split()[0] not in kept or what.split()[1] in kept[what.split()[0]]}


def _commits_broken_by_records(repo: Repository, report: FsckReport) -> None:
    """List the commits whose records are damaged, or that need a damaged tensor record, as broken."""
    tensors = {what.split()[1] for what in report.damaged_records if what.startswith("tensor ")}
    with repo.db.read() as tx:
        needing = liveness.commits_with_tensors(tx, tensors) if tensors else []
    commits = [what.split()[1] for what in report.damaged_records if what.startswith("commit ")]
    for cid in sorted(set(needing) | set(commits), key=str):
        report.broken_commits.setdefault(cid, [])


def _reading_only(repo: Repository) -> FallbackStore | None:
    """A lazy clone's store that keeps nothing it reads from the origin (one fsck made it a full clone), else None."""
    return repo.store.reading_only() if isinstance(repo.store, FallbackStore) else None


def _replay_all(repo: Repository, manifests: list, report: FsckReport, live_objects: set[ObjectId]) -> set[str]:
    """Fsck --full: replay every commit's tensors, checking each against its id; the commits it found damaged.

    A lazy clone's origin lost midway leaves the objects not held here unchecked, as the object check does
    (they were damaged records: a server down read as damage, reviewer 407).
    """
    from ckptstore.repo.checkout import restore

    damaged: set[str] = set()
    store = _reading_only(repo)
    not_read = [*report.unchecked, *report.unreadable]
    unchecked = set(repo.commits_needing(not_read)) if not_read else set()
    for cid, manifest_oid in manifests:
        if manifest_oid in report.damaged_objects or cid in report.broken_commits or cid in unchecked:
            continue
        try:
            manifest = repo.read_manifest(manifest_oid)
            restore(repo, manifest, by_id=True, store=store)
            report.tensors_verified += len(manifest.entries)
        except CorruptObjectError as exc:
            damaged.add(cid)
            report.broken_commits.setdefault(cid, [])
            if exc.object_ids and not set(exc.object_ids) - set(report.damaged_objects):
                for oid in exc.object_ids:
                    report.broken_commits[cid].append(oid)
            else:  # its objects hashed sound above: what decodes wrong is the record (codec, params, checksum)
                report.damaged_records.setdefault(f"commit {cid}", f"a tensor's objects are sound but {exc.problem}; "
                                                                    "its record is damaged")
        except StoreUnavailableError as exc:
            if store is None:  # its own store: nothing to check without it
                raise
            if not report.unchecked_why:
                local = held_here(repo.store)
                report.unchecked_why = str(exc)
                report.unchecked += sorted(set(oid for oid in live_objects if not local.has(oid)) -
                                           set(report.unchecked))
        except CkptError as exc:
            damaged.add(cid)
            report.broken_commits.setdefault(cid, [])
            report.damaged_records.setdefault(f"commit {cid}", str(exc))
    return damaged
