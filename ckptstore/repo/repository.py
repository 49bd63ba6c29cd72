"""`Repository`: opens a repository (config, store, metadata, threads) and delegates each verb to its module."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CkptError, CorruptObjectError
from ckptstore.hashing import CommitId, ObjectId
from ckptstore.metadata import Database, absolute_url, kept_url
from ckptstore.metadata import commits as commit_rows
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.objectstore.fallback import FallbackStore, held_here
from ckptstore.repo import journal, owner, refs, warm
from ckptstore.repo.config import RepoConfig
from ckptstore.repo.location import DATABASE, REPO_DIR, find_root, unwritable
from ckptstore.repo.lock import repo_lock

if TYPE_CHECKING:
    from ckptstore.metadata.commits import CommitInfo
    from ckptstore.policy import EncodingSettings, LossyLevel
    from ckptstore.repo.background import BackgroundCommit, Lane
    from ckptstore.repo.diff import TensorDiff
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.progress import Progress


class Repository:
    """A checkpoint repository: its objects in a store, its metadata in a database, both named by its config."""

    def __init__(self, root: Path, config: RepoConfig, store: ObjectStore | None = None, read_only: bool = False,
                 why: str = "", create: bool = False, folder: Path | None = None) -> None:
        self.root = root
        self.dir = folder or root / REPO_DIR  # `folder`: init's, built under another name (repo/creation.py)
        self.config = config
        objects = config.objects_url or "objects"  # a relative path is relative to .ckpt/
        # a configured folder that is gone is said so on open, not made anew (only init makes one)
        self.store = store if store is not None else open_store(
            objects, self.dir / "tmp", self.dir, create=create or not config.objects_url, read_only=read_only)
        lazy = [remote for remote in config.remotes.values() if remote.lazy]
        if lazy and store is None:  # a lazy clone: objects not here yet come from the remote on first read
            from ckptstore.repo.remote import remote_store

            self.store = FallbackStore(self.store, lambda: remote_store(lazy[0].resolved(root)), keep=not read_only)
        # only init (create) may start a schema: an open that finds none must not start a new history
        self.db = Database(absolute_url(config.metadata_url, root) or f"sqlite:///{self.dir / DATABASE}", read_only,
                           why, create=create)
        if not self.read_only:
            # a checkout killed among its renames: finished, HEAD moved with it
            journal.finish_interrupted(self.dir, lambda cid, branch: refs.finish_head_move(self, cid, branch))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = os.getpid()
        self._shared_pool = False  # the pool is a warm process's (repo/warm.py): closing leaves it running
        self._background: Lane | None = None  # commits in the background (repo/background.py)
        self.joined = False  # set by init where it found the metadata made (a teammate's): it joined, made nothing
        warm.load_machinery()  # before the program's first call: a handler that saves finds no half-imported module

    @property
    def read_only(self) -> bool:
        """Whether this process may not write here: a read-only mount, --read-only, or a full disk (for now)."""
        return self.db.read_only

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def init(cls, path: str | os.PathLike = ".", metadata_url: str = "", encoding: EncodingSettings | None = None,
             lossy: str = "", objects_url: str = "") -> Repository:
        """Create a repository in `path` with HEAD on an unborn `main` branch (`lossy`: default level).

        A `metadata_url` naming a server database that already holds a repository joins it: its
        refs and commits stay as they are (how a second machine opens a shared repository). If
        the metadata cannot be opened, nothing is left behind, so the same command can run again;
        nor if it is killed (repo/creation.py).
        """
        from ckptstore.policy import EncodingSettings, level_named
        from ckptstore.repo.creation import create

        level_named(lossy or None)  # reject unknown names before creating anything
        # a relative SQLite path is taken from the current folder, as a shell user means it, and kept absolute
        # unless it is inside the repository: then relative to it, so that it moves with it
        root = Path(path).resolve()
        config = RepoConfig(encoding or EncodingSettings(), kept_url(absolute_url(metadata_url, Path.cwd()), root),
                            lossy=lossy, objects_url=objects_url)
        return create(root, config)

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, read_only: bool | None = None) -> Repository:
        """Open the repository at or above `path` (or CKPT_REPO, or the cwd); upgrades its schema.

        `read_only` None: read-only exactly when this process may not write its `.ckpt` folder or
        its SQLite database, wherever that is (a read-only mount, another user's files). Read-only,
        opening writes nothing and every writing verb raises ReadOnlyRepoError before it starts.
        """
        root = find_root(path)
        config = RepoConfig.load(root / REPO_DIR / "config.toml")
        why = "opened with --read-only" if read_only else unwritable(root / REPO_DIR, config.metadata_url)
        return cls(root, config, read_only=bool(why) if read_only is None else read_only, why=why)

    def own_folders(self) -> list[Path]:
        """Its `.ckpt/` and its local object store wherever objects_url put it (never content), links resolved.

        The store's owner file beside it (repo/owner.py) is the repository's too.
        """
        store = getattr(held_here(self.store), "root", None)
        own = [self.dir, *([store, owner.marker(Path(os.path.realpath(store)))] if store else [])]
        return [Path(os.path.realpath(path)) for path in own]

    def close(self) -> None:
        if self._background is not None:  # the background commit in flight ends first
            self._background.close()
        if self._pool is not None and not self._shared_pool:
            self._pool.shutdown(wait=True)
        self._pool = None
        self.db.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads that hash, encode and decode; started on first use."""
        # a forked child has none of the parent's threads; a warm pool of an old thread count was shut down
        if self._pool is None or self._pool_pid != os.getpid() or (self._shared_pool and self._pool._shutdown):
            self._pool_pid = os.getpid()
            threads = self.config.threads or os.cpu_count() or 1
            shared = warm.shared_pool(self.root, threads)  # a long-lived process's threads, kept across opens
            self._shared_pool = shared is not None
            self._pool = shared or ThreadPoolExecutor(threads, thread_name_prefix="ckpt")
        return self._pool

    @contextlib.contextmanager
    def lock(self, exclusive: bool = False, wait: bool = True) -> Iterator[None]:
        """The repository lock: commits hold it shared, gc alone (only writers take it; none in another's store).

        The folder's file lock, and on a shared database its lock there too, so a gc on one machine
        never removes the objects a commit on another has written but not yet recorded.
        """
        self.db.refuse_writes()
        owner.refuse_anothers(self, writing=not exclusive)
        with repo_lock(self.dir / "lock", exclusive, wait), self.db.repository_lock(exclusive, wait):
            yield

    # ----------------------------------------------------------------- reading objects and metadata
    def read_object(self, oid: ObjectId) -> bytes:
        """An object's verified bytes; damage is reported with the commits it breaks."""
        try:
            return self.store.get(oid)
        except CorruptObjectError as exc:
            raise exc.needed_by(self.commits_needing(exc.object_ids)) from None

    def manifest(self, cid: CommitId) -> Manifest:
        """The manifest of commit `cid`; PrunedCommitError where a prune removed it (while this read it too)."""
        from ckptstore.repo.integrity import kept_manifest
        return kept_manifest(self, self.commit_info(cid))  # read outside the row's read: a lazy clone may fetch it

    def read_manifest(self, oid: ObjectId) -> Manifest:
        """The manifest stored as object `oid`."""
        from ckptstore.repo.manifest import Manifest

        return Manifest.from_bytes(self.read_object(oid), oid)

    def commit_info(self, ref: str) -> CommitInfo:
        with self.db.read() as tx:
            return commit_rows.commit_info(tx, refs.resolve(tx, ref))

    def commits_needing(self, object_ids: list[ObjectId]) -> list[CommitId]:
        """Commits whose checkout reads any of `object_ids` (directly or through a delta chain)."""
        with self.db.read() as tx:
            return commit_rows.commits_needing(tx, object_ids)

    # ----------------------------------------------------------------- refs
    def resolve(self, ref: str = "HEAD") -> CommitId:
        """The commit id a ref expression names."""
        with self.db.read() as tx:
            return refs.resolve(tx, ref)

    def head(self) -> tuple[str | None, CommitId | None]:
        """(branch HEAD is on or None when detached, commit or None when unborn)."""
        return refs.head(self)

    def branches(self) -> dict[str, CommitId]:
        """Branches by name as their rows hold them (refs.stored_refs)."""
        return refs.stored_refs(self, refs.BRANCH)

    def tags(self) -> dict[str, CommitId]:
        """Tags by name as their rows hold them (refs.stored_refs)."""
        return refs.stored_refs(self, refs.TAG)

    def branch(self, name: str, start: str = "HEAD") -> CommitId:
        """Create branch `name` at `start`; HEAD does not move."""
        return refs.branch(self, name, start)

    def tag(self, name: str, ref: str = "HEAD") -> CommitId:
        """Create tag `name` at `ref`; tags never move."""
        return refs.tag(self, name, ref)

    def delete_branch(self, name: str) -> CommitId | None:
        """Remove branch `name` (its commits stay until `gc --prune`); not the branch HEAD is on."""
        return refs.delete_branch(self, name)

    def delete_tag(self, name: str) -> CommitId | None:
        """Remove tag `name` (its commit stays until `gc --prune` if nothing else reaches it)."""
        return refs.delete_tag(self, name)

    # ----------------------------------------------------------------- verbs
    def commit(self, state_or_path: Any, message: str = "", *, step: int | None = None,
               metrics: Mapping[str, float] | None = None, branch: str | None = None, allow_empty: bool = False,
               trust_pickle: bool = False, author: str | None = None, progress: Progress | None = None,
               lossy: str | LossyLevel | None = None, model: Any = None, optimizer: Any = None,
               calibration: Callable[[Any], Any] | None = None, max_loss_change: float | None = None,
               blocking: bool = True, buffer_budget: int | None = None, knobs: Mapping[str, Any] | None = None,
               **more_knobs: Any) -> CommitId | BackgroundCommit:
        """Store a checkpoint (a path to a file or folder, or an in-memory state) as a new commit.

        See `repo.commit.CommitOptions` (what it records, where it goes), `repo.commit.LossyOptions`
        (how lossy it is) and `repo.background` (`blocking=False`, `buffer_budget`) for every argument.
        Lossy knobs come as `knobs` (a mapping: any name, checked as a knob) or as keyword arguments.
        """
        from ckptstore.repo.background import commit_call
        from ckptstore.repo.commit import CommitOptions, LossyOptions

        both = sorted(set(knobs or {}) & set(more_knobs))
        if both:
            raise CkptError(f"lossy knob {both[0]!r} is given twice, in knobs= and as an argument")
        options = CommitOptions(message, step, dict(metrics or {}), branch, allow_empty, trust_pickle, author)
        lossy_options = LossyOptions(lossy, {**(knobs or {}), **more_knobs}, model, optimizer, calibration,
                                     max_loss_change)
        return commit_call(self, state_or_path, options, lossy_options, progress, blocking, buffer_budget)

    def checkout(self, ref: str = "HEAD", device: str | None = None, progress: Progress | None = None,
                 keys: Iterable[str] | None = None) -> Any:
        """The checkpoint at `ref` in memory, or its part matching `keys` (see `repo.checkout.checkout`)."""
        from ckptstore.repo.checkout import checkout
        return checkout(self, ref, device, progress, keys)

    def checkout_to(self, ref: str, output: str | os.PathLike | None = None, force: bool = False,
                    progress: Progress | None = None, keys: Iterable[str] | None = None,
                    trust_pickle: bool = False, on_resolved: Callable[[CommitInfo, Any], None] | None = None) -> Path:
        """Write the checkpoint at `ref` (or its part matching `keys`) to disk and return where.

        `trust_pickle`: a sharded commit's non-tensor items kept as DCP's pickles (committed with trust) are
        written as they are stored, unread. `on_resolved(info, manifest)`: told the commit `ref` named, first.
        """
        from ckptstore.repo.checkout import checkout_to

        if output is None and keys is None:
            self.db.refuse_writes("checkout without -o (it moves HEAD)")
        return checkout_to(self, ref, output, force, progress, keys, trust_pickle, on_resolved)

    def log(self, ref: str | Sequence[str] | None = None, all_refs: bool = False, limit: int | None = None
            ) -> list[CommitInfo]:
        """Commits reachable from `ref` (default HEAD; a ref, `A..B`, `A...B` or several) or every ref, newest first."""
        from ckptstore.repo.history import log

        return refs.sound_part(log, self, ref, all_refs, limit)  # damaged rows: warned of, the rest listed

    def decorations(self) -> dict[CommitId, list[str]]:
        """Ref names by commit, with `HEAD -> branch` like git."""
        from ckptstore.repo.history import decorations

        return decorations(self)

    def log_graph(self, all_refs: bool = False, *, ref: str | Sequence[str] | None = None, limit: int | None = None,
                  lanes: bool = True) -> list[str]:
        """`log --graph` lines of `log(ref, all_refs, limit)`'s commits (`lanes=False`: `log --oneline`'s)."""
        from ckptstore.repo.history import log_graph

        return refs.sound_part(log_graph, self, ref, all_refs, limit, lanes)

    def show(self, ref: str = "HEAD") -> dict[str, Any]:
        """A commit's metadata and its files and tensors."""
        from ckptstore.repo.history import show

        return show(self, ref)

    def stats(self) -> dict[str, Any]:
        """Per commit raw and newly stored bytes, and totals against what is stored."""
        from ckptstore.repo.history import stats

        return refs.sound_part(stats, self)  # damaged rows: warned of, the rest counted

    def diff(self, a: str, b: str | None = None) -> list[TensorDiff]:
        """Per tensor path: added, removed, changed or unchanged, with the relative L2 change (`a` alone: `A..B`)."""
        from ckptstore.repo.diff import diff

        return diff(self, a, b)

    def status(self) -> dict[str, Any]:
        """HEAD, and whether the files HEAD was committed from still hold its content."""
        from ckptstore.repo.worktree import status

        return status(self)
