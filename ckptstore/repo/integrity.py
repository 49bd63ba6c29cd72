"""Do the metadata records agree with each other, with their ids and with the manifests?

Checkout asks it of the tensors it restores (so a lost chunk row is an error, not uninitialised
memory); fsck and gc ask it of the whole repository (gc refuses to delete anything while the
records that say what is needed are damaged).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ckptstore import faults
from ckptstore.errors import (
    CkptError,
    CorruptObjectError,
    CorruptRecordError,
    InvalidRefNameError,
    PrunedCommitError,
    StoreUnavailableError,
)
from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import liveness
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore.fallback import FallbackStore
from ckptstore.records import TensorRecord
from ckptstore.replay import chain_problem
from ckptstore.repo import refs as ref_names
from ckptstore.state import RawTensor

if TYPE_CHECKING:
    from ckptstore.formats import CheckpointFile
    from ckptstore.metadata import Tx
    from ckptstore.metadata.transfer import RecordSet
    from ckptstore.objectstore import ObjectStore
    from ckptstore.repo.manifest import Entry, Manifest
    from ckptstore.repo.repository import Repository

T = TypeVar("T")
METADATA_NAME = 255  # the longest name the metadata keeps (refs.MAX_NAME leaves room below it for remotes/)
_NO_DATA = np.empty(0, dtype=np.uint8)
MANIFESTS_KEPT = 64 << 20  # bytes of the manifests read to check a transfer that are kept to send, not read again


def _by_key(item: tuple) -> str:
    """Sort key of a (key, value) pair: its key as text (a damaged row's id may not be text at all)."""
    return str(item[0])


def entry_problem(entry: Entry, records: dict[TensorId, TensorRecord]) -> str | None:
    """Why the record of a manifest entry cannot restore it byte for byte, or None."""
    record = records.get(entry.tensor)
    if record is None:
        return "it has no record"
    return _fields_problem(entry, record) or chain_problem(record, records)


def _fields_problem(entry: Entry, record: TensorRecord) -> str | None:
    """Why a record is not the tensor its manifest entry describes (dtype, shape, size), or None."""
    if record.dtype != entry.dtype or tuple(record.shape) != tuple(entry.shape):
        return (f"its record is a {record.dtype} {list(record.shape)}, the manifest says {entry.dtype} "
                f"{list(entry.shape)}")
    try:
        expected = _itemsize(entry.dtype) * math.prod(entry.shape)
    except CkptError:  # a dtype this torch does not know: the replay will say so
        expected = record.raw_bytes
    if record.raw_bytes != expected:
        return f"its record holds {record.raw_bytes!r} bytes where a {entry.dtype} {list(entry.shape)} has {expected}"
    return None


@functools.lru_cache(maxsize=256)
def _itemsize(dtype: str) -> int:
    """Bytes per element of a stored dtype name (a checkpoint holds a handful)."""
    return RawTensor(dtype, (), _NO_DATA).itemsize


def check_restore(manifest: Manifest, paths: list[str], records: dict[TensorId, TensorRecord]) -> None:
    """Raise CorruptRecordError unless the records account for every byte of every tensor at `paths`."""
    for path in paths:
        entry = manifest.entries[path]
        problem = entry_problem(entry, records)
        if problem is not None:
            raise CorruptRecordError(f"tensor {entry.tensor} (at {path!r})", problem, tensors=[entry.tensor])


def checked_records(repo: Repository, manifest: Manifest, paths: list[str]) -> dict[TensorId, TensorRecord]:
    """The records of the tensors at `paths` as the metadata has them now, every byte accounted for."""
    try:
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {manifest.entries[p].tensor for p in paths})
        check_restore(manifest, paths, records)
    except CorruptRecordError as exc:
        raise naming_commits(repo, exc) from None
    return records


