"""`checkout`: rebuild a commit's checkpoint in memory (on the CPU or a device) or write it to disk."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore import faults, formats
from ckptstore.errors import CkptError, CorruptRecordError, listing
from ckptstore.formats.devices import check_device
from ckptstore.formats.skeletons import check_headers
from ckptstore.hashing import CommitId
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import refs as ref_rows
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay
from ckptstore.repo import integrity, journal, received, refs, worktree
from ckptstore.repo.gcpause import no_cyclic_gc
from ckptstore.repo.manifest import Manifest, rebuilding_files
from ckptstore.repo.progress import NoProgress, Progress
from ckptstore.repo.select import select, write_selection
from ckptstore.state import RawTensor, materialize
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.metadata.commits import CommitInfo
    from ckptstore.objectstore.base import ObjectStore
    from ckptstore.repo.repository import Repository

Replayer = Callable[[ChainSource, list[TensorRecord], Callable[[int], None]], dict]


def restore(repo: Repository, manifest: Manifest, progress: Progress | None = None, paths: list[str] | None = None,
            by_id: bool = False, store: ObjectStore | None = None) -> dict[str, RawTensor]:
    """Replay the tensors of `manifest` (or just `paths`) on the CPU and return them by path.

    `by_id` hashes every tensor against its id on top of the chunk checksums (fsck --full); `store`
    reads the objects instead of the repository's (a lazy clone's that keeps nothing it reads).
    """
    paths = list(manifest.entries) if paths is None else paths
    buffers = _replay(repo, manifest, paths, progress or NoProgress(), "checkout", lambda source, wanted, done:
                      replay(source, wanted, repo.pool, on_chunk=done, by_id=by_id), store)
    return {p: RawTensor(manifest.entries[p].dtype, manifest.entries[p].shape, b) for p, b in buffers.items()}


def checkout(repo: Repository, ref: str = "HEAD", device: str | None = None, progress: Progress | None = None,
             keys: Iterable[str] | None = None) -> Any:
    """The checkpoint at `ref` in memory: nested state for torch files, {name: state} for folders.

    With `keys` (glob patterns, see repo/select.py), only the matching values, reading only their chains.

    With `device` (e.g. "cuda"), torch tensors are rebuilt on that device (replay_torch.py);
    numpy arrays and bytes stay on the CPU. Tensors that were one tensor in the checkpoint
    (same storage) come back as one object.
    """
    check_device(device)  # a missing CUDA is our clear error, not torch's AssertionError mid-replay
    with no_cyclic_gc():
        return _checkout(repo, ref, device, progress or NoProgress(), keys)


def _checkout(repo: Repository, ref: str, device: str | None, progress: Progress, keys: Iterable[str] | None
              ) -> Any:
    """The state at `ref`, built in a frame of its own.

    Its manifest, records and buffers are freed on return, before collections resume, so the
    first collection sees only the returned state.
    """
    with repo.db.read() as tx:  # one snapshot: a gc --prune between the two read the commit's row as damage
        cid = refs.resolve(tx, ref)
        info = commit_rows.commit_info(tx, cid)
    faults.point("checkout:resolved")  # tests run a gc --prune here
    manifest = integrity.kept_manifest(repo, info)
    _refuse_sharded(cid, manifest)
    with rebuilding_files(cid, manifest):
        whole = manifest
        if keys is not None:
            manifest = select(manifest, keys, cid).manifest
        on_device = _restore_on_device(repo, manifest, device, progress) if is_accelerator(device) else {}
        raws = restore(repo, manifest, progress, [p for p in manifest.entries if p not in on_device])
        # the state takes a safetensors file's names from its skeleton: they must be the ones its header gives
        check_headers(whole.files, whole.entries.__getitem__, lambda p: raws[p].data.tobytes() if p in raws else None)
        return formats.to_state(manifest.kind, manifest.files,
                                lambda p: on_device[p] if p in on_device else materialize(raws[p], device))


def checkout_to(repo: Repository, ref: str, output: str | os.PathLike | None = None, force: bool = False,
                progress: Progress | None = None, keys: Iterable[str] | None = None, trust_pickle: bool = False,
                on_resolved: Callable[[CommitInfo, Manifest], None] | None = None) -> Path:
    """Write the checkpoint at `ref` to disk and return where.

    Without `output`, writes to the path it was committed from and moves HEAD (like git checkout), refusing to
    overwrite files whose content is not in the store unless `force`; a sharded commit: HEAD moves, nothing written.
    With `output` (whose parent folder must exist), only writes there. A folder ends up holding exactly the
    commit's files (worktree.plan_checkout says what is removed and refused). With `keys`, only the matching part
    is written, to `output` (required; `_write_selected`). `trust_pickle`, `on_resolved`: see Repository.checkout_to.
    """
    if output is not None:
        worktree.refuse_own_folders(repo, output)
    with repo.db.read() as tx:
        cid = refs.resolve(tx, ref)
        info = commit_rows.commit_info(tx, cid)
        # HEAD (and a branch) keeps HEAD on its branch, as in git; anything else detaches it
        name = ref.strip()
        row = ref_rows.ref_row(tx, name)
        branch = refs.head_branch(tx) if name == refs.HEAD else name if row and row.kind == refs.BRANCH else None
    faults.point("checkout:resolved")
    manifest = integrity.kept_manifest(repo, info)
    (on_resolved or _ignored)(info, manifest)
    if manifest.dcp is not None:  # a sharded commit: a DCP directory that plain dcp.load reads
        if keys is not None:
            raise CkptError(f"commit {cid[:12]} is a sharded (torch.distributed.checkpoint) commit: check it out "
                            "whole with -o DIR, or load part of it with dcp.load and CkptStorageReader")
        if output is None:  # no files to write in place: HEAD moves, so the next `dcp.save` commits on its branch
            refs.move_head(repo, cid, branch)
            return repo.root
        from ckptstore.repo.dcpfiles import checkout_dir

        return checkout_dir(repo, cid, info.manifest_object, manifest, output, progress, trust_pickle)
    if keys is not None:
        return _write_selected(repo, cid, manifest, keys, output, force, progress)
    if output is not None:
        if manifest.kind != "folder":
            worktree.refuse_folder_spelling(output)
        dest = Path(output)
    elif info.source_path is None:
        raise CkptError(f"commit {cid[:12]} was made from an in-memory state; pass -o PATH to write it")
    else:
        dest = worktree.committed_from(repo, cid, info.source_path)
    plan = worktree.plan_checkout(repo, manifest, dest, force, output=output is not None, cid=cid)
    if not manifest.lossy:  # files the commit gives back byte for byte are checked to be so before they are placed
        rewritten = set(manifest.rewritten_files())
        plan.digests = {name: digest for name, digest in manifest.digests.items() if name not in rewritten}
    with no_cyclic_gc():
        raws = restore(repo, manifest, progress)
    head = None if output is not None else journal.HeadMove(cid, branch, lambda c, b: refs.move_head(repo, c, b))
    with rebuilding_files(cid, manifest):
        worktree.write_checkout(repo, cid, plan, lambda p: materialize(raws[p]), lambda p: raws[p],
                                exact=not manifest.lossy, head=head)
    if output is None and branch is not None:
        from ckptstore.repo.remote import pull_written

        pull_written(repo, branch, cid)
    if output is not None and manifest.kind == "folder":
        _say_files_beside(plan)
    return dest


def _ignored(*_: Any) -> None:
    """No one asked what a checkout resolved."""


def _say_files_beside(plan: worktree.CheckoutPlan) -> None:
    """Warn of files an -o folder held that the commit does not: a loader may read them for the commit's."""
    beside = worktree.files_beside(plan)
    if beside:
        more = " and more" if len(beside) >= worktree.BESIDE_LISTED else ""
        warn_caller(f"{plan.dest} also holds files this commit does not ({listing(beside, 3)}{more}): left as they "
                    "were, and a loader of the folder (from_pretrained, Trainer's resume) may read them instead of the "
                    "commit's; check out into a new folder for the commit alone")


