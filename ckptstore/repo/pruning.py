"""`prune`: remove the commits a retention policy does not keep and give their space back.

A pruned commit keeps its row (id, parents, message, metrics: commit ids hash their parents, so
the ids of the commits after it stay valid) and loses its manifest and the tensors only it
needed; `log` marks it, checkout refuses it. Kept tensors whose delta chains ran through removed
tensors are encoded again first, as a residual on the nearest kept tensor down their chain or
as a keyframe, always losslessly from the bytes they restore to (a lossy tensor's
reconstruction), so every kept commit restores the same bits. In order, each step durable
before the next: (1) the new encodings are written as objects; (2) one metadata transaction
marks the commits pruned and switches the tensors to their new records; (3) what no commit
needs any more is deleted, as gc does. A crash before (2) leaves only unreferenced objects;
after it, only garbage; running prune again completes the work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ckptstore import faults
from ckptstore.errors import (
    CkptError,
    ConflictError,
    LostLockError,
    RepoLockedError,
    RetentionError,
    UnknownMetricError,
    explain,
)
from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata import Tx, liveness
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import refs as ref_rows
from ckptstore.metadata import retention as retention_rows
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore.fallback import FallbackStore
from ckptstore.objectstore.memory import MemoryObjectStore
from ckptstore.policy import ChainCosts, EncodingSettings, chain_limit, chunk_sizes
from ckptstore.policy.lossless import LOSSLESS_CODEC
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay
from ckptstore.repo.chaincost import auto_costs
from ckptstore.repo.compaction import compact
from ckptstore.repo.config import RetentionPolicy
from ckptstore.repo.retention import History, doomed
from ckptstore.repo.writer import Job, encode_jobs
from ckptstore.state import RawTensor
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from pathlib import Path

    from ckptstore.objectstore import ObjectStore
    from ckptstore.repo.maintenance import GcReport
    from ckptstore.repo.repository import Repository

_TOLD_UNKNOWN: set[tuple[Path, str]] = set()  # (repository, metric) whose keep_best this process warned of once
BATCH_BYTES = 256 << 20  # raw bytes re-encoded at once: their restored bytes are held in memory
# a lossy tensor's bookkeeping that stays true of its bytes, and the codec that measured them (show's figures)
KEPT_PARAMS = ("source", "rel_error", "max_error", "measured_as")


@dataclass
class PruneReport:
    """What `prune` removed (or, with `dry_run`, would remove) and the object bytes before and after."""

    pruned: list[CommitId] = field(default_factory=list)
    tensors_reencoded: int = 0  # a dry run: the candidates (a prune re-encodes those it pays to)
    bytes_before: int = 0
    bytes_after: int | None = None  # None for a dry run, and for the policy after a commit (no store listing)
    objects_removed: int = 0
    tensors_removed: int = 0
    dry_run: bool = False


def prune(repo: Repository, policy: RetentionPolicy | None = None, dry_run: bool = False, wait: bool = True,
          only_if_doomed: bool = False) -> PruneReport:
    """Prune the commits `policy` (default: the config's `[retention]`) does not keep; see the module docstring.

    Holds the repository lock alone, as gc does (`wait` False: RepoLockedError when it is busy).
    `dry_run` changes nothing and takes no lock. `only_if_doomed` returns without collecting
    garbage when no commit is to be removed (the policy applied after each commit).
    """
    policy = policy if policy is not None else repo.config.retention
    if not policy.active:
        raise CkptError("prune needs a rule saying what to keep: --keep-last N, --keep-every K, --keep-best "
                        "METRIC[:min|max] or --keep-tagged (or a [retention] section in .ckpt/config.toml)")
    report = PruneReport(dry_run=dry_run)
    if dry_run:
        report.bytes_before = _store_bytes(repo)
        with repo.db.read() as tx:
            _refuse_damage(repo, tx)  # as the prune itself would: the dry run listed what it then refused
            gone = _doomed(tx, policy)
            kept, bases = retention_rows.listed_tensors(tx, gone), retention_rows.all_bases(tx)
            report.pruned, report.tensors_reencoded = sorted(gone), len(_relinks(kept, bases))
        return report
    from ckptstore.repo.maintenance import clear_tmp_for_room

    clear_tmp_for_room(repo, "prune", wait)  # a full disk's leftovers first: the prune's database write needs room
    with repo.lock(exclusive=True, wait=wait):
        with repo.db.read() as tx:
            gone = _doomed(tx, policy)
            if only_if_doomed and not gone:  # the policy after a commit: no store listing when nothing goes
                return report
            if not only_if_doomed:  # a listing of the whole store: not after every commit
                report.bytes_before = _store_bytes(repo)
            _refuse_damage(repo, tx)
            layout = _layout(tx, gone)
            relinks = _relinks(layout.kept, layout.bases)
            records = tensor_rows.load_records(tx, set(relinks) | {b for b in relinks.values() if b})
        new_records, sizes = _reencode(repo, relinks, records, layout)
        staying = _live(layout, {r.id: r.base_id for r in new_records}) - {r.id for r in new_records}
        moved, moved_sizes = compact(repo, layout.chunks, staying)
        faults.point("prune:objects-written")
        with repo.db.write() as tx:
            if _doomed(tx, policy) != gone:
                raise ConflictError("refs moved while prune ran (a branch or tag was created, moved or deleted); "
                                    "nothing was removed: run prune again")
            retention_rows.mark_pruned(tx, gone, time.time())
            tensor_rows.replace_records(tx, new_records + moved, {**sizes, **moved_sizes})
            _record_depths(tx, layout, new_records, staying)
        faults.point("prune:db-committed")
        collected = _clean_up(repo, len(gone))
    report.pruned, report.tensors_reencoded = sorted(gone), len(new_records)
    report.objects_removed, report.tensors_removed = collected.objects_removed, collected.tensors_removed
    report.bytes_after = _store_bytes(repo) if not only_if_doomed else None
    return report


def _clean_up(repo: Repository, pruned: int) -> GcReport:
    """Collect after a recorded prune: a failure says the prune stands and `ckpt gc` finishes it."""
    from ckptstore.repo.maintenance import collect

    try:
        return collect(repo)
    except LostLockError as exc:
        if exc.deleting:  # gc's own line names an object deleted as the lock went, and says to run fsck
            raise LostLockError(f"the prune of {pruned} commit(s) was recorded, but its clean-up stopped: {exc} "
                                "(`ckpt gc` deletes what the prune freed)", exc.ended, deleting=True) from None
        raise LostLockError(f"the prune of {pruned} commit(s) was recorded, but the repository lock on "
                            f"{repo.db.where} was lost before its clean-up ({exc.ended}): run `ckpt gc` to "
                            "delete what it freed", exc.ended) from None
    except Exception as exc:  # a full disk in gc's own write: "nothing changed" would be untrue
        said = explain(exc)
        if said is None:
            raise
        raise CkptError(f"the prune of {pruned} commit(s) was recorded, but its clean-up failed: "
                        f"{_first_clause(str(said))}; run `ckpt gc` to delete what it freed") from exc


def _first_clause(message: str) -> str:
    """A failure's what, without its advice (a full disk's "nothing was lost: the write is undone" is not so here)."""
    return message.split("; ", 1)[0]


def after_commit(repo: Repository, cid: CommitId) -> CommitId:
    """Apply the config's `[retention]` policy, if any, once commit `cid` is recorded; return `cid`.

    It does not wait for the lock: another writer holding it is committing, and its own policy
    run (or the next commit's) prunes instead.
    """
    if not repo.config.retention.active:
        return cid
    try:
        prune(repo, only_if_doomed=True, wait=False)
    except RepoLockedError:  # another writer's own policy run (or the next commit's) prunes instead
        pass
    except UnknownMetricError:  # not logged yet (eval every 500 steps): prune later; a misspelt name never does
        metric = repo.config.retention.best()[0]
        if (repo.root, metric) not in _TOLD_UNKNOWN:
            _TOLD_UNKNOWN.add((repo.root, metric))
            warn_caller(f"[retention] keep_best names metric {metric!r}, which no commit records yet: nothing is "
                        "pruned until one does (a name misspelt in .ckpt/config.toml never will; `ckpt show` lists "
                        "a commit's metrics)")
    except Exception as exc:  # a full disk's OSError too: whatever failed, the commit is recorded, and says so
        raise RetentionError(cid, explain(exc) or exc) from exc
    return cid


def _store_bytes(repo: Repository) -> int:
    return sum(size for _, size in repo.store.iter_sizes())


def _doomed(tx: Tx, policy: RetentionPolicy) -> set[CommitId]:
    """The commits `policy` removes, from the refs and commit rows in `tx`."""
    protected = {cid for _, kind, cid, _ in liveness.all_refs(tx)
                 if cid is not None and (kind != ref_rows.TAG or policy.keep_tagged)}
    # parents and pruned flags alone, metrics only for keep_best: after each commit, not whole records of a long run
    history = History(ref_rows.refs_of_kind(tx, ref_rows.BRANCH), commit_rows.all_parents(tx),
                      commit_rows.all_metrics(tx) if policy.best() else {}, protected, commit_rows.pruned_ids(tx))
    return doomed(history, policy)


def _refuse_damage(repo: Repository, tx: Tx) -> None:
    """Re-encode and delete nothing while the records that say what kept commits need are damaged (as gc)."""
    from ckptstore.repo import integrity
    from ckptstore.repo.maintenance import missing_objects, refusal, refuse_newer

    findings = integrity.check_metadata(tx, repo.store)  # pruned rows too: their parents place what is kept
    problems = dict(findings.problems)  # and a kept commit's manifest or object lost: prune would keep nothing whole
    newer = set(findings.newer_manifests.values())  # unread, but no damage: said apart, once there is none
    problems.update({f"manifest {oid}": "unreadable" for oid in sorted(findings.unreadable_manifests, key=str)
                     if oid not in newer})
    _, live_objects = liveness.live(tx, findings.named_tensors)
    problems.update(missing_objects(repo, live_objects - findings.unreadable_manifests, repo.store.iter_ids()))
    if problems:
        raise refusal(problems, repo.db.where, "prune")
    refuse_newer(list(findings.newer_manifests), "prune")


def _relinks(kept: set[TensorId], bases: Mapping[TensorId, TensorId | None]) -> dict[TensorId, TensorId | None]:
    """Tensors the kept commits need whose base no kept commit lists: each with its new base (None: keyframe).

    `kept` are the tensors the kept commits list, `bases` every record's base. The new base is the
    first tensor down the old chain that a kept commit lists, so it stays. Where none is, tensors
    whose old chains end on the same removed tensor (residuals on one anchor, policy/lossless.py)
    keep sharing one: the first of them becomes a keyframe and the others residuals on it.
    """
    relinks: dict[TensorId, TensorId | None] = {}
    orphans: dict[TensorId, list[TensorId]] = {}  # by the removed tensor their old chains end on
    for tid in kept:
        below = bases.get(tid)
        if below is None or below in kept:
            continue
        seen, bottom = {tid}, below
        while below is not None and below not in kept and below not in seen:  # a loop is fsck's to report
            seen.add(below)
            bottom, below = below, bases.get(below)
        if below in kept:
            relinks[tid] = below
        else:
            orphans.setdefault(bottom, []).append(tid)
    for group in orphans.values():
        first, *rest = sorted(group, key=str)
        relinks[first] = None
        relinks.update(dict.fromkeys(rest, first))
    return relinks


@dataclass
class _Layout:
    """What decides which relinks pay: the kept tensors, every record's base and objects, and object sizes."""

    kept: set[TensorId]
    bases: dict[TensorId, TensorId | None]
    chunks: dict[TensorId, list[tuple[ObjectId, int | None]]]  # (object, payload length or None: all of it)
    sizes: dict[ObjectId, int]


def _layout(tx: Tx, gone: set[CommitId]) -> _Layout:
    return _Layout(retention_rows.listed_tensors(tx, gone), retention_rows.all_bases(tx),
                   retention_rows.chunk_objects(tx), tensor_rows.object_sizes(tx))


def _reencode(repo: Repository, relinks: Mapping[TensorId, TensorId | None], records: Mapping[TensorId, TensorRecord],
              layout: _Layout) -> tuple[list[TensorRecord], dict[ObjectId, int]]:
    """New records for the relinks that give space back, their objects written durably; nothing recorded yet.

    A first pass encodes every relink into memory to learn its size; a relink is kept where the
    objects it frees (whole objects: a pack lives while any of its payloads does) outweigh its new
    bytes (a lossy residual stored again losslessly often does not). The second pass writes those.
    Both chain as the repository's costs allow (`max_chain = "auto"`), read once here.
    """
    costs = auto_costs(repo) if any(relinks.values()) else None  # keyframes only: no chain to limit
    memory = MemoryObjectStore()
    trial = FallbackStore(memory, lambda: repo.store)  # reads fall through to the repository's objects

    def forget_copies(written: set[ObjectId]) -> None:  # objects copied in for reading: memory is bounded by a batch
        memory.objects = {oid: data for oid, data in memory.objects.items() if oid in written}

    measured, _ = _encode_relinks(repo, trial, relinks, records, costs, forget_copies)
    worth = _paying(relinks, measured, layout)
    if not worth:
        return [], {}
    new, sizes = _encode_relinks(repo, repo.store, {t: relinks[t] for t in worth}, records, costs)
    return list(new.values()), sizes


def _paying(relinks: Mapping[TensorId, TensorId | None], measured: Mapping[TensorId, TensorRecord],
            layout: _Layout) -> set[TensorId]:
    """The relinks whose freed bytes outweigh their new bytes, to a fixpoint (dropping one frees less for others).

    A dead payload in a pack counts as freed: the pack is compacted (`_compact`) if it stays.
    """
    chosen = set(measured)
    skipped = {t: _skipped(t, relinks[t], layout) for t in chosen}  # old chains: the same on every pass
    while chosen:
        live = _live(layout, {t: relinks[t] for t in chosen}) - chosen
        whole = {o for t in live for o, n in layout.chunks.get(t, []) if n is None}
        dropped = {t for t in chosen if measured[t].stored_bytes >= sum(
            layout.sizes.get(o, 0) if n is None else n
            for link in skipped[t] if link not in live
            for o, n in layout.chunks.get(link, []) if n is not None or o not in whole)}
        if not dropped:
            break
        chosen -= dropped
    return chosen


def _live(layout: _Layout, relinked: Mapping[TensorId, TensorId | None]) -> set[TensorId]:
    """The tensors the kept commits need once `relinked` tensors have their new bases."""
    live, frontier = set(layout.kept), set(layout.kept)
    while frontier:
        frontier = {b for t in frontier if (b := relinked[t] if t in relinked else layout.bases.get(t))} - live
        live |= frontier
    return live


def _record_depths(tx: Tx, layout: _Layout, new_records: list[TensorRecord], staying: set[TensorId]) -> None:
    """The residuals above a re-encoded tensor keep their rows: record their depths, shorter with its chain.

    Left as they were, the next commit counted their chains from the old depths and keyframed early.
    """
    bases = {**layout.bases, **{r.id: r.base_id for r in new_records}}
    recorded = retention_rows.all_depths(tx)
    depths = _depths(bases, staying | {r.id for r in new_records})
    retention_rows.set_depths(tx, {t: d for t, d in depths.items() if recorded.get(t) != d})


def _depths(bases: Mapping[TensorId, TensorId | None], tensors: set[TensorId]) -> dict[TensorId, int]:
    """Each of `tensors`' links down to its keyframe along `bases` (a loop, fsck's to report, is left out)."""
    depths: dict[TensorId, int] = {}
    for start in tensors:
        chain, current = [], start
        while current is not None and current not in depths and current not in chain:
            chain.append(current)
            current = bases.get(current)
        if current is not None and current not in depths:
            continue
        below = -1 if current is None else depths[current]
        for tid in reversed(chain):
            below += 1
            depths[tid] = below
    return depths


def _skipped(tid: TensorId, new_base: TensorId | None, layout: _Layout) -> list[TensorId]:
    """`tid` and the links of its old chain above `new_base`."""
    found: list[TensorId] = []
    current: TensorId | None = tid
    while current is not None and current != new_base and current not in found:
        found.append(current)
        current = layout.bases.get(current)
    return found


def _encode_relinks(repo: Repository, store: ObjectStore, relinks: Mapping[TensorId, TensorId | None],
                    records: Mapping[TensorId, TensorRecord], costs: dict[int, ChainCosts] | None,
                    after_batch: Callable[[set[ObjectId]], None] | None = None
                    ) -> tuple[dict[TensorId, TensorRecord], dict]:
    """Encode the `relinks` tensors bases first into `store`; their new records and object sizes.

    `costs` are the repository's decode costs (`max_chain = "auto"`, else None). `after_batch` is
    told, after each batch, every object written so far.
    """
    new: dict[TensorId, TensorRecord] = {}
    sizes: dict[ObjectId, int] = {}
    pending = dict(relinks)
    while pending:
        ready = sorted((t for t, base in pending.items() if base not in pending), key=str)
        if not ready:
            raise CkptError("tensor chains loop; run `ckpt fsck`")
        for batch in _batches(ready, records):
            restored = replay(ChainSource(store, records), [records[t] for t in batch], repo.pool)
            merged = {**records, **new}
            jobs = [_job(records[t], restored[t], merged.get(relinks[t]), repo.config.encoding, costs)
                    for t in batch]
            with store.batch():  # durable before the transaction that names them
                encoded, written = encode_jobs(jobs, ChainSource(store, merged), repo.pool)
            new.update({TensorId(key): record for key, record in encoded.items()})
            sizes.update(written)
            if after_batch is not None:
                after_batch(set(sizes))
        for tid in ready:
            del pending[tid]
    return new, sizes


def _batches(ready: list[TensorId], records: Mapping[TensorId, TensorRecord]) -> list[list[TensorId]]:
    """`ready` cut into runs of at most BATCH_BYTES raw bytes (a larger tensor alone)."""
    batches: list[list[TensorId]] = [[]]
    total = 0
    for tid in ready:
        if batches[-1] and total + records[tid].raw_bytes > BATCH_BYTES:
            batches.append([])
            total = 0
        batches[-1].append(tid)
        total += records[tid].raw_bytes
    return [b for b in batches if b]


def _job(record: TensorRecord, data: np.ndarray, base: TensorRecord | None, settings: EncodingSettings,
         costs: dict[int, ChainCosts] | None) -> Job:
    """The lossless encoding job of `record`'s restored bytes: a residual on `base` where its layout allows."""
    raw = RawTensor(record.dtype, tuple(record.shape), data)
    width = raw.itemsize
    # cut as it is cut now, whatever [encoding] chunk_bytes says today: tensors stored on it replay chunk by chunk
    params = {"width": width, "level": settings.zstd_level,
              "chunk_bytes": _own_chunk_bytes(record, width, max(width, settings.chunk_bytes // width * width))}
    params.update({k: record.params[k] for k in KEPT_PARAMS if k in record.params})
    if "rel_error" in params:
        params.setdefault("measured_as", record.codec)
    usable = base is not None and _usable(record, base, width, chain_limit(settings.max_chain, width, costs))
    return Job(record.id, raw, LOSSLESS_CODEC, params, base if usable else None, known_id=record.id)


def _usable(record: TensorRecord, base: TensorRecord, width: int, limit: int) -> bool:
    """Whether `record` can be a residual on `base`: same dtype and size, chunks that line up, room in the chain.

    `limit` is the longest chain the re-encoded tensor may join: the user's max_chain, or the measured rule's.
    """
    chunk = base.params.get("chunk_bytes")
    return (base.dtype == record.dtype and base.raw_bytes == record.raw_bytes > 0
            and base.depth + 1 <= limit and isinstance(chunk, int) and chunk > 0
            and chunk % width == 0
            and chunk_sizes(record.raw_bytes, chunk) == base.cut() == record.cut())


def _own_chunk_bytes(record: TensorRecord, width: int, default: int) -> int:
    """The chunk size that cuts `record` into the chunks it has (`default` where none of the candidates does)."""
    sizes = record.cut()
    for candidate in (record.params.get("chunk_bytes"), sizes[0] if sizes else None):
        if (isinstance(candidate, int) and candidate > 0 and candidate % width == 0
                and chunk_sizes(record.raw_bytes, candidate) == sizes):
            return candidate
    return default