def replay_current(repo: Repository, manifest: Manifest, paths: list[str],
                   attempt: Callable[[dict[TensorId, TensorRecord]], T]) -> T:
    """`attempt(records)` of the tensors at `paths`; a missing object means damage only where the records stand.

    Readers take no lock: a prune may re-encode or repack these tensors and delete the objects read
    here meanwhile. Records that moved are read again and replayed once more; records gone that no
    commit needs any more mean the commit itself was pruned meanwhile (PrunedCommitError).
    """
    try:
        records = checked_records(repo, manifest, paths)
    except CorruptRecordError as exc:
        # records gone, and the commit whose manifest was read a moment ago is now pruned or gone: a prune removed
        # it meanwhile (a dcp.load between planning and reading), no damage
        if exc.commits or not _pruned_since_read(repo, manifest):
            raise
        raise _pruned_meanwhile() from None
    faults.point("checkout:records-read")  # tests run a prune here
    try:
        return attempt(records)
    except CorruptObjectError as exc:
        error = exc
    try:
        fresh = checked_records(repo, manifest, paths)
    except CorruptRecordError as exc:
        # records read a moment ago, now gone and needed by no commit: a prune removed this commit, no damage
        if exc.commits or not set(exc.tensors) <= records.keys():
            raise
        raise _pruned_meanwhile() from None
    if fresh == records:
        raise error.needed_by(repo.commits_needing(error.object_ids)) from None
    try:
        return attempt(fresh)
    except CorruptObjectError as exc:
        raise exc.needed_by(repo.commits_needing(exc.object_ids)) from None


def kept_manifest(repo: Repository, info: commit_rows.CommitInfo) -> Manifest:
    """The manifest of commit `info`, read as readers do (no lock).

    A prune or `gc --prune` that removed the commit since its row was read is PrunedCommitError, not damage:
    its manifest object went with it, on purpose.
    """
    oid = commit_rows.readable_manifest(info)
    try:
        return repo.read_manifest(oid)
    except CorruptObjectError:
        with repo.db.read() as tx:
            if commit_rows.kept_with_manifest(tx, oid):
                raise
        raise _pruned_meanwhile() from None


def _pruned_since_read(repo: Repository, manifest: Manifest) -> bool:
    """Whether no commit keeps the manifest read: pruned, or deleted by `gc --prune`.

    A commit whose rows were lost still names it: that is damage.
    """
    if manifest.oid is None:
        return False
    with repo.db.read() as tx:
        return not commit_rows.kept_with_manifest(tx, manifest.oid)


def _pruned_meanwhile() -> PrunedCommitError:
    return PrunedCommitError("the commit being read was removed by `ckpt prune` or `ckpt gc --prune` while this "
                             "command ran (its tensors went with it, on purpose): check out a kept commit (`ckpt "
                             "log` lists them)")


def entry_records(repo: Repository, manifest: Manifest) -> dict[TensorId, TensorRecord]:
    """The record of each tensor `manifest` names (not their bases); a lost one is damage, named as checkout does."""
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()}, with_bases=False)
    lost = {entry.tensor: path for path, entry in manifest.entries.items() if entry.tensor not in records}
    if lost:
        tid, path = next(iter(lost.items()))
        raise naming_commits(repo, CorruptRecordError(f"tensor {tid} (at {path!r})", "it has no record",
                                                      tensors=list(lost)))
    return records


def naming_commits(repo: Repository, error: CorruptRecordError) -> CorruptRecordError:
    """`error`, naming the commits that need the damaged tensors (where the rows that say so survive)."""
    with repo.db.read() as tx:
        return error.needed_by(liveness.commits_with_tensors(tx, set(error.tensors)) or error.commits)