def _write_selected(repo: Repository, cid: CommitId, manifest: Manifest, keys: Iterable[str],
                    output: str | os.PathLike | None, force: bool, progress: Progress | None) -> Path:
    """Write the part of `manifest` that `keys` select to `output`; HEAD stays, nothing is recorded.

    Files selected whole come out as a full checkout writes them; a file that lost values is
    written anew (select.write_selection): its content is no commit's, so it is not remembered
    as known content, and the next checkout over it asks for --force.
    """
    if output is None:
        raise CkptError(f"a partial checkout of {cid[:12]} writes only part of the checkpoint: pass -o PATH "
                        "(it never overwrites the files the commit came from)")
    with rebuilding_files(cid, manifest):  # select walks the skeletons, write_selection rebuilds them
        selection = select(manifest, keys, cid)
        if selection.manifest.kind != "folder":
            worktree.refuse_folder_spelling(output)
        plan = worktree.plan_checkout(repo, selection.manifest, Path(output), force, output=True, cid=cid)
        with no_cyclic_gc():
            raws = restore(repo, selection.manifest, progress)
        write_selection(repo, selection, plan, lambda p: materialize(raws[p]), lambda p: raws[p],
                        exact=not manifest.lossy)
    return plan.dest


def _refuse_sharded(cid: str, manifest: Manifest) -> None:
    """A sharded (DCP) commit has no single state to rebuild here: say how to load it instead."""
    if manifest.dcp is not None:
        raise CkptError(f"commit {cid[:12]} is a sharded (torch.distributed.checkpoint) commit; load it with "
                        f"dcp.load(state_dict, storage_reader=ckptstore.dcp.CkptStorageReader(repo, {cid[:12]!r})), "
                        f"write it as a DCP directory with `ckpt checkout {cid[:12]} -o DIR`, or as one file with "
                        f"`ckpt export {cid[:12]} -o FILE`")


