"""`CkptStorageWriter`: `dcp.save` from N ranks makes one commit.

The coordinator picks the parent (the branch tip) while planning and holds the repository lock
shared until the commit is recorded, so gc cannot remove objects a rank has written but not yet
reported. Each rank encodes its own items against the parent's same shard (repo/sharded.py)
and sends its records back in WriteResult.storage_data; the coordinator records everything in
one metadata transaction in `finish`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.dcp.planner import STATS_KEY
from ckptstore.dcp.repos import RepoHandle
from ckptstore.errors import CkptError
from ckptstore.formats import dcpmeta
from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.policy import LossyLevel, level_named, lossy_shards
from ckptstore.policy.lossy_shards import Shard, ShardFacts, ShardStats
from ckptstore.repo import sharded
from ckptstore.repo.commit import CommitOptions
from ckptstore.repo.manifest import Entry
from ckptstore.repo.pruning import after_commit
from ckptstore.repo.repository import Repository
from ckptstore.repo.target import start_now
from ckptstore.state import RawTensor, raw_from_bytes, raw_from_torch

_OVERLAP_GRACE_S = 2.0  # how long a new save waits for the previous save's thread to end


class CkptStorageWriter(StorageWriter):
    """Write a DCP checkpoint as one commit on `branch` (default: HEAD's) of the repository at `repo_or_path`.

    After `dcp.save`, the coordinator's `commit_id` names the commit (None on other ranks) and each
    rank's `bytes_written` counts the bytes it stored. The coordinator holds the repository lock
    shared from planning until `finish` (gc waits); when another rank fails, DCP never calls
    `finish`, and the lock is held until this writer's next save starts, or it is closed or collected.
    With `lossy` (a level), pass `planner=CkptSavePlanner()` to `dcp.save` on every rank.

    `dcp.async_save(state, storage_writer=writer)` works as `dcp.save` does: DCP's default stager
    copies the state first, and the commit is recorded on the save's own thread; one writer makes
    one save at a time (wait for the future before reusing it). With torch's process checkpointer the
    commit is made in that process, and `commit_id` stays None in this one.
    """

    def __init__(self, repo_or_path: Any, branch: str | None = None, message: str = "", step: int | None = None,
                 metrics: dict[str, float] | None = None, author: str | None = None,
                 lossy: str | LossyLevel | None = None) -> None:
        super().__init__()
        self.level = level_named(lossy)  # a lossy level needs dcp.save(..., planner=CkptSavePlanner())
        self._handle = RepoHandle(repo_or_path, read_only=False)
        self.options = CommitOptions(message=message, step=step, metrics=dict(metrics or {}), branch=branch,
                                     allow_empty=True, author=author)
        self.is_coordinator = False
        self.commit_id: CommitId | None = None
        self.bytes_written = 0  # by this rank in the last save: the stored bytes of the shards it encoded
        self._held = contextlib.ExitStack()
        self._start: sharded.Start | None = None
        self._saving: threading.Thread | None = None  # the thread of the save in progress

    def __getstate__(self) -> dict[str, Any]:
        """What travels to async_save's checkpoint process: the repository by path, no lock, no thread."""
        state = dict(self.__dict__)
        where = self._handle.where
        state["_handle"] = RepoHandle(where.root if isinstance(where, Repository) else where, read_only=False)
        state.update(_held=contextlib.ExitStack(), _start=None, _saving=None, commit_id=None)
        return state

    @property
    def repo(self) -> Any:
        return self._handle.repo

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new save names a repository (its folder) as `checkpoint_id`; DCP calls this only when one is given."""
        self._begin()
        self._handle.switch(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every save starts here, with or without a checkpoint_id: forget the last save's commit and lock."""
        self._begin()
        self.is_coordinator = is_coordinator

    def _begin(self) -> None:
        """Start a save on this thread; refuse one that overlaps a save still running on another (dcp.async_save).

        `async_save` runs each save on a thread of its own; two at once through one writer would
        share its lock and its parent commit. A save that failed elsewhere (another rank, the
        planner) never reached `close`: its thread has ended (async_save), or it ran on the main
        thread (dcp.save), which is starting this one; its lock is released here.
        """
        running = self._saving  # set while a save runs; `close` (its end, or its failure here) clears it
        if running not in (None, threading.current_thread(), threading.main_thread()) and running.is_alive():
            running.join(timeout=_OVERLAP_GRACE_S)  # the previous save's thread may be just winding down
            if running.is_alive():
                raise CkptError("this CkptStorageWriter is still saving the previous checkpoint (dcp.async_save): "
                                "wait for that save's future before the next save, or give each save its own writer")
        self._held.close()
        self._start, self.commit_id, self._saving = None, None, threading.current_thread()

    def storage_meta(self) -> StorageMeta | None:
        """Nothing storage-specific: the commit records who saved it, when, and where it went."""
        return None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: take the lock before any rank writes, and tell every rank the parent commit."""
        self._held.close()
        self._held.enter_context(self.repo.lock())
        self._start = start_now(self.repo, self.options.branch)
        facts = None if self.level is None else _facts(plans, self.level)
        if facts is not None:  # a tensor whose layout changed is planned as a keyframe on every rank
            tensors = {_key(i): i.index.fqn for p in plans for i in p.items if i.type != WriteItemType.BYTE_IO}
            facts.keyframed = sharded.relaid_tensors(self.repo, self._start.commit, tensors)
        return [dataclasses.replace(p, storage_data={"parent": self._start.commit,
                                                     "facts": facts and facts.to_json()}) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Encode this rank's items and write their objects durably (the commit comes in `finish`)."""
        if getattr(planner, "_enable_plan_caching", False):
            self.close()
            # a cached plan is the first save's, storage_data and all: later saves would encode
            # against the commit that first save started from
            raise CkptError("CkptStorageWriter cannot save with a planner made with enable_plan_caching=True: each "
                            "save's plan names the commit it starts from; leave plan caching off")
        if not isinstance(plan.storage_data, dict) or "parent" not in plan.storage_data:
            raise CkptError("the save plan did not pass through CkptStorageWriter.prepare_global_plan: "
                            "every rank must save with a CkptStorageWriter")
        items = {_key(item): item for item in plan.items}
        try:
            shards = {key: _raw(item, planner) for key, item in items.items()}
            lossy = None
            if self.level is not None and plan.storage_data.get("facts") is not None:
                lossy = sharded.LossyShards(self.level, ShardFacts.from_json(plan.storage_data["facts"]),
                                            {key: _shard(item) for key, item in items.items()
                                             if item.type != WriteItemType.BYTE_IO})
            written = sharded.write_shards(self.repo, plan.storage_data["parent"], shards, lossy)
        except BaseException:
            self.close()  # the save is over: `finish` will not come to release the lock
            raise
        if not self.is_coordinator:
            self.close()  # its part is durable; a repository opened here keeps threads and connections
        self.bytes_written = sum({w.record.id: w.record.stored_bytes for w in written if w.record}.values())
        results = [WriteResult(index=items[w.key].index, size_in_bytes=w.raw_bytes, storage_data=_report(w))
                   for w in written]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: record every rank's shards and DCP's metadata as one commit, then release the lock.

        Then the config's `[retention]` policy prunes, as after an ordinary commit: only the
        coordinator runs `finish`, once per save, so it prunes once, never on every rank.
        """
        try:
            if self._start is None:
                raise CkptError("finish came before prepare_global_plan: this writer was not the coordinator")
            shards = [_written(r.storage_data) for rank in results for r in rank]
            described = dcpmeta.to_json(metadata)
            planned = {c[2] for i in described["items"] if i["type"] == "tensor" for c in i["chunks"]}
            planned |= {i["key"] for i in described["items"] if i["type"] == "bytes"}
            if planned != {s.key for s in shards}:
                raise CkptError(f"the ranks wrote {len(shards)} items, DCP's metadata describes {len(planned)}: "
                                "nothing was recorded")
            metadata.storage_data = {r.index: r.storage_data["key"] for rank in results for r in rank}
            self.commit_id = sharded.record_sharded(self.repo, self._start, shards, described, self.options,
                                                    self.level.name if self.level else None)
            self._held.close()  # the lock: [retention]'s prune takes it alone
            after_commit(self.repo, self.commit_id)  # its failure says the commit was recorded
        finally:
            self.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a folder holding a ckptstore repository."""
        return os.path.isdir(os.path.join(os.fspath(checkpoint_id), ".ckpt"))

    def close(self) -> None:
        """Release the lock and the repository this writer opened; this rank's part of the save is over."""
        self._held.close()
        self._handle.close()
        self._saving = None


def _facts(plans: list[SavePlan], level: LossyLevel) -> ShardFacts:
    """The coordinator's whole-tensor facts from every rank's shard sums (which CkptSavePlanner put in its plan)."""
    stats: dict[Shard, ShardStats] = {}
    dtypes: dict[str, str] = {}
    sizes: dict[str, tuple[int, ...]] = {}
    lrs: dict[str, float] = {}
    names: set[str] = set()
    for plan in plans:
        data = plan.storage_data
        if not isinstance(data, dict) or STATS_KEY not in data:
            raise CkptError("a lossy CkptStorageWriter plans each tensor from the whole tensor's statistics, which "
                            "only its planner gathers: call dcp.save(..., planner=ckptstore.dcp.CkptSavePlanner()) "
                            "on every rank")
        for fqn, offsets, shard_sizes, sum_sq, total, count, (positions, values) in data[STATS_KEY]:
            stats[Shard(fqn, tuple(offsets), tuple(shard_sizes))] = ShardStats(sum_sq, total, count,
                                                                               dict(zip(positions, values)))
        lrs = lrs or dict(data.get("lrs") or {})
        for item in plan.items:
            names.add(item.index.fqn)
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                dtypes[item.index.fqn] = str(item.tensor_data.properties.dtype)
                sizes[item.index.fqn] = tuple(item.tensor_data.size)
    return lossy_shards.combine(stats, dtypes, sizes, lrs, level, lossy_shards.optimizer_prefixes(names))


def _shard(item: WriteItem) -> Shard:
    chunk = item.tensor_data.chunk
    return Shard(item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))


