"""DCP directories in and out: `ckpt commit DIR` of one makes a sharded commit, `ckpt checkout -o DIR` writes one.

A DCP directory on disk (what `FileSystemWriter` writes for torchtitan, torchtune and others)
goes in as if its ranks had saved through `CkptStorageWriter`: the same manifest paths, so a
later step's shards are residuals against this one's. Checkout writes a standard directory that
plain `dcp.load` reads with its default reader, at any world size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ckptstore.errors import CkptError, NothingToCommitError
from ckptstore.formats import filemap
from ckptstore.formats.atomic import changed_while_read, file_stamp
from ckptstore.hashing import CommitId
from ckptstore.repo import sharded
from ckptstore.repo.commit import CommitOptions, parent_manifest
from ckptstore.repo.gcpause import no_cyclic_gc
from ckptstore.repo.manifest import Entry, Manifest
from ckptstore.repo.progress import Progress
from ckptstore.repo.pruning import after_commit
from ckptstore.repo.target import start_now
from ckptstore.repo.worktree import sweep_stale_temps
from ckptstore.state import RawTensor

T = TypeVar("T")
BATCH_BYTES = 256 << 20  # items read or replayed at a time: memory stays near this, not the checkpoint's size

if TYPE_CHECKING:
    from ckptstore.policy import LossyLevel
    from ckptstore.repo.repository import Repository


def commit_dir(repo: Repository, path: str | os.PathLike, options: CommitOptions, level: LossyLevel | None = None
               ) -> CommitId:
    """Commit the DCP directory at `path` as one sharded commit (lossless) on `options.branch`.

    A lossy `level` asked for is refused: lossy levels on shards come through the DCP writer.

    Raises NothingToCommitError when it equals its parent (unless `options.allow_empty`) and
    ConflictError when the branch moved meanwhile; nothing is recorded then. Once it is recorded,
    the config's `[retention]` policy prunes, as after any commit.
    """
    from ckptstore.formats import dcpdir

    if level is not None:
        raise CkptError(f"{path} is a DCP directory, which ckptstore commits lossless; commit it without --lossy "
                        "(a repository's default lossy level does not apply to DCP directories)")
    with repo.lock(), no_cyclic_gc():
        metadata, data_files = Path(path) / dcpdir.METADATA, []
        stamps = {metadata: file_stamp(metadata)}
        with filemap.guard():  # a data file cut short while read: refused (changed_while_read), not SIGBUS
            described, items = dcpdir.read(path, options.trust_pickle, data_files)
            stamps.update((p, file_stamp(p)) for p in data_files)  # before any of their bytes is read
            start = options.start or start_now(repo, options.branch)
            parent = start.commit
            written: list[sharded.WrittenShard] = []
            for batch in _batches(items, lambda raw: raw.nbytes):
                written += sharded.write_shards(repo, parent, batch)
        if parent is not None and not options.allow_empty:
            before = parent_manifest(repo, parent, repo.commit_info(parent).manifest_object)
            # a shard with a new record for an unchanged entry replaces a record that lied (repo/received.py)
            if before is not None and before.dcp is not None and before.entries == {
                    w.key: w.entry for w in written} and all(w.record is None for w in written):
                raise NothingToCommitError(f"nothing changed since {parent[:12]}: {path} holds the same shards "
                                           "(--allow-empty, allow_empty=True from Python, records it anyway)")
        changed = [p for p, before in stamps.items() if file_stamp(p) != before]
        if changed:  # a dcp.save into the same folder (a `latest/`) meanwhile: what was read may be torn
            raise changed_while_read(changed[0])
        cid = sharded.record_sharded(repo, start, written, described, options)
    return after_commit(repo, cid)  # [retention] in config.toml, once the lock is released


def _batches(items: Iterable[tuple[str, T]], size_of: Callable[[T], int]) -> Iterator[dict[str, T]]:
    """The items in groups of about BATCH_BYTES (by `size_of`), so that only one group is in memory at a time."""
    batch: dict[str, T] = {}
    size = 0
    for key, item in items:
        batch[key] = item
        size += size_of(item)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def checkout_dir(repo: Repository, cid: CommitId, manifest_oid: str, manifest: Manifest, dest: str | os.PathLike,
                 progress: Progress | None = None, trust_pickle: bool = False) -> Path:
    """Write the sharded commit `cid` (its manifest, stored as `manifest_oid`) as a DCP directory at `dest`.

    `trust_pickle`: non-tensor items kept as DCP's pickles are written as stored (dcpdir.item_pickle).
    """
    from ckptstore.formats import dcpdir

    problem = sharded.dcp_problem(manifest)
    if problem is not None:
        raise CkptError(f"commit {cid[:12]} cannot be written as a DCP directory: {problem}; run `ckpt fsck`")
    written = dcpdir.write(dest, manifest.dcp, _restored(repo, manifest, progress), manifest_oid, trust_pickle)
    sweep_stale_temps([written / dcpdir.DATA_FILE, written / dcpdir.METADATA])  # a killed checkout's, an hour old
    return written


def _restored(repo: Repository, manifest: Manifest, progress: Progress | None) -> Iterator[tuple[str, RawTensor]]:
    """Every entry of `manifest` replayed, about BATCH_BYTES at a time."""
    from ckptstore.repo.checkout import restore

    for batch in _batches(manifest.entries.items(), _restored_bytes):
        with no_cyclic_gc():
            raws = restore(repo, manifest, progress, paths=list(batch))
        yield from raws.items()


def _restored_bytes(entry: Entry) -> int:
    return RawTensor(entry.dtype, entry.shape, np.empty(0, dtype=np.uint8)).itemsize * math.prod(entry.shape)