def sent_damage(found: RecordSet, sending: set[TensorId], commits: list[CommitId],
                manifest_tensors: dict[ObjectId, set[TensorId]]) -> tuple[CommitId | None, str] | None:
    """The first of `commits` that the records in `found` could not restore on the other side, and why; None if none.

    What push and fetch check before anything is sent, from the rows loaded for sending alone (fsck's
    checks, on what moves): every tensor that moves (`sending`: those the commits name and their bases,
    less what the other side holds) has a record that parses, whose chunks cover its bytes and whose
    chain ends in a record that moves or is there. A kept commit's rows must list the tensors its
    manifest names (`manifest_tensors`, by manifest id; one that did not read is missing and unchecked
    here: sending its object says so): rows partly lost moved as they were, and the commit there
    could not be restored.
    """
    damaged: dict[TensorId, str] = {}
    records = found.tensor_records(damaged)
    held = {r.base_id for r in records.values() if r.base_id is not None} - sending
    for tid in sorted(sending - damaged.keys(), key=str):
        problem = chain_problem(records[tid], records, held) if tid in records else "it has no record"
        if problem is not None:
            damaged[tid] = problem
    listed: dict[str, list[str]] = {}
    for cid, tid in found.projected("commit_tensors", ("commit_id", "tensor_id")):
        listed.setdefault(cid, []).append(tid)
    pruned = found.column("pruned_commits", "commit_id")
    manifests = dict(found.projected("commits", ("id", "manifest_object")))
    for cid in commits:
        named = manifest_tensors.get(manifests[cid]) if cid not in pruned else None
        if named is not None and set(listed.get(cid, ())) != named:
            return cid, _listing_problem(set(listed.get(cid, ())), named)
        for tid in sorted(listed.get(cid, ()), key=str):  # a damaged row's id may not be text
            hit = _first_damaged(tid, records, damaged)
            if hit is not None:
                return cid, f"tensor {hit}: {damaged[hit]}"
    first = min(damaged, key=str, default=None)
    return None if first is None else (None, f"tensor {first}: {damaged[first]}")


def manifests_read(sender: Repository, manifests: set[ObjectId]
                   ) -> tuple[dict[ObjectId, set[TensorId]], dict[ObjectId, bytes]]:
    """The tensors each of `manifests` names, and the bytes of those kept for sending (up to MANIFESTS_KEPT).

    Read on the sender's threads, so a bucket's round trips overlap; the bytes kept are not read again
    to be sent. One that does not read is left out: it is an object's damage, which sending it says.
    """
    from ckptstore.repo.manifest import Manifest

    kept: dict[ObjectId, bytes] = {}
    room = [MANIFESTS_KEPT]
    keeping = threading.Lock()

    def named(oid: ObjectId) -> set[TensorId] | None:
        try:
            data = sender.read_object(oid)
            tids = {entry.tensor for entry in Manifest.from_bytes(data, oid).entries.values()}
        except StoreUnavailableError:  # not this object's damage: the next would wait out the retry budget again
            raise
        except CkptError:
            return None
        with keeping:
            if len(data) <= room[0]:
                room[0] -= len(data)
                kept[oid] = data
        return tids

    oids = sorted(manifests)
    return {oid: tids for oid, tids in zip(oids, sender.pool.map(named, oids)) if tids is not None}, kept


def _listing_problem(rows: set[str], named: set[TensorId]) -> str:
    """How a commit's rows (commit_tensors) disagree with its manifest, as counts and one tensor as example."""
    lost, extra = sorted(named - rows, key=str), sorted(rows - named, key=str)
    example = f"tensor {lost[0]} is not listed" if lost else f"tensor {extra[0]} is not in the manifest"
    return f"its rows (commit_tensors) list {len(rows)} tensors, its manifest {len(named)}: {example}"


def _first_damaged(tid: TensorId, records: dict[TensorId, TensorRecord], damaged: dict[TensorId, str]
                   ) -> TensorId | None:
    """The first tensor in `damaged` down `tid`'s chain (itself included), or None."""
    seen: set[TensorId] = set()
    current: TensorId | None = tid
    while current is not None and current not in seen:  # `seen`: a forged loop ends the walk
        if current in damaged:
            return current
        seen.add(current)
        record = records.get(current)
        current = record.base_id if record is not None else None
    return None


@dataclass
class Findings:
    """What the metadata check found: problems by what they are about, and every tensor a commit names."""

    problems: dict[str, str] = field(default_factory=dict)
    named_tensors: set[TensorId] = field(default_factory=set)
    unreadable_manifests: set[ObjectId] = field(default_factory=set)
    # commits whose manifests a newer ckptstore wrote (a version this one does not read): not damage, unchecked
    newer_manifests: dict[CommitId, ObjectId] = field(default_factory=dict)
    manifests: dict[CommitId, Manifest] = field(default_factory=dict)  # those read, for fsck's skeleton pass