def _key(item: WriteItem) -> str:
    if item.type == WriteItemType.BYTE_IO:
        return dcpmeta.bytes_key(item.index.fqn)
    chunk = item.tensor_data.chunk
    return dcpmeta.shard_key(item.index.fqn, list(chunk.offsets), list(chunk.sizes))


def _raw(item: WriteItem, planner: SavePlanner) -> RawTensor:
    """The bytes to store for one write item: a bytes item's skeleton (or DCP's pickle), or a tensor shard's elements.

    A bytes item of plain data (numbers, strings, containers) is stored as ckptstore's JSON
    skeleton, never as a pickle; only one the skeleton cannot hold keeps DCP's own pickle.
    """
    if item.type == WriteItemType.BYTE_IO:
        skeleton = _skeleton(item, planner)
        if skeleton is not None:
            return raw_from_bytes(skeleton)
        data = planner.resolve_data(item)
        if not isinstance(data, io.BytesIO):
            raise CkptError(f"{item.index.fqn}: DCP handed a {type(data).__name__} for a bytes item")
        return raw_from_bytes(bytes(data.getbuffer()))
    data = planner.resolve_data(item)
    if hasattr(data, "to_local"):  # a DTensor: this rank's shard
        data = data.to_local()
    if not isinstance(data, torch.Tensor):
        raise CkptError(f"{item.index.fqn}: DCP handed a {type(data).__name__} for a tensor item")
    raw = raw_from_torch(data, item.index.fqn)
    if list(raw.shape) != list(item.tensor_data.chunk.sizes):
        raise CkptError(f"{item.index.fqn}: the shard has shape {list(raw.shape)}, the plan says "
                        f"{list(item.tensor_data.chunk.sizes)}")
    return raw