def _replay(repo: Repository, manifest: Manifest, paths: list[str], progress: Progress, label: str,
            run: Replayer, store: ObjectStore | None = None) -> dict[str, Any]:
    """Replay the tensors at `paths` with `run` (numpy on the CPU, or torch on a device); buffers by path."""
    ids = {manifest.entries[p].tensor for p in paths}
    used: dict = {}  # the records the last attempt replayed

    def attempt(records: dict) -> dict:
        used.clear()
        used.update(records)
        progress.start(label, sum(records[t].raw_bytes for t in ids))
        return run(ChainSource(store or repo.store, records), [records[t] for t in ids], progress.advance)

    try:
        buffers = integrity.replay_current(repo, manifest, paths, attempt)
        received.check_restored(repo, used, buffers)
    except CorruptRecordError as exc:
        raise integrity.naming_commits(repo, exc) from None
    finally:
        progress.finish()
    restored, handed_out = {}, set()
    for path in paths:
        tensor = manifest.entries[path].tensor
        buffer = buffers[tensor]
        if tensor in handed_out:  # equal content at two paths must not become one tensor
            buffer = buffer.clone() if hasattr(buffer, "clone") else buffer.copy()
        handed_out.add(tensor)
        restored[path] = buffer
    return restored


def _restore_on_device(repo: Repository, manifest: Manifest, device: str, progress: Progress) -> dict[str, Any]:
    """The torch tensors of `manifest` replayed on `device` (replay_torch.py), typed and shaped, by path."""
    from ckptstore import replay_torch
    from ckptstore.state import TORCH_PREFIX, torch_dtype

    paths = [p for p, e in manifest.entries.items() if e.dtype.startswith(TORCH_PREFIX)]
    buffers = _replay(repo, manifest, paths, progress, f"checkout to {device}", lambda source, wanted, done:
                      replay_torch.replay_on(source, wanted, repo.pool, device, on_chunk=done))
    return {p: b.view(torch_dtype(manifest.entries[p].dtype)).reshape(manifest.entries[p].shape)
            for p, b in buffers.items()}


def is_accelerator(device: Any) -> bool:
    """True for a device other than the CPU (where the numpy replay is the fast path)."""
    return device is not None and str(device) != "cpu" and not str(device).startswith("cpu:")