def check_metadata(tx: Tx, store: ObjectStore, pruned_ids: bool = True) -> Findings:
    """Every disagreement among commits, refs, tensor records and manifests.

    Commit ids are recomputed from their rows; each readable manifest (its id is its hash, checked
    on read) must list the tensors its commit's rows list, and every tensor either names must
    have a record whose chunks and chain account for all its bytes. An unreadable manifest is
    object damage (fsck reports it as such), not a record problem. `pruned_ids` False skips the
    ids of pruned commits, for a gc that decides by the rows of what is live alone: it need not
    hash a long run's history each time. Where parents decide (prune's positions, unreachable
    commits), a pruned commit's damaged parent row would move what goes: those check them.
    """
    found = Findings()
    storage = liveness.storage_problems(tx)
    if storage:  # tables gone, and what SQLite's own integrity check finds
        found.problems["database"] = "; ".join(storage)
    unparsed: dict[str, str] = {}
    commits = commit_rows.all_commits(tx, unparsed)
    _commit_problems(tx, commits, found, pruned_ids)
    found.problems.update(unparsed)  # the cause, not the id mismatch that reading such a row without metrics makes
    listed = liveness.commit_tensor_lists(tx)
    for cid in sorted((c for c, info in commits.items() if info.pruned and listed.get(c)), key=str):
        found.problems.setdefault(f"commit {cid}", "it is marked pruned, yet its rows (commit_tensors) list tensors")
    entries = _manifest_entries(store, commits, found)
    for cid, by_path in sorted(entries.items(), key=_by_key):
        if {e.tensor for e in by_path.values()} != listed.get(cid, set()):
            found.problems.setdefault(f"commit {cid}", "its manifest and its rows (commit_tensors) list different "
                                                       "tensors")
    found.named_tensors = set().union(*listed.values(), *({e.tensor for e in es.values()} for es in entries.values()))
    damaged: dict[TensorId, str] = {}
    records = tensor_rows.load_records(tx, found.named_tensors, problems=damaged)
    sizes = tensor_rows.object_sizes(tx)
    for tid in sorted(found.named_tensors | set(damaged), key=str):
        problem = damaged.get(tid) or (chain_problem(records[tid], records) or _range_problem(records[tid], sizes)
                                       if tid in records else "it has no record")
        if problem is not None:
            found.problems[f"tensor {tid}"] = problem
    _entry_problems(entries, records, found)
    return found


def skeleton_problems(repo: Repository, manifests: dict[CommitId, Manifest]) -> dict[str, str]:
    """Commits whose files' stored structures (skeletons) checkout would refuse: damaged, or forged where made.

    Each torch file's skeleton is decoded as checkout decodes it, its tensors standing in by their
    manifest entries, and each safetensors or blob skeleton checked as checkout checks it: no tensor is
    read but a safetensors file's header (a few kilobytes, each distinct one once), so a pass over every
    commit stays cheap. A folder commit's file and empty-folder names are checked by checkout's rule first.
    """
    problems: dict[str, str] = {}
    headers: dict[TensorId, bytes | None] = {}
    for cid, manifest in sorted(manifests.items(), key=_by_key):
        unwritable = _unwritable_name(manifest)
        if unwritable is not None:
            problems[f"commit {cid}"] = unwritable
            continue
        for record in manifest.files:
            try:
                _check_skeleton(repo, manifest, record, headers)
            except CkptError as exc:
                what = f"file {record.name!r}" if record.name else "file"
                why = (f"{exc.what}: {exc.problem}" if isinstance(exc, CorruptRecordError)
                       else getattr(exc, "problem", exc))  # MalformedSkeletonError's, or an unknown tag's message
                problems[f"commit {cid}"] = (f"its manifest's stored structure of its {what} is damaged or forged "
                                             f"({why}): checkout cannot rebuild it")
                break
    return problems


def _unwritable_name(manifest: Manifest) -> str | None:
    """Why checkout refuses a folder commit's file or empty-folder name (outside the folder, git's), or None."""
    from ckptstore.formats.folder import unwritable_name

    if manifest.kind != "folder":  # a lone file's name is "", written where it was committed from
        return None
    named = [("file", record.name) for record in manifest.files] + [("folder", n) for n in manifest.empty_folders]
    for what, name in named:
        why = unwritable_name(name)
        if why is not None:
            return (f"its manifest names the {what} {name!r:.80}, which checkout refuses to write ({why}): it is "
                    "damaged or forged")
    return None


