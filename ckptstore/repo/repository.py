"""`Repository`: the verbs (init, open, commit, checkout, log, branch, tag, diff, status, stats)."""

from __future__ import annotations

import contextlib
import difflib
import gc
import getpass
import json
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard
from sqlalchemy import delete, select, update

from ckptstore import formats
from ckptstore.codecs.record import TensorRecord
from ckptstore.errors import (
    CheckpointFormatError,
    CkptError,
    ConflictError,
    CorruptObjectError,
    DirtyWorktreeError,
    NothingToCommitError,
    RefExistsError,
    RefNotFoundError,
    RepoExistsError,
    RepoNotFoundError,
)
from ckptstore.hashing import CommitId, ObjectId, TensorId, commit_id, file_digest, tensor_id
from ckptstore.metadata import make_engine, upgrade, write_transaction
from ckptstore.metadata.schema import commit_tensors, commits, known_files, refs, tensor_chunks, tensors
from ckptstore.objectstore import LocalObjectStore
from ckptstore.policy import EncodingSettings, LossyLevel, level_named
from ckptstore.policy.lossy import LossyPlan, plan_lossy
from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs, paths_of_names
from ckptstore.policy.sensitivity import measure_fisher
from ckptstore.replay import ChainSource, replay
from ckptstore.repo import catalog, graph
from ckptstore.repo import refs as refnames
from ckptstore.repo.config import RepoConfig
from ckptstore.repo.lock import repo_lock
from ckptstore.repo.progress import NoProgress, Progress
from ckptstore.repo.writer import Job, encode_jobs, lossless_jobs
from ckptstore.state import RawTensor, materialize

REPO_DIR = ".ckpt"
DEFAULT_BRANCH = "main"
MANIFEST_VERSION = 1


@dataclass
class Entry:
    """A manifest line: a logical path and the tensor stored there."""

    tensor: TensorId
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Manifest:
    """What a commit holds: its files (with skeletons) and every tensor entry by path."""

    kind: str
    files: list[formats.CheckpointFile]
    entries: dict[str, Entry]
    digests: dict[str, str]
    lossy: str | None = None
    pairing: str | None = None
    importance: str | None = None  # how a lossy commit judged its weights' sensitivity, when measured

    def to_bytes(self) -> bytes:
        record = {
            "version": MANIFEST_VERSION,
            "kind": self.kind,
            "lossy": self.lossy,
            "pairing": self.pairing,
            "files": [dict(f.to_json(), digest=self.digests.get(f.name)) for f in self.files],
            "entries": {p: [e.tensor, e.dtype, list(e.shape)] for p, e in self.entries.items()},
        }
        if self.importance:
            record["importance"] = self.importance
        return zstandard.ZstdCompressor(level=3).compress(
            json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        record = json.loads(zstandard.ZstdDecompressor().decompress(data))
        files = [formats.CheckpointFile.from_json(f) for f in record["files"]]
        entries = {p: Entry(TensorId(t), d, tuple(s)) for p, (t, d, s) in record["entries"].items()}
        digests = {f["name"]: f["digest"] for f in record["files"] if f.get("digest")}
        return cls(record["kind"], files, entries, digests, record.get("lossy"), record.get("pairing"),
                   record.get("importance"))


@dataclass
class TensorDiff:
    """How one path differs between two commits."""

    path: str
    status: str  # added, removed, changed, unchanged
    dtype: str
    shape: tuple[int, ...]
    relative_l2: float | None
    stored_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "dtype": self.dtype, "shape": list(self.shape),
                "relative_l2": self.relative_l2, "stored_bytes": self.stored_bytes}


def find_root(start: str | os.PathLike | None = None) -> Path:
    """The folder holding `.ckpt`: CKPT_REPO if set, else walking up from `start` (or the cwd)."""
    if start is None and os.environ.get("CKPT_REPO"):
        start = os.environ["CKPT_REPO"]
        candidate = Path(start).resolve()
        if (candidate / REPO_DIR).is_dir():
            return candidate
        raise RepoNotFoundError(f"CKPT_REPO={start} holds no ckptstore repository ({REPO_DIR}/)")
    here = Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / REPO_DIR).is_dir():
            return folder
    raise RepoNotFoundError(f"no ckptstore repository in {here} or any parent; run `ckpt init` first")