def _skeleton(item: WriteItem, planner: SavePlanner) -> bytes | None:
    """The bytes item's value as SKELETON_MAGIC + its JSON skeleton, or None when the skeleton cannot hold it."""
    import json

    from ckptstore.errors import UnsupportedStateError
    from ckptstore.state import flatten

    lookup = getattr(planner, "lookup_object", None)  # DefaultSavePlanner's: the value before DCP pickles it
    if lookup is None:
        return None
    value = lookup(item.index)
    if _subclassed(value):  # an IntEnum or a namedtuple would come back as its base type: DCP's pickle keeps it
        return None
    try:
        flat = flatten(value)
    except UnsupportedStateError:
        return None
    if flat.tensors:  # tensors inside a bytes item: DCP's pickle keeps them
        return None
    return dcpmeta.SKELETON_MAGIC + json.dumps(flat.skeleton, allow_nan=False).encode()


_PLAIN = (bool, int, float, str, bytes, list, tuple, dict, set, frozenset)


def _subclassed(value: Any, depth: int = 0) -> bool:
    """Whether `value` holds an instance of a subclass of a plain type (which the skeleton stores as the base)."""
    if depth > 64:  # deeper than any real state: let flatten's own bounds refuse it
        return False
    if isinstance(value, _PLAIN) and type(value) not in _PLAIN:
        return type(value).__module__ != "numpy"  # np.float64, np.str_: their values convert exactly, as before
    if isinstance(value, dict):
        return any(_subclassed(k, depth + 1) or _subclassed(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_subclassed(v, depth + 1) for v in value)
    return False


def _report(written: sharded.WrittenShard) -> dict[str, Any]:
    """What a rank tells the coordinator of one shard (plain data; DCP gathers it in-process)."""
    entry = written.entry
    return {"key": written.key, "tensor": entry.tensor, "dtype": entry.dtype, "shape": list(entry.shape),
            "record": None if written.record is None else sharded.record_to_json(written.record),
            "objects": dict(written.objects), "raw_bytes": written.raw_bytes, "at_level": written.at_level,
            "measured": written.measured}


def _written(report: Any) -> sharded.WrittenShard:
    """The shard a rank's report describes."""
    if not isinstance(report, dict) or "key" not in report:
        raise CkptError("a rank's write result was not made by CkptStorageWriter: every rank must save with one")
    record = None if report["record"] is None else sharded.record_from_json(report["record"])
    return sharded.WrittenShard(report["key"], Entry(TensorId(report["tensor"]), report["dtype"],
                                                     tuple(report["shape"])), record,
                                {ObjectId(k): int(v) for k, v in report["objects"].items()}, int(report["raw_bytes"]),
                                bool(report.get("at_level", False)), report.get("measured"))
