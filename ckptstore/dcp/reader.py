"""`CkptStorageReader`: `dcp.load` from a sharded commit, at any world size.

DCP's planner reshards from the metadata stored in the commit's manifest; each rank then replays
only the stored shards its plan names (their chains, via ckptstore/replay.py) and copies the
requested regions into its tensors.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore.dcp import meta
from ckptstore.dcp.repos import RepoHandle
from ckptstore.errors import CkptError
from ckptstore.formats.dcpdir import item_pickle
from ckptstore.hashing import CommitId
from ckptstore.metadata import commits as commit_rows
from ckptstore.repo import sharded
from ckptstore.repo.manifest import Entry, Manifest
from ckptstore.repo.partial import restore_ranges
from ckptstore.state import torch_dtype


class CkptStorageReader(StorageReader):
    """Read the sharded commit at `ref` (default HEAD) of the repository at `repo_or_path`.

    DCP's default planner unpickles bytes items (non-tensor state) in full. Unless `trust_pickle`,
    it never sees the stored bytes: each item is loaded with torch's restricted unpickler
    (`weights_only=True`, as user files are read), refused when it holds anything beyond plain data
    and tensors, and handed to DCP as a pickle freshly written from what that loaded.
    """

    def __init__(self, repo_or_path: Any, ref: str = "HEAD", trust_pickle: bool = False) -> None:
        super().__init__()
        self.trust_pickle = trust_pickle
        self._handle = RepoHandle(repo_or_path, read_only=True)
        self.ref = ref
        self.commit_id: CommitId | None = None
        self._manifest: Manifest | None = None
        self._storage: dict[Any, str] = {}
        self.bytes_replayed = 0  # raw bytes of the stored shards this rank replayed (the last read_data)

    @property
    def repo(self) -> Any:
        return self._handle.repo

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """A new load begins; a `checkpoint_id` names the repository (its folder)."""
        self.commit_id, self._manifest, self._storage = None, None, {}
        self._handle.switch(checkpoint_id)

    def read_metadata(self, *args: Any) -> Metadata:
        """DCP's metadata of the commit at `ref`, from the JSON in its manifest.

        No `**kwargs`: DCP would then retry a failed read as "rank-local metadata", which a commit
        does not have, and report the same error twice. DCP wraps what this raises (a pruned
        commit, an unknown ref) in an AssertionError that keeps the message, not the type.
        """
        cid = self.repo.resolve(self.ref)
        oid = commit_rows.readable_manifest(self.repo.commit_info(cid))  # a pruned commit: PrunedCommitError
        manifest = self.repo.read_manifest(oid)
        if not sharded.is_sharded(manifest):
            raise CkptError(f"commit {cid[:12]} ({self.ref}) is not a sharded (DCP) commit; "
                            "read it with repo.checkout or `ckpt checkout`")
        metadata = meta.from_json(manifest.dcp, oid)  # first: a newer ckptstore's format says "upgrade", not damage
        problem = sharded.dcp_problem(manifest)  # a crafted or damaged one would place bytes where they are not
        if problem is not None:
            raise CkptError(f"commit {cid[:12]} ({self.ref}) cannot be loaded: {problem}; run `ckpt fsck`")
        self.commit_id, self._manifest = cid, manifest
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Name the commit this rank resolved, so the coordinator can check that every rank reads the same one."""
        return dataclasses.replace(plan, storage_data={"commit": self.commit_id})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Refuse a load whose ranks resolved `ref` to different commits (it moved while they started)."""
        commits = {p.storage_data.get("commit") if isinstance(p.storage_data, dict) else None for p in plans}
        if len(commits) != 1:
            raise CkptError(f"the ranks resolved {self.ref!r} to different commits "
                            f"({', '.join(sorted(str(c)[:12] for c in commits))}): it moved during the load; "
                            "load a commit id or a tag")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Replay the parts of stored items this rank's plan names and hand each requested region to the planner.

        Only the chunks covering the requested regions are read, down their chains, so a rank
        loading at another world size reads about its share (repo/partial.py).
        """
        if self._manifest is None:
            raise CkptError("read_data came before read_metadata")
        ranges: dict[str, tuple[int, int]] = {}
        for item in plan.items:
            key = self._key(item)
            start, end = _byte_range(item, self._manifest.entries[key])
            have = ranges.get(key)
            if have is None or have[0] == have[1]:  # an empty region needs no bytes: it must not widen others
                ranges[key] = (start, end)
            elif start != end:
                ranges[key] = (min(have[0], start), max(have[1], end))
        try:
            parts = restore_ranges(self.repo, self._manifest, ranges)
        finally:
            self.close()  # what this rank reads is in memory now; the repository reopens if used again
        self.bytes_replayed = sum(int(buffer.size) for _, buffer in parts.values())
        for item in plan.items:
            key = self._key(item)
            _deliver(item, self._manifest.entries[key], parts[key], planner, self.trust_pickle)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _key(self, item: ReadItem) -> str:
        key = self._storage.get(item.storage_index)
        if key is None or key not in self._manifest.entries:
            raise CkptError(f"commit {self.commit_id[:12]} holds no stored item for {item.storage_index.fqn} at "
                            f"{list(item.storage_index.offset or [])}")
        return key

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """True for a folder holding a ckptstore repository."""
        return os.path.isdir(os.path.join(os.fspath(checkpoint_id), ".ckpt"))

    def close(self) -> None:
        """Close the repository this reader opened."""
        self._handle.close()


def _strides(shape: tuple[int, ...]) -> list[int]:
    """Element strides of a C-order tensor of `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return strides


def _byte_range(item: ReadItem, entry: Entry) -> tuple[int, int]:
    """Bytes [start, end) of the stored item that hold the region `item` asks for (all of a bytes item)."""
    if item.type == LoadItemType.BYTE_IO or 0 in item.lengths:
        return (0, int(entry.shape[0])) if item.type == LoadItemType.BYTE_IO else (0, 0)
    itemsize = torch.empty((), dtype=torch_dtype(entry.dtype)).element_size()
    strides = _strides(entry.shape)
    first = sum(o * s for o, s in zip(item.storage_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides))
    return first * itemsize, (last + 1) * itemsize


def _deliver(item: ReadItem, entry: Entry, part: tuple[int, np.ndarray], planner: LoadPlanner,
             trust_pickle: bool) -> None:
    """Copy one read item's region of a replayed shard into the planner's tensor (or hand it its bytes)."""
    first_byte, buffer = part
    if item.type == LoadItemType.BYTE_IO:
        data = buffer.tobytes()
        planner.load_bytes(item, io.BytesIO(item_pickle(item.dest_index.fqn, data, trust_pickle)))
        return
    dtype = torch_dtype(entry.dtype)
    flat = torch.from_numpy(buffer).view(dtype) if buffer.size else torch.empty(0, dtype=dtype)
    strides = _strides(entry.shape)
    start = sum(o * s for o, s in zip(item.storage_offsets, strides)) - first_byte // flat.element_size()
    tensor = flat.as_strided(tuple(item.lengths), strides, start) if 0 not in item.lengths else \
        torch.empty(tuple(item.lengths), dtype=dtype)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CkptError(f"{item.dest_index.fqn}: the stored region is {list(tensor.size())}, the state dict's "
                        f"{list(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


