"""Sharded commits: many processes encode their own shards, one records them all (DESIGN.md section 6).

Torch-free: the DCP storage plugins (ckptstore/dcp/) turn DCP's write items into raw shards and
call these. Each rank runs `write_shards` for its shards (residuals against the same shard of
the parent commit); the coordinator runs `record_sharded` once, after every rank's objects are
durable, in one metadata transaction that moves the branch with compare-and-swap.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptstore import faults
from ckptstore.codecs.floats import first_with_nan
from ckptstore.errors import CkptError, UnquantizableError, UnquantizableTensorsError, with_reasons
from ckptstore.formats.dcpmeta import DCP_FORMAT_VERSION, chunk_problem
from ckptstore.hashing import CommitId, ObjectId, TensorId, tensor_id
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.metadata.commits import CommitInfo
from ckptstore.policy import LossyLevel
from ckptstore.policy.lossy_base import LossyPlan, plans_without
from ckptstore.policy.lossy_shards import PAIRING, Shard, ShardFacts, plan_shards
from ckptstore.records import Chunk, TensorRecord
from ckptstore.replay import ChainSource
from ckptstore.repo import received
from ckptstore.repo.commit import CommitOptions, encoding_jobs, parent_manifest
from ckptstore.repo.gcpause import no_cyclic_gc
from ckptstore.repo.manifest import Entry, Manifest
from ckptstore.repo.target import Start, move_ref
from ckptstore.repo.writer import encode_jobs
from ckptstore.state import RawTensor
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

KIND = commit_rows.SHARDED_KIND  # a sharded commit's kind (commit row and manifest)


def is_sharded(manifest: Manifest) -> bool:
    """True for the manifest of a sharded (DCP) commit."""
    return manifest.dcp is not None


@dataclass
class WrittenShard:
    """One shard as a rank wrote it: its manifest entry, its new record (None: already stored) and objects."""

    key: str
    entry: Entry
    record: TensorRecord | None
    objects: dict[ObjectId, int]
    raw_bytes: int
    at_level: bool = False  # stored at the save's lossy level (False: lossless, planned so or fallen back)
    measured: list | None = None  # its own [error, bound, codec] where it restores as an older record


@dataclass
class LossyShards:
    """What a rank needs to encode its shards lossily: the level, the coordinator's facts, each shard's place."""

    level: LossyLevel
    facts: ShardFacts
    shards: dict[str, Shard]  # by shard key


def _encode_shards(repo: Repository, shards: Mapping[str, RawTensor], ids: Mapping[str, TensorId],
                   base_of: Mapping[str, TensorRecord], chains: Mapping[TensorId, TensorRecord],
                   plans: dict[str, LossyPlan], level: LossyLevel | None, remeasured: dict[str, list],
                   false: Set[TensorId] = frozenset()
                   ) -> tuple[dict[str, TensorId], dict[str, TensorRecord], dict[ObjectId, int], dict[str, LossyPlan]]:
    """This rank's shards encoded: manifest ids known before, new records, object sizes, the plans kept.

    `remeasured` gets each lossy shard's own [error, bound, codec] where it restores as an older record; the
    shards in `false` (their received records lied) are encoded again.

    A shard its level cannot quantize stays lossless with the shards coded with it; NaN or inf keeps
    every shard of the rank lossless: a rank's save never fails for its values (repo/commit.py does
    the same for a whole checkpoint).
    """
    whole: dict[str, str] = {}
    nan = first_with_nan(shards) if plans else None
    if nan is not None:  # a shard the level keeps exact is seen by no codec: its NaN is said here
        warn_caller(f"this rank's shards hold values no step quantizes (NaN in {nan}): all stored lossless instead "
                    f"of at level {level.name!r}", RuntimeWarning)
        plans = {}
    while True:
        with repo.db.read() as tx:
            entries, jobs = encoding_jobs(repo, tx, shards, ids, base_of, chains, plans, level, false)
        try:
            remeasured.clear()  # of this round only
            with repo.store.batch():
                records, sizes = encode_jobs(jobs, ChainSource(repo.store, chains), repo.pool, remeasured=remeasured)
        except UnquantizableTensorsError as exc:
            whole.update(exc.reasons)
            plans = plans_without(plans, set(exc.reasons))
            continue
        except UnquantizableError as exc:  # NaN or inf (NonFiniteError): every shard of the rank, in one round
            warn_caller(f"this rank's shards hold values no step quantizes ({exc}): all stored lossless instead of "
                        f"at level {level.name!r}", RuntimeWarning)
            whole, plans = {}, {}
            continue
        if whole:
            warn_caller(f"{len(whole)} shard(s) cannot be quantized at level {level.name!r} ({with_reasons(whole)}): "
                        "stored lossless with the optimizer state coded with them and an Adam moment's other moment, "
                        "the rest at the level", RuntimeWarning)
        return entries, records, sizes, plans


def write_shards(repo: Repository, parent: CommitId | None, shards: Mapping[str, RawTensor],
                 lossy: LossyShards | None = None) -> list[WrittenShard]:
    """Encode this rank's shards and write their objects durably; nothing is recorded.

    A shard whose content is stored already is reused; the others become residuals against the
    parent commit's shard at the same key (same name, offsets and sizes) or keyframes. With
    `lossy`, the shards its level quantizes are planned as their whole tensors would be
    (policy/lossy_shards.py) and coded against the parent's reconstruction (closed loop), all of a
    tensor's shards or none (a tensor whose layout changed is keyframed whole); one whose original
    equals the parent's source keeps the parent's reconstruction.
    """
    with no_cyclic_gc():
        futures = {k: repo.pool.submit(tensor_id, r.dtype, r.shape, r.data) for k, r in shards.items()}
        ids = {k: f.result() for k, f in futures.items()}
        base_of, chains = _parent_records(repo, parent, list(shards))
        if lossy is not None:  # planned as the whole tensor: residuals for all its shards or for none
            base_of = {k: r for k, r in base_of.items() if k not in lossy.shards
                       or lossy.shards[k].fqn not in lossy.facts.keyframed}
        with repo.db.read() as tx:  # as a commit's: received records checked once (repo/received.py)
            base_of, false, true = received.check(repo, tx, set(ids.values()), base_of, chains)
        if true:  # those that lie leave the list once the coordinator records them anew
            with repo.db.write() as tx:
                tensor_rows.mark_checked(tx, true)
        plans = {} if lossy is None else plan_shards(shards, lossy.shards, lossy.facts, base_of, lossy.level,
                                                     repo.config.encoding)[0]
        remeasured: dict[str, list] = {}
        entries, records, sizes, plans = _encode_shards(repo, shards, ids, base_of, chains, plans,
                                                        lossy.level if lossy else None, remeasured, false)
    faults.point("dcp:rank-written")
    written = []
    for key, raw in shards.items():  # a lossy shard's job is by key, a lossless one's by content id
        record = records.get(key if key in plans else ids[key])
        tid = entries[key] if key in entries else record.id  # not in entries: a new lossy reconstruction
        objects = {c.object_id: sizes[c.object_id] for c in record.chunks if c.object_id in sizes} if record else {}
        written.append(WrittenShard(key, Entry(tid, raw.dtype, raw.shape), record, objects, raw.nbytes,
                                    key in plans, remeasured.get(key)))
    return written


def _parent_records(repo: Repository, parent: CommitId | None, keys: list[str]
                    ) -> tuple[dict[str, TensorRecord], dict[TensorId, TensorRecord]]:
    """(the parent's record at each of `keys` it has, every record down their chains)."""
    if parent is None:
        return {}, {}
    with repo.db.read() as tx:
        manifest = parent_manifest(repo, parent, commit_rows.manifest_object(tx, parent))
    if manifest is None:
        return {}, {}
    ids = {k: manifest.entries[k].tensor for k in keys if k in manifest.entries}
    with repo.db.read() as tx:
        chains = tensor_rows.load_records(tx, set(ids.values()))
    return {k: chains[t] for k, t in ids.items() if t in chains}, chains


def relaid_tensors(repo: Repository, parent: CommitId | None, keys: Mapping[str, str]) -> list[str]:
    """The tensors (of `keys`: shard key -> its tensor's FQN) with a shard the parent commit lacks, sorted.

    Nothing listed without a parent: every shard is a keyframe then.
    """
    if parent is None:
        return []
    with repo.db.read() as tx:
        manifest = parent_manifest(repo, parent, commit_rows.manifest_object(tx, parent))
    held = manifest.entries if manifest is not None else {}
    return sorted({fqn for key, fqn in keys.items() if key not in held})


def record_sharded(repo: Repository, start: Start, shards: list[WrittenShard], dcp: dict[str, Any],
                   options: CommitOptions, lossy: str | None = None) -> CommitId:
    """Record every rank's shards as one commit on `start`'s branch, moving it by compare-and-swap.

    `lossy` names the level the shards were planned at (None: lossless); a save none of whose shards
    stayed at it (every rank fell back to lossless) is recorded lossless, as a commit would be.

    Called once, by the coordinator, after every rank's objects are durable. Raises ConflictError
    when the branch moved meanwhile (nothing is recorded).
    """
    entries = {s.key: s.entry for s in shards}
    lossy = lossy if any(s.at_level for s in shards) else None
    if len(entries) != len(shards):
        raise CkptError("two ranks wrote the same shard; the save plan gave one item to two ranks")
    chosen: dict[TensorId, WrittenShard] = {}  # two ranks may both have written one content: keep one record
    for shard in shards:
        if shard.record is not None:
            chosen.setdefault(shard.record.id, shard)
    records = [s.record for s in chosen.values()]
    sizes: dict[ObjectId, int] = {}
    for shard in chosen.values():  # a pack holds several shards' payloads: its size is the furthest end
        for oid, size in shard.objects.items():
            sizes[oid] = max(sizes.get(oid, 0), size)
    measured = {s.key: s.measured for s in shards if s.measured}
    manifest = Manifest(KIND, [], entries, {}, lossy, PAIRING if lossy else None, dcp=dcp, measured=measured)
    manifest_bytes = manifest.to_bytes()
    manifest_oid = repo.store.put(manifest_bytes)
    sizes[manifest_oid] = len(manifest_bytes)
    faults.point("dcp:manifest-written")
    with repo.db.write() as tx:  # what is new is decided where it is recorded: no writer slips in between
        renewed, true = received.taken_over(repo, tx, records)  # the ranks encoded these anew
        info = CommitInfo(
            id=CommitId(""), manifest_object=manifest_oid, message=options.message,
            author=options.author, created_at=time.time(), step=options.step,
            metrics={str(k): float(v) for k, v in options.metrics.items()}, kind=KIND, source_path=None,
            raw_bytes=sum(s.raw_bytes for s in shards),
            stored_bytes=tensor_rows.newly_stored(tx, records, sizes, renewed),
            parents=[start.commit] if start.commit else [], lossy=lossy)
        info.id = info.computed_id()
        move_ref(tx, start, info.id)
        missing = ({e.tensor for e in entries.values()} - {r.id for r in records}
                   - tensor_rows.existing_tensor_ids(tx, {e.tensor for e in entries.values()}))
        if missing:  # a shard reused a tensor no record holds: recording it would make a commit that does not read
            raise CkptError(f"{len(missing)} shards name tensors that have no record (e.g. {sorted(missing)[0]}); "
                            "nothing was recorded: save again")
        tensor_rows.save_records(tx, records, sizes, replace=renewed)
        tensor_rows.mark_checked(tx, renewed | true)
        commit_rows.insert_commit(tx, info, [e.tensor for e in entries.values()])
    faults.point("dcp:ref-moved")
    return info.id


def record_to_json(record: TensorRecord) -> dict[str, Any]:
    """A record as plain data, to travel from a rank to the coordinator."""
    return {"id": record.id, "dtype": record.dtype, "shape": list(record.shape), "codec": record.codec,
            "params": record.params, "base_id": record.base_id, "depth": record.depth,
            "raw_bytes": record.raw_bytes, "stored_bytes": record.stored_bytes,
            "chunks": [[c.object_id, c.raw_bytes, c.offset, c.length, c.checksum] for c in record.chunks]}


def record_from_json(data: dict[str, Any]) -> TensorRecord:
    """The record `record_to_json` made."""
    return TensorRecord(
        id=TensorId(data["id"]), dtype=data["dtype"], shape=tuple(data["shape"]), codec=data["codec"],
        params=dict(data["params"]), base_id=TensorId(data["base_id"]) if data["base_id"] else None,
        depth=int(data["depth"]), raw_bytes=int(data["raw_bytes"]), stored_bytes=int(data["stored_bytes"]),
        chunks=[Chunk(ObjectId(o), r, off, length, checksum) for o, r, off, length, checksum in data["chunks"]])


def logical_tensors(dcp: dict[str, Any]) -> list[dict[str, Any]]:
    """What `show` lists of a sharded commit: each logical tensor's dtype, global shape and shard count."""
    check_format(dcp, "this commit's manifest")
    rows = []
    try:
        for item in dcp["items"]:
            if item["type"] == "tensor":
                rows.append({"fqn": item["fqn"], "dtype": item["dtype"], "shape": list(item["size"]),
                             "shards": len(item["chunks"])})
            else:
                rows.append({"fqn": item["fqn"], "dtype": "bytes", "shape": [], "shards": 1})
    except (KeyError, TypeError) as exc:
        raise CkptError(f"this commit's DCP metadata is missing or mangling a field ({exc!r}); run `ckpt fsck`"
                        ) from None
    return rows


def dcp_problem(manifest: Manifest) -> str | None:
    """Why a sharded manifest's DCP metadata disagrees with its entries (fsck), or None.

    Every stored item the metadata names must be an entry, a tensor chunk's entry of its dtype and
    the chunk's sizes, and every entry must be named: otherwise a load would miss or misplace bytes.
    """
    dcp = manifest.dcp or {}
    if dcp.get("version") != DCP_FORMAT_VERSION:
        return f"its DCP metadata has version {dcp.get('version')!r}, which this ckptstore does not know"
    named: set[str] = set()
    try:
        for item in dcp["items"]:
            if item["type"] != "bytes" and (problem := chunk_problem(item)) is not None:
                return f"its DCP metadata of {item['fqn']!r} is impossible: {problem}"
            chunks = ([(item["key"], "bytes", None)] if item["type"] == "bytes"
                      else [(key, item["dtype"], sizes) for _, sizes, key in item["chunks"]])
            for key, dtype, sizes in chunks:
                entry = manifest.entries.get(key)
                if entry is None:
                    return f"its DCP metadata names {key!r}, which is not among its entries"
                if entry.dtype != dtype or (sizes is not None and list(entry.shape) != list(sizes)):
                    return (f"entry {key!r} is a {entry.dtype} {list(entry.shape)}, its DCP metadata says "
                            f"{dtype} {sizes}")
                if key in named:  # a DCP directory stores each item apart: written out, one would be lost
                    return f"its DCP metadata names entry {key!r} twice"
                named.add(key)
    except (KeyError, TypeError, ValueError) as exc:
        return f"its DCP metadata is missing or mangling a field ({exc!r})"
    extra = set(manifest.entries) - named
    return f"entry {sorted(extra)[0]!r} is not named by its DCP metadata" if extra else None


def check_format(dcp: dict[str, Any], where: str) -> None:
    """Refuse a `dcp` section of a version this ckptstore does not know."""
    version = dcp.get("version")
    if version != DCP_FORMAT_VERSION:
        from ckptstore.repo.manifest import ManifestVersionError

        raise ManifestVersionError(f"{where} holds DCP metadata of version {version!r}, which this ckptstore "
                                   f"cannot read (it reads {DCP_FORMAT_VERSION}): upgrade ckptstore to load it")



def gather(repo: Repository, manifest: Manifest, fqns: Set[str] | None = None
           ) -> tuple[dict[str, RawTensor], list[str]]:
    """A sharded commit's logical tensors, whole, by fully qualified name; and the bytes items left out.

    `fqns` limits both to those names. Bytes items hold what DCP's planner serialized (pickles):
    ckptstore never unpickles them, so they are named, not returned.
    """
    import numpy as np

    from ckptstore.repo.checkout import restore

    problem = dcp_problem(manifest)
    if problem is not None:
        raise CkptError(f"a sharded commit's manifest cannot be gathered: {problem}; run `ckpt fsck`")
    items = [item for item in manifest.dcp["items"] if fqns is None or item["fqn"] in fqns]
    raws = restore(repo, manifest, paths=[key for item in items if item["type"] == "tensor"
                                          for _, _, key in item["chunks"]])
    tensors, skipped = {}, []
    for item in items:
        if item["type"] != "tensor":
            skipped.append(item["fqn"])
            continue
        size = tuple(item["size"])
        width = RawTensor(item["dtype"], (), np.empty(0, dtype=np.uint8)).itemsize
        whole = np.zeros((*size, width), dtype=np.uint8)  # elements as rows of bytes: any dtype, no torch
        for offsets, sizes, key in item["chunks"]:
            where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            whole[where] = raws[key].data.reshape(*sizes, width)
        tensors[item["fqn"]] = RawTensor(item["dtype"], size, whole.reshape(-1))
    return tensors, skipped