def _check_skeleton(repo: Repository, manifest: Manifest, record: CheckpointFile,
                    headers: dict[TensorId, bytes | None]) -> None:
    """Raise what checkout would of `record`'s skeleton; a safetensors header is read once per tensor id."""
    from ckptstore.formats import SAFETENSORS, TORCH
    from ckptstore.formats.skeletons import check_file_layout, check_headers, check_state_skeleton

    entry_of = manifest.entries.__getitem__
    check_file_layout(record, entry_of)
    if record.format == TORCH:
        check_state_skeleton(record.skeleton, entry_of, record.storage_bound)
    elif record.format == SAFETENSORS:
        tid = entry_of(record.skeleton[1]).tensor
        if tid not in headers:
            headers[tid] = _header_bytes(repo, manifest, record.skeleton[1])
        check_headers([record], entry_of, lambda _: headers[tid])


def _header_bytes(repo: Repository, manifest: Manifest, path: str) -> bytes | None:
    """The stored bytes at `path` (a safetensors header); None where they do not restore (fsck says why)."""
    from ckptstore.repo.checkout import restore

    try:
        return restore(repo, manifest, paths=[path])[path].data.tobytes()
    except CkptError:  # a lost object or a damaged record: the object and record checks report it
        return None


def _entry_problems(entries: dict[CommitId, dict[str, Entry]], records: dict[TensorId, TensorRecord],
                    found: Findings) -> None:
    """Manifest entries that are not the tensor their record is: the record's fault, or the manifest's.

    Where another commit's entry agrees with the record, the disagreeing manifest is at fault (a
    forged one, received), and its commit alone is broken; where none does, the record is.
    """
    agreeing: set[TensorId] = set()
    wrong: list[tuple[CommitId, str, Entry, str]] = []
    for cid, by_path in sorted(entries.items(), key=_by_key):
        for path, entry in sorted(by_path.items(), key=_by_key):
            problem = _fields_problem(entry, records[entry.tensor]) if entry.tensor in records else None
            if problem is None:
                agreeing.add(entry.tensor)
            else:
                wrong.append((cid, path, entry, problem))
    for cid, path, entry, problem in wrong:
        if entry.tensor in agreeing:
            found.problems.setdefault(f"commit {cid}", f"its manifest's entry at {path!r} is not tensor "
                                                       f"{str(entry.tensor)[:12]}: {problem}")
        else:
            found.problems.setdefault(f"tensor {entry.tensor}", f"{problem} (at {path!r} in commit {str(cid)[:12]})")


def _range_problem(record: TensorRecord, sizes: dict[ObjectId, int]) -> str | None:
    """A chunk record that reads past the end of its object (by the size recorded when it was written)."""
    for position, chunk in enumerate(record.chunks):
        size = sizes.get(chunk.object_id)
        if chunk.length is not None and size is not None and chunk.offset + chunk.length > size:
            return (f"its chunk {position} reads bytes {chunk.offset}-{chunk.offset + chunk.length} of object "
                    f"{chunk.object_id}, which holds {size}")
    return None