class Repository:
    """A checkpoint repository: objects under `.ckpt/objects`, metadata in `.ckpt/ckpt.db`."""

    def __init__(self, root: Path, config: RepoConfig) -> None:
        self.root = root
        self.dir = root / REPO_DIR
        self.config = config
        self.store = LocalObjectStore(self.dir / "objects", self.dir / "tmp")
        self.engine = make_engine(config.metadata_url or f"sqlite:///{self.dir / 'ckpt.db'}")
        upgrade(self.engine)
        self._pool = ThreadPoolExecutor(config.threads or os.cpu_count() or 1, thread_name_prefix="ckpt")

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def init(cls, path: str | os.PathLike = ".", metadata_url: str = "",
             encoding: EncodingSettings | None = None, lossy: str = "") -> Repository:
        """Create a repository in `path` with HEAD on an unborn `main` branch (`lossy`: default level)."""
        root = Path(path).resolve()
        if (root / REPO_DIR).exists():
            raise RepoExistsError(f"{root / REPO_DIR} already exists")
        level_named(lossy or None)  # reject unknown names before creating anything
        (root / REPO_DIR).mkdir(parents=True)
        config = RepoConfig(encoding or EncodingSettings(), metadata_url, lossy=lossy)
        config.save(root / REPO_DIR / "config.toml")
        repo = cls(root, config)
        with write_transaction(repo.engine) as conn:
            if refnames.ref_row(conn, refnames.HEAD) is None:
                conn.execute(refs.insert().values(name=refnames.HEAD, kind=refnames.HEAD_KIND,
                                                  target=DEFAULT_BRANCH))
        return repo

    @classmethod
    def open(cls, path: str | os.PathLike | None = None) -> Repository:
        """Open the repository at or above `path` (or CKPT_REPO, or the cwd); upgrades its schema."""
        root = find_root(path)
        return cls(root, RepoConfig.load(root / REPO_DIR / "config.toml"))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.engine.dispose()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self, exclusive: bool = False, wait: bool = True):
        return repo_lock(self.dir / "lock", exclusive, wait)

    # ----------------------------------------------------------------- refs
    def resolve(self, ref: str = "HEAD") -> CommitId:
        """The commit id a ref expression names."""
        with self.engine.connect() as conn:
            return refnames.resolve(conn, ref)

    def head(self) -> tuple[str | None, CommitId | None]:
        """(branch HEAD is on or None when detached, commit or None when unborn)."""
        with self.engine.connect() as conn:
            return refnames.head_branch(conn), refnames.head_commit(conn)

    def branches(self) -> dict[str, CommitId]:
        return self._refs_of_kind(refnames.BRANCH)

    def tags(self) -> dict[str, CommitId]:
        return self._refs_of_kind(refnames.TAG)

    def _refs_of_kind(self, kind: str) -> dict[str, CommitId]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(refs.c.name, refs.c.commit_id).where(refs.c.kind == kind).order_by(refs.c.name))
            return {name: CommitId(cid) for name, cid in rows}

    def branch(self, name: str, start: str = "HEAD") -> CommitId:
        """Create branch `name` at `start`; HEAD does not move."""
        return self._create_ref(name, start, refnames.BRANCH)

    def tag(self, name: str, ref: str = "HEAD") -> CommitId:
        """Create tag `name` at `ref`; tags never move."""
        return self._create_ref(name, ref, refnames.TAG)

    def _create_ref(self, name: str, start: str, kind: str) -> CommitId:
        refnames.check_name(name)
        with write_transaction(self.engine) as conn:
            if refnames.ref_row(conn, name) is not None:
                raise RefExistsError(f"a branch or tag named {name!r} already exists")
            cid = refnames.resolve(conn, start)
            conn.execute(refs.insert().values(name=name, kind=kind, commit_id=cid))
        return cid

    def delete_branch(self, name: str) -> CommitId:
        """Remove branch `name` (its commits stay until `gc --prune`); not the branch HEAD is on."""
        with write_transaction(self.engine) as conn:
            row = refnames.ref_row(conn, name)
            if row is None or row.kind != refnames.BRANCH:
                names = conn.execute(select(refs.c.name).where(refs.c.kind == refnames.BRANCH)).scalars().all()
                raise RefNotFoundError(name, difflib.get_close_matches(name, names, n=3), detail=" (no such branch)")
            if refnames.head_branch(conn) == name:
                raise CkptError(f"cannot delete branch {name!r}: HEAD is on it; check out another ref first")
            conn.execute(delete(refs).where(refs.c.name == name))
            return CommitId(row.commit_id)

    # ----------------------------------------------------------------- reading
    def manifest(self, cid: CommitId) -> Manifest:
        with self.engine.connect() as conn:
            oid = catalog.manifest_object(conn, cid)
        return Manifest.from_bytes(self._get(oid))

    def _get(self, oid: ObjectId) -> bytes:
        try:
            return self.store.get(oid)
        except CorruptObjectError as exc:
            raise CorruptObjectError(exc.object_id, exc.problem, self.commits_needing([oid])) from None

    def commit_info(self, ref: str) -> catalog.CommitInfo:
        with self.engine.connect() as conn:
            return catalog.commit_info(conn, refnames.resolve(conn, ref))

    def _replay(self, manifest: Manifest, paths: list[str], progress: Progress, label: str,
                run: Callable[[ChainSource, list[TensorRecord], Callable[[int], None]], dict]) -> dict[str, Any]:
        """Replay the tensors at `paths` with `run` (numpy on the CPU, or torch on a device); buffers by path."""
        ids = {manifest.entries[p].tensor for p in paths}
        with self.engine.connect() as conn:
            records = catalog.load_records(conn, ids)
        missing = ids - set(records)
        if missing:
            raise CkptError(f"metadata has no record of tensors {sorted(missing)[:3]}; run `ckpt fsck`")
        progress.start(label, sum(records[t].raw_bytes for t in ids))
        try:
            buffers = run(ChainSource(self.store, records), [records[t] for t in ids], progress.advance)
        except CorruptObjectError as exc:
            damaged = exc.object_id.split(",")
            raise CorruptObjectError(exc.object_id, exc.problem, self.commits_needing(damaged)) from None
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

    def _restore(self, manifest: Manifest, progress: Progress, paths: list[str] | None = None,
                 by_id: bool = False) -> dict[str, RawTensor]:
        """Replay the tensors of `manifest` (or just `paths`) on the CPU and return them by path.

        `by_id` hashes every tensor against its id on top of the chunk checksums (fsck --full).
        """
        paths = list(manifest.entries) if paths is None else paths
        buffers = self._replay(manifest, paths, progress, "checkout", lambda source, wanted, done:
                               replay(source, wanted, self._pool, on_chunk=done, by_id=by_id))
        return {p: RawTensor(manifest.entries[p].dtype, manifest.entries[p].shape, b) for p, b in buffers.items()}

    def _restore_on_device(self, manifest: Manifest, device: str, progress: Progress) -> dict[str, Any]:
        """The torch tensors of `manifest` replayed on `device` (replay_torch.py), typed and shaped, by path."""
        from ckptstore import replay_torch
        from ckptstore.state import TORCH_PREFIX, torch_dtype

        paths = [p for p, e in manifest.entries.items() if e.dtype.startswith(TORCH_PREFIX)]
        buffers = self._replay(manifest, paths, progress, f"checkout to {device}", lambda source, wanted, done:
                               replay_torch.replay_on(source, wanted, self._pool, device, on_chunk=done))
        return {p: b.view(torch_dtype(manifest.entries[p].dtype)).reshape(manifest.entries[p].shape)
                for p, b in buffers.items()}

    def checkout(self, ref: str = "HEAD", device: str | None = None, progress: Progress | None = None) -> Any:
        """The checkpoint at `ref` in memory: nested state for torch files, {name: state} for folders.

        With `device` (e.g. "cuda"), torch tensors are rebuilt on that device (replay_torch.py);
        numpy arrays and bytes stay on the CPU. Tensors that were one tensor in the checkpoint
        (same storage) come back as one object.
        """
        with _no_cyclic_gc():
            return self._checkout(ref, device, progress or NoProgress())

    def _checkout(self, ref: str, device: str | None, progress: Progress) -> Any:
        """The state at `ref`, built in a frame of its own.

        Its manifest, records and buffers are freed on return, before collections resume, so the
        first collection sees only the returned state.
        """
        manifest = self.manifest(self.resolve(ref))
        on_device = self._restore_on_device(manifest, device, progress) if _is_accelerator(device) else {}
        raws = self._restore(manifest, progress, [p for p in manifest.entries if p not in on_device])
        return formats.to_state(manifest.kind, manifest.files,
                                lambda p: on_device[p] if p in on_device else materialize(raws[p], device))

    def checkout_to(self, ref: str, output: str | os.PathLike | None = None, force: bool = False,
                    progress: Progress | None = None) -> Path:
        """Write the checkpoint at `ref` to disk and return where.

        Without `output`, writes to the path it was committed from and moves HEAD (like git
        checkout), refusing to overwrite files whose content is not in the store unless `force`.
        With `output`, only writes there.
        """
        with self.engine.connect() as conn:
            cid = refnames.resolve(conn, ref)
            info = catalog.commit_info(conn, cid)
            is_branch = (row := refnames.ref_row(conn, ref)) is not None and row.kind == refnames.BRANCH
        manifest = Manifest.from_bytes(self._get(info.manifest_object))
        if output is not None:
            dest = Path(output)
        elif info.source_path is None:
            raise CkptError(f"commit {cid[:12]} was made from an in-memory state; pass -o PATH to write it")
        else:
            dest = self.root / info.source_path
        targets = [formats.destination(manifest.kind, f, dest) for f in manifest.files]
        if not force:
            self._refuse_unsaved(targets)
        with _no_cyclic_gc():
            raws = self._restore(manifest, progress or NoProgress())
        value_of = lambda p: materialize(raws[p])
        for record, target in zip(manifest.files, targets):
            formats.write_file(record, target, value_of, lambda p: raws[p])
        self._remember_files(cid, targets)
        if output is None:
            self._move_head(cid, ref if is_branch else None)
        return dest

    def _refuse_unsaved(self, targets: list[Path]) -> None:
        existing = [t for t in targets if t.is_file()]
        digests = {t: file_digest(str(t)) for t in existing}
        with self.engine.connect() as conn:
            known = set(conn.execute(select(known_files.c.digest).where(
                known_files.c.digest.in_(list(digests.values())))).scalars()) if digests else set()
        unsaved = [str(t) for t, d in digests.items() if d not in known]
        if unsaved:
            raise DirtyWorktreeError(
                f"checkout would overwrite {', '.join(unsaved)}, whose content is not in the store; "
                "commit it first, write elsewhere with -o PATH, or pass --force"
            )

    def _remember_files(self, cid: CommitId, paths: list[Path]) -> None:
        rows = [{"digest": file_digest(str(p)), "commit_id": cid, "size": p.stat().st_size} for p in paths]
        with write_transaction(self.engine) as conn:
            catalog.insert_ignore(conn, known_files, rows)

    def _move_head(self, cid: CommitId, branch: str | None) -> None:
        with write_transaction(self.engine) as conn:
            values = {"target": branch, "commit_id": None} if branch else {"target": None, "commit_id": cid}
            conn.execute(update(refs).where(refs.c.name == refnames.HEAD).values(**values))

    # ----------------------------------------------------------------- writing
    def commit(self, state_or_path: Any, message: str = "", step: int | None = None,
               metrics: Mapping[str, float] | None = None, branch: str | None = None,
               allow_empty: bool = False, trust_pickle: bool = False, author: str | None = None,
               progress: Progress | None = None, lossy: str | LossyLevel | None = None,
               model: Any = None, optimizer: Any = None, calibration: Callable[[Any], Any] | None = None,
               **knobs: Any) -> CommitId:
        """Store a checkpoint (a path to a file or folder, or an in-memory state) as a new commit.

        The parent is the tip of `branch` (default: HEAD's branch, or HEAD itself when detached).
        `lossy` picks a lossy level (default: the repository's, normally lossless); `knobs`
        override its settings; `model` and `optimizer` (the live objects) name which optimizer
        state belongs to which weight; `calibration(model)`, the model's loss on a fixed batch,
        lets a lossy commit measure each weight's sensitivity instead of estimating it from Adam's
        second moment (see policy/sensitivity.py). Raises NothingToCommitError when nothing changed,
        ConflictError when another writer moved the branch meanwhile; in both cases no commit is
        recorded and earlier ones are untouched.
        """
        progress = progress or NoProgress()
        level = level_named(lossy if lossy is not None else (self.config.lossy or None), **knobs)
        fisher = _measured_fisher(model, calibration, level)
        with self._lock(), _no_cyclic_gc():
            source_path, checkpoint, digests = self._read_input(state_or_path, trust_pickle)
            sources = self._tensor_ids(checkpoint.tensors)
            with self.engine.connect() as conn:
                target, parent = self._commit_target(conn, branch)
                parent_manifest = self.manifest(parent) if parent else None
                parent_ids = {p: e.tensor for p, e in (parent_manifest.entries.items() if parent_manifest else ())
                              if p in checkpoint.tensors}
                records = catalog.load_records(conn, set(parent_ids.values()))
                parents = {p: records[t] for p, t in parent_ids.items() if t in records}
                skeleton_ids = [param_ids(f.skeleton) for f in checkpoint.files]
                found_ids = [ids for ids in skeleton_ids if ids is not None]
                found_lrs = [lrs for lrs in (param_lrs(f.skeleton) for f in checkpoint.files) if lrs]
                optimizer_map = map_optimizer(checkpoint.tensors, _param_names(model, optimizer),
                                              found_ids[0] if len(found_ids) == 1 else None,
                                              found_lrs[0] if len(found_lrs) == 1 else None)
                if fisher is not None:  # live parameter names -> checkpoint paths
                    named = paths_of_names(checkpoint.tensors, list(fisher))
                    fisher = {path: fisher[name] for name, path in named.items()}
                plans = (plan_lossy(checkpoint.tensors, parents, level, self.config.encoding, optimizer_map,
                                    fisher) if level else {})
                entries, jobs = self._jobs(conn, checkpoint.tensors, sources, parents, plans, level)
            progress.start("commit", sum(j.raw.nbytes for j in jobs))
            with self.store.batch():
                try:
                    encoded, sizes = encode_jobs(jobs, ChainSource(self.store, records), self._pool,
                                                 progress.advance)
                finally:
                    progress.finish()
            for path, record in encoded.items():
                if path in checkpoint.tensors:
                    entries[path] = record.id
            manifest = Manifest(checkpoint.kind, checkpoint.files, {
                p: Entry(entries[p], raw.dtype, raw.shape) for p, raw in checkpoint.tensors.items()
            }, digests, level.name if level else None, optimizer_map.how if level else None,
                _importance_note(fisher, plans))
            manifest_bytes = manifest.to_bytes()
            if parent_manifest is not None and not allow_empty and self._same_content(manifest, parent_manifest):
                raise NothingToCommitError(
                    f"nothing changed since {parent[:12]}: the checkpoint equals its parent "
                    "(use --allow-empty to record it anyway)"
                )
            manifest_oid = self.store.put(manifest_bytes)
            new_records = list({r.id: r for r in encoded.values()}.values())
            stored = sum(r.stored_bytes for r in new_records) + len(manifest_bytes)
            raw_total = sum(f.size for f in checkpoint.files) if checkpoint.kind != "state" else sum(
                r.nbytes for r in checkpoint.tensors.values())
            info = catalog.CommitInfo(
                id=CommitId(""), manifest_object=manifest_oid, message=message,
                author=author or _default_author(), created_at=time.time(), step=step,
                metrics={k: float(v) for k, v in (metrics or {}).items()}, kind=checkpoint.kind,
                source_path=source_path, raw_bytes=raw_total, stored_bytes=stored,
                parents=[parent] if parent else [], lossy=level.name if level else None,
            )
            record = info.to_json()
            record.pop("id")
            record["manifest"] = manifest_oid
            info.id = commit_id(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
            sizes[manifest_oid] = len(manifest_bytes)
            with write_transaction(self.engine) as conn:
                self._move_ref(conn, target, parent, info.id)
                catalog.insert_records(conn, new_records, sizes)
                catalog.insert_commit(conn, info, entries.values())
                catalog.insert_ignore(conn, known_files, [
                    {"digest": d, "commit_id": info.id, "size": f.size}
                    for f in checkpoint.files if (d := digests.get(f.name))
                ])
            return info.id

    def _jobs(self, conn, tensors: Mapping[str, RawTensor], sources: Mapping[str, TensorId],
              parents: Mapping[str, TensorRecord], plans: Mapping[str, LossyPlan], level: LossyLevel | None
              ) -> tuple[dict[str, TensorId], list[Job]]:
        """Manifest ids known before encoding, and the jobs that encode everything else.

        Lossless tensors are named by their content; a lossy tensor whose source equals the
        parent's keeps the parent's reconstruction; the rest are named after encoding.
        """
        entries: dict[str, TensorId] = {}
        reused: dict[str, TensorRecord] = {}
        for path in plans:
            parent = parents.get(path)
            if parent is not None and parent.params.get("source") == sources[path]:
                entries[path] = parent.id
                reused[path] = parent
        lossless = [p for p in tensors if p not in plans]
        present = catalog.existing_tensor_ids(conn, [sources[p] for p in lossless])
        new: dict[TensorId, RawTensor] = {}
        parent_of: dict[TensorId, TensorRecord | None] = {}
        for path in lossless:
            entries[path] = sources[path]
            if sources[path] not in present and sources[path] not in new:
                new[sources[path]] = tensors[path]
                parent_of[sources[path]] = parents.get(path)
        jobs = lossless_jobs(new, parent_of, self.config.encoding)
        for path, plan in plans.items():
            if path in reused:
                continue
            params = dict(plan.params, source=sources[path], level=level.name)
            base, sibling = plan.base, plan.sibling
            if sibling in reused:  # its second moment did not change: replay that one as the base
                base, sibling = reused[sibling], None
            mask_from = plan.mask_from if plan.mask_from in plans and plan.mask_from not in reused else None
            paced_by = plan.paced_by if plan.paced_by not in reused else None
            if plan.paced_by in reused:  # the weight did not move at all: as fine as it gets
                params["step"] = params["fine_step"]
            jobs.append(Job(path, tensors[path], plan.codec, params, base, sibling, mask_from,
                            tensors.get(plan.importance) if plan.importance else None, plan.prune, plan.stage,
                            paced_by=paced_by))
        return entries, jobs

    @staticmethod
    def _same_content(new: Manifest, old: Manifest) -> bool:
        return (new.kind == old.kind and new.entries == old.entries
                and [f.to_json() for f in new.files] == [f.to_json() for f in old.files])

    def _read_input(self, state_or_path: Any, trust_pickle: bool
                    ) -> tuple[str | None, formats.Checkpoint, dict[str, str]]:
        if not isinstance(state_or_path, (str, os.PathLike)):
            return None, formats.from_state(state_or_path), {}
        path = Path(state_or_path).resolve()
        if not path.exists():
            raise CheckpointFormatError(f"{state_or_path} does not exist")
        if self.dir in [path, *path.parents]:
            raise CheckpointFormatError(f"{path} is inside the repository's own {REPO_DIR}/ folder")
        # Hash the files while they are parsed: both read the same pages, and the load is single-threaded.
        on_disk = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        pending = {p: self._pool.submit(file_digest, str(p)) for p in on_disk}
        checkpoint = formats.read_checkpoint(path, trust_pickle)
        digests = {}
        for record in checkpoint.files:
            target = formats.destination(checkpoint.kind, record, path)
            digests[record.name] = (pending[target].result() if target in pending else file_digest(str(target)))
        try:
            source = path.relative_to(self.root).as_posix()
        except ValueError:
            source = str(path)
        return source, checkpoint, digests

    def _tensor_ids(self, tensors: Mapping[str, RawTensor]) -> dict[str, TensorId]:
        futures = {p: self._pool.submit(tensor_id, r.dtype, r.shape, r.data) for p, r in tensors.items()}
        return {p: f.result() for p, f in futures.items()}

    def _commit_target(self, conn, branch: str | None) -> tuple[str | None, CommitId | None]:
        """(branch to advance, or None for a detached HEAD; the parent commit)."""
        if branch is None:
            branch = refnames.head_branch(conn)
            if branch is None:
                return None, refnames.head_commit(conn)
        refnames.check_name(branch)
        row = refnames.ref_row(conn, branch)
        if row is not None and row.kind != refnames.BRANCH:
            raise CkptError(f"{branch!r} is a tag; commits go on branches")
        if row is not None:
            return branch, CommitId(row.commit_id)
        return branch, refnames.head_commit(conn) if branch != refnames.head_branch(conn) else None

    @staticmethod
    def _move_ref(conn, target: str | None, expected: CommitId | None, new: CommitId) -> None:
        """Compare-and-swap the ref: it must still point where this commit started from."""
        if target is None:
            moved = conn.execute(update(refs).where(
                refs.c.name == refnames.HEAD, refs.c.commit_id == expected).values(commit_id=new)).rowcount
        elif expected is None or refnames.ref_row(conn, target) is None:
            if refnames.ref_row(conn, target) is not None:
                moved = 0
            else:
                conn.execute(refs.insert().values(name=target, kind=refnames.BRANCH, commit_id=new))
                moved = 1
        else:
            moved = conn.execute(update(refs).where(
                refs.c.name == target, refs.c.kind == refnames.BRANCH, refs.c.commit_id == expected
            ).values(commit_id=new)).rowcount
        if moved != 1:
            now = refnames.ref_row(conn, target or refnames.HEAD)
            where = (now.commit_id or "nothing")[:12] if now else "nothing"
            raise ConflictError(
                f"{target or 'HEAD'} moved to {where} while this commit was being written "
                f"(it started from {(expected or 'an unborn branch')[:12]}); nothing was recorded. "
                "Another process commits to the same branch: commit again to put this checkpoint on "
                "top, or use --branch to keep the two runs apart."
            )

    # ----------------------------------------------------------------- history
    def log(self, ref: str | None = None, all_refs: bool = False) -> list[catalog.CommitInfo]:
        """Commits reachable from `ref` (default HEAD) or from every ref, newest first."""
        with self.engine.connect() as conn:
            history = catalog.all_commits(conn)
            if all_refs:
                tips = [r.commit_id for r in conn.execute(select(refs)) if r.commit_id]
                head = refnames.head_commit(conn)
                tips += [head] if head else []
            else:
                try:
                    tips = [refnames.resolve(conn, ref or "HEAD")]
                except RefNotFoundError:
                    if ref:
                        raise
                    tips = []
        order = graph.topo_order(tips, {c: i.parents for c, i in history.items()}, lambda c: history[c].created_at)
        return [history[c] for c in order]

    def decorations(self) -> dict[CommitId, list[str]]:
        """Ref names by commit, with `HEAD -> branch` like git."""
        labels: dict[CommitId, list[str]] = {}
        branch, head = self.head()
        for name, cid in self.branches().items():
            labels.setdefault(cid, []).append(f"HEAD -> {name}" if name == branch else name)
        for name, cid in self.tags().items():
            labels.setdefault(cid, []).append(f"tag: {name}")
        if branch is None and head:
            labels.setdefault(head, []).insert(0, "HEAD")
        return labels

    def log_graph(self, all_refs: bool = False) -> list[str]:
        """`log --graph` lines."""
        history = self.log(all_refs=all_refs)
        labels = self.decorations()
        by_id = {c.id: c for c in history}

        def describe(cid: str) -> str:
            info = by_id[cid]
            deco = f" ({', '.join(labels[cid])})" if cid in labels else ""
            step = f" step={info.step}" if info.step is not None else ""
            lossy = f" [lossy:{info.lossy}]" if info.lossy else ""
            return f"{cid[:12]}{deco}{step}{lossy} {info.message}".rstrip()

        order = [c.id for c in history]
        return graph.render(order, {c.id: c.parents for c in history}, describe)

    def show(self, ref: str = "HEAD") -> dict[str, Any]:
        """A commit's metadata and its files and tensors."""
        info = self.commit_info(ref)
        manifest = Manifest.from_bytes(self._get(info.manifest_object))
        with self.engine.connect() as conn:
            records = catalog.load_records(conn, {e.tensor for e in manifest.entries.values()}, with_bases=False)
        tensors = []
        for path, entry in manifest.entries.items():
            record = records[entry.tensor]
            row = {"path": path, "dtype": entry.dtype, "shape": list(entry.shape), "tensor": entry.tensor,
                   "stored_bytes": record.stored_bytes, "depth": record.depth, "codec": record.codec}
            if "rel_error" in record.params:
                row["rel_error"] = record.params["rel_error"]
            tensors.append(row)
        files = [{"name": f.name, "format": f.format, "size": f.size, "note": f.opaque_reason} for f in manifest.files]
        extra = {"pairing": manifest.pairing, "importance": manifest.importance} if manifest.lossy else {}
        return dict(info.to_json(), files=files, tensors=tensors, **extra)

    def diff(self, a: str, b: str) -> list[TensorDiff]:
        """Per tensor path: added, removed, changed or unchanged, with the relative L2 change."""
        import torch

        old, new = self.manifest(self.resolve(a)), self.manifest(self.resolve(b))
        changed = [p for p in new.entries if p in old.entries and new.entries[p].tensor != old.entries[p].tensor]
        old_raw = self._restore(old, NoProgress(), changed)
        new_raw = self._restore(new, NoProgress(), changed)
        with self.engine.connect() as conn:
            records = catalog.load_records(conn, {e.tensor for e in new.entries.values()}, with_bases=False)
        result = []
        for path in sorted(set(old.entries) | set(new.entries)):
            entry = new.entries.get(path) or old.entries[path]
            stored = records[entry.tensor].stored_bytes if path in new.entries else 0
            status, rel = "unchanged", 0.0
            if path not in old.entries:
                status, rel = "added", None
            elif path not in new.entries:
                status, rel = "removed", None
            elif path in old_raw:
                status, rel = "changed", _relative_l2(old_raw[path], new_raw[path], torch)
            result.append(TensorDiff(path, status, entry.dtype, entry.shape, rel, stored))
        return result

    def status(self) -> dict[str, Any]:
        """HEAD, and whether the files HEAD was committed from still hold its content."""
        branch, head = self.head()
        report: dict[str, Any] = {"branch": branch, "head": head, "files": []}
        if head is None:
            return report
        info = self.commit_info(head)
        if info.source_path is None:
            return report
        manifest = Manifest.from_bytes(self._get(info.manifest_object))
        base = self.root / info.source_path
        with self.engine.connect() as conn:
            for record in manifest.files:
                path = formats.destination(manifest.kind, record, base)
                if not path.is_file():
                    state = "missing"
                else:
                    digest = file_digest(str(path))
                    if digest == manifest.digests.get(record.name):
                        state = "unchanged"
                    else:
                        known = conn.execute(select(known_files.c.commit_id).where(
                            known_files.c.digest == digest)).scalar()
                        state = "unchanged" if known == head else (
                            f"modified (content of {known[:12]})" if known else "modified")
                report["files"].append({"path": str(path.relative_to(self.root)) if path.is_relative_to(
                    self.root) else str(path), "state": state})
        return report

    def stats(self) -> dict[str, Any]:
        """Per commit raw and newly stored bytes, and totals against what is on disk."""
        reachable = self.log(all_refs=True)
        with self.engine.connect() as conn:
            all_ = catalog.all_commits(conn)
        rows = [{"id": c.id, "step": c.step, "message": c.message, "raw_bytes": c.raw_bytes,
                 "stored_bytes": c.stored_bytes, "ratio": c.raw_bytes / max(c.stored_bytes, 1)}
                for c in sorted(all_.values(), key=lambda c: c.created_at)]
        stored_on_disk = sum(self.store.size(o) for o in self.store.iter_ids())
        raw = sum(r["raw_bytes"] for r in rows)
        return {"commits": rows, "reachable_commits": len(reachable), "raw_bytes": raw,
                "stored_bytes": stored_on_disk, "ratio": raw / max(stored_on_disk, 1)}

    def commits_needing(self, object_ids: list[str]) -> list[CommitId]:
        """Commits whose checkout reads any of `object_ids` (directly or through a delta chain)."""
        with self.engine.connect() as conn:
            tensors = set(conn.execute(select(tensor_chunks.c.tensor_id).where(
                tensor_chunks.c.object_id.in_(object_ids))).scalars())
            dependents = _dependents(conn, tensors)
            cids = set(conn.execute(select(commit_tensors.c.commit_id).where(
                commit_tensors.c.tensor_id.in_(list(dependents)))).scalars()) if dependents else set()
            cids |= set(conn.execute(select(commits.c.id).where(
                commits.c.manifest_object.in_(object_ids))).scalars())
        return sorted(CommitId(c) for c in cids)


def _dependents(conn, tensor_ids: set[str]) -> set[str]:
    """`tensor_ids` and every tensor whose chain passes through one of them."""
    found, frontier = set(tensor_ids), set(tensor_ids)
    while frontier:
        children = set(conn.execute(select(tensors.c.id).where(tensors.c.base_id.in_(list(frontier)))).scalars())
        frontier = children - found
        found |= frontier
    return found


def _relative_l2(old: RawTensor, new: RawTensor, torch) -> float | None:
    a, b = materialize(old), materialize(new)
    if not (a.is_floating_point() and b.is_floating_point()) or a.shape != b.shape:
        return None
    a64, b64 = a.double(), b.double()
    norm = torch.linalg.vector_norm(a64).item()
    delta = torch.linalg.vector_norm(b64 - a64).item()
    return delta / norm if norm else (0.0 if delta == 0 else float("inf"))


def _measured_fisher(model: Any, calibration: Callable[[Any], Any] | None, level: LossyLevel | None
                     ) -> dict[str, float] | None:
    """Per parameter name, the empirical Fisher measured with `calibration` (None when not asked)."""
    if calibration is None:
        return None
    if model is None:
        raise CkptError("a calibration loss needs the live model too (commit(..., model=model))")
    if level is None or not level.weights_lossy:
        raise CkptError("a calibration loss only steers lossy weights: pass lossy='balanced' or 'extreme'")
    return measure_fisher(model, calibration)


def _importance_note(fisher: Mapping[str, float] | None, plans: Mapping[str, Any]) -> str | None:
    """What the manifest says of a measured sensitivity: how many lossy weights it steered."""
    if fisher is None:
        return None
    steered = sum(1 for path in fisher if path in plans)
    return f"measured on a calibration batch ({steered} weights)"


def _param_names(model: Any, optimizer: Any) -> list[str] | None:
    """Names of the optimizer's parameters in state order, from the live model and optimizer."""
    if model is None or optimizer is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    return None if None in ordered else ordered


@contextlib.contextmanager
def _no_cyclic_gc():
    """Hold off Python's cyclic garbage collector while a commit or a checkout runs.

    Both allocate tens of thousands of short-lived containers and create no reference cycles, so
    the collections they would trigger only pause them: in the benchmark process a full
    collection took 0.2-0.3 s and landed inside a 0.5 s commit, and a checkout of the MiniLM
    checkpoint in a process that had imported transformers took 0.3-0.4 s instead of 0.2 s.
    Collections resume afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _is_accelerator(device: Any) -> bool:
    """True for a device other than the CPU (where the numpy replay is the fast path)."""
    return device is not None and str(device) != "cpu" and not str(device).startswith("cpu:")


def _default_author() -> str:
    try:
        return os.environ.get("CKPT_AUTHOR") or getpass.getuser()
    except Exception:
        return "unknown"