def _commit_problems(tx: Tx, commits: dict[CommitId, commit_rows.CommitInfo], found: Findings,
                     pruned_ids: bool = True) -> None:
    """Commits whose rows do not hash to their ids or name parents that have no record; refs to no commit."""
    for cid, info in sorted(commits.items(), key=_by_key):
        problem = info.id_problem() if pruned_ids or not info.pruned else None
        if problem is not None:
            found.problems[f"commit {cid}"] = problem
        for parent in info.parents:
            if parent not in commits:
                found.problems.setdefault(f"commit {cid}", f"its parent {parent} has no record")
    refs = liveness.all_refs(tx)
    kinds = {name: kind for name, kind, _, _ in refs}
    head = next((target for name, _, _, target in refs if name == "HEAD"), None)
    if "HEAD" not in kinds:
        found.problems["ref HEAD"] = "its record is missing"
    elif head is not None and kinds.get(head, "branch") != "branch":  # on a branch, or on a branch not yet born
        found.problems["ref HEAD"] = f"it is on {head!r}, which is a {kinds[head]}, not a branch"
    for name, kind, cid, target in refs:
        if kind not in ("branch", "tag", "head", "remote") or (kind == "head") != (name == "HEAD"):
            found.problems[f"ref {name}"] = f"it is of kind {kind!r}"
        elif kind == "head" and cid is None and not target:  # read as neither on a branch nor detached
            found.problems[f"ref {name}"] = "it names no branch and no commit"
        elif cid is not None and cid not in commits:
            found.problems[f"ref {name}"] = f"it points at commit {cid}, which has no record"
        elif cid is not None and commits[cid].pruned and kind in ("branch", "head"):  # prune keeps what they name
            found.problems[f"ref {name}"] = f"it points at commit {cid}, which is marked pruned"
        elif kind != "head" and cid is None:
            found.problems[f"ref {name}"] = "it points at no commit"
        elif kind != "head" and (problem := _name_problem(name, kind)):
            found.problems[f"ref {name}"] = problem


def _name_problem(name: str, kind: str) -> str | None:
    """Why a ref row's name is one no ckptstore writes (another client's forged row), or None.

    By the rules names are made by, less the length limit newer than some names (metadata keeps 255);
    a remote-tracking ref by its branch part (a remote may be named `remotes`).
    """
    if kind == "remote" and not (name.startswith("remotes/") and name.count("/") >= 2):
        return "its name is no remote-tracking ref's (remotes/REMOTE/BRANCH)"
    try:
        ref_names.check_form(name.split("/", 2)[2] if kind == "remote" else name, longest=METADATA_NAME)
    except InvalidRefNameError as exc:
        return f"its name is none a ref may have: {exc}"
    return None


def _manifest_entries(store: ObjectStore, commits: dict[CommitId, commit_rows.CommitInfo], found: Findings
                      ) -> dict[CommitId, dict[str, Entry]]:
    """Each commit's manifest entries, from the manifests that read; what a manifest says of its commit is checked."""
    from ckptstore.repo.manifest import Manifest, ManifestVersionError, UnreadableManifestError

    entries: dict[CommitId, dict[str, Entry]] = {}
    for cid, info in sorted(commits.items(), key=_by_key):
        if info.pruned:  # `ckpt prune` removed its manifest with its tensors on purpose
            continue
        try:
            manifest = Manifest.from_bytes(store.get(info.manifest_object), info.manifest_object)
        except ManifestVersionError:
            found.newer_manifests[cid] = info.manifest_object
            found.unreadable_manifests.add(info.manifest_object)
            continue
        except OSError:  # another user's file (PermissionError), a failing disk: the object check says it
            found.unreadable_manifests.add(info.manifest_object)
            continue
        except StoreUnavailableError:  # the bucket down: no manifest will read, each after a whole retry budget
            if not isinstance(store, FallbackStore):
                raise
            # a lazy clone's manifest not held here, its origin down: unchecked (the object check says so), and the
            # origin is not asked again for the next (reviewer 409)
            found.unreadable_manifests.add(info.manifest_object)
            continue
        except (CorruptObjectError, CkptError) as exc:
            found.unreadable_manifests.add(info.manifest_object)
            if isinstance(exc, UnreadableManifestError):  # its bytes whole: a lost or changed object is said as one
                found.problems.setdefault(f"commit {cid}", f"its manifest {info.manifest_object} does not read: "
                                                           f"{exc.problem}")
            continue
        entries[cid], found.manifests[cid] = manifest.entries, manifest
        if manifest.dcp is not None:
            from ckptstore.repo.sharded import dcp_problem

            problem = dcp_problem(manifest)
            if problem is not None:
                found.problems.setdefault(f"commit {cid}", problem)
        if manifest.kind != info.kind or (manifest.lossy or None) != (info.lossy or None):
            found.problems.setdefault(f"commit {cid}", f"its row says a {info.kind} commit (lossy {info.lossy}), its "
                                                       f"manifest a {manifest.kind} one (lossy {manifest.lossy})")
    return entries
