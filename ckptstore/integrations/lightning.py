"""PyTorch Lightning: a `CheckpointIO` plugin that commits each checkpoint Lightning saves.

`Trainer(plugins=[CkptstoreCheckpointIO(repo)])` turns every `trainer.save_checkpoint(path)` (so
every `ModelCheckpoint` save) into a commit on a branch, tagged with a name derived from the path
(`ref_for_path`), and leaves a small JSON marker file at the path instead of a pickle. Removing a
checkpoint deletes its tag and marker; its commit stays in the branch's history, where later saves
are deltas on it, until retention (`ckpt prune --keep-tagged`) removes it.
Loading takes a marker path, a path whose marker is gone (its tag), or any ref or commit id.

By default (`blocking=False`) a save returns once the state is snapshotted and the commit runs in
the background; its tag and marker are written as soon as it is (on its thread), so a process
killed later keeps them. A failure is raised as a BackgroundCommitError by the next save, load,
remove or teardown, which first wait for the commit in flight; at the process's exit, for a save
made outside `fit`, it is a warning.
One commit per repository is in flight, so a second save in a row (`last.ckpt` right after a
top-k save) waits for the first. Lightning's `AsyncCheckpointIO` wrapping this plugin also runs
saves on a thread, but its removes and loads do not wait for them; prefer `blocking=False`.

One class serves both Lightning packages: `pytorch_lightning` (whose Trainer takes a
`lightning_fabric` CheckpointIO) and the unified `lightning` (`lightning.pytorch.Trainer`, which
takes a `lightning.fabric` one). Lightning accepts a plugin by `isinstance` alone, so the class
derives from the CheckpointIO of each package installed; either may be missing.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import re
import secrets
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

from ckptstore.errors import (
    BackgroundCommitError,
    CkptError,
    InvalidRefNameError,
    NothingToCommitError,
    RefNotFoundError,
    RetentionError,
)
from ckptstore.formats.atomic import TEMP_SUFFIX
from ckptstore.hashing import CommitId
from ckptstore.integrations.unchanged import head_if_unchanged
from ckptstore.repo import Repository
from ckptstore.repo import refs as ref_names
from ckptstore.repo.background import BackgroundCommit
from ckptstore.repo.location import given_root

try:  # pytorch_lightning's Trainer (and lightning_fabric's Fabric) accept this base
    from lightning_fabric.plugins import CheckpointIO as _StandaloneCheckpointIO
except ImportError:
    _StandaloneCheckpointIO = None
try:  # the unified package's: lightning.pytorch.Trainer checks for this one, a different class
    from lightning.fabric.plugins import CheckpointIO as _UnifiedCheckpointIO
except ImportError:
    _UnifiedCheckpointIO = None
except Exception:
    # importing `lightning` loads all of lightning.pytorch: a broken or mismatched install of it
    # must not take the plugin away from pytorch_lightning users, who never asked for it
    if _StandaloneCheckpointIO is None:
        raise
    _UnifiedCheckpointIO = None

MARKER_FORMAT = "ckptstore-lightning-marker/1"
MARKER_MAX_BYTES = 4096  # a marker is ~300 bytes; anything larger is a real checkpoint file
DEFAULT_PREFIX = "lightning"
# each installed package's CheckpointIO, once (dict.fromkeys: should both names ever be one class)
_CHECKPOINT_IO_BASES = tuple(dict.fromkeys(b for b in (_StandaloneCheckpointIO, _UnifiedCheckpointIO) if b))
if not _CHECKPOINT_IO_BASES:
    raise ImportError("ckptstore.integrations.lightning needs Lightning 2.x: pip install lightning "
                      "(for `import lightning`) or pytorch-lightning (for `import pytorch_lightning`)")


_UNSETTLED: weakref.WeakSet[CkptstoreCheckpointIO] = weakref.WeakSet()  # plugins with a commit not yet settled
_PLUGINS: weakref.WeakSet[CkptstoreCheckpointIO] = weakref.WeakSet()  # every plugin: a forked child renews each


def _settle_at_exit() -> None:
    """Write the tags and markers of commits still unsettled when the process ends.

    A save outside `fit` (`trainer.save_checkpoint` after it) has no teardown to settle it. This
    runs after the interpreter waited for the background commits (threading's exit hooks come
    before atexit's), so only the tag and marker are left to write.
    """
    for plugin in list(_UNSETTLED):
        try:
            plugin.settle()
        except Exception as exc:  # the process is ending: say it, there is no caller left to raise to
            warnings.warn(f"ckptstore: at exit, {exc}", RuntimeWarning, stacklevel=1)


def _forget_in_child() -> None:
    """A forked child has none of the parent's commit threads: it leaves the commits in flight to the parent.

    Its exit waited for ever to settle one (a future only the parent's thread resolves), and a lock
    another thread of the parent held at the fork stayed held in it.
    """
    for plugin in list(_PLUGINS):
        plugin._pending, plugin._lock = None, threading.RLock()
    _UNSETTLED.clear()


atexit.register(_settle_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


def ref_for_path(path: str | os.PathLike, prefix: str = DEFAULT_PREFIX) -> str:
    """The tag a checkpoint path maps to: `PREFIX/` + the file name without `.ckpt`, made ref-safe.

    Runs of characters a ref may not hold become `_`, so `dir/epoch=1-step=20.ckpt` is
    `lightning/epoch_1-step_20` and `last.ckpt` is `lightning/last`; the folder is not part of it.
    A name too long for a tag keeps its start and ends in `-` and 12 hex digits of the whole name's
    digest, so it still fits (a tag made after its commit was refused, with training stopped).
    """
    stem = _stem(path)
    if stem.endswith((".lock", ".")):  # refused by git, and here: `x.` in a range would read as `x` and `.`
        stem += "_"
    room = ref_names.MAX_NAME - len(prefix) - 1
    if len(stem) > room:
        digest = hashlib.sha256(Path(os.fspath(path)).name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        stem = f"{stem[: max(room - 13, 0)]}-{digest}"
    return f"{prefix}/{stem}"


def _stem(path: str | os.PathLike) -> str:
    """The file name without `.ckpt`, each run of characters a ref may not hold as `_` (ref_for_path's stem)."""
    name = Path(os.fspath(path)).name
    stem = name[: -len(".ckpt")] if name.endswith(".ckpt") else name
    return re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", stem)).lstrip(".") or "_"


def _tags_of(path: str | os.PathLike, prefix: str) -> list[str]:
    """ref_for_path's tag, then the one an older ckptstore gave a name ending in '.' (`x..ckpt`: `lightning/x.`)."""
    tag = ref_for_path(path, prefix)
    # not `x._.ckpt`: its own tag was always x._; nor a name too long, whose tag no older ckptstore could make
    return [tag, tag[:-1]] if _stem(path).endswith(".") and tag.endswith("._") else [tag]


def read_marker(path: str | os.PathLike) -> dict[str, str] | None:
    """The marker at `path` (ref, commit, repository), or None when `path` is no marker file.

    Only JSON text is parsed: a real checkpoint file at the path is never unpickled here.
    """
    try:
        with open(path, "rb") as handle:
            head = handle.read(MARKER_MAX_BYTES + 1)
    except OSError:
        return None
    if len(head) > MARKER_MAX_BYTES or not head.startswith(b"{"):
        return None
    try:
        marker = json.loads(head)
    except (ValueError, RecursionError):  # RecursionError: 4 KiB of "[" is no marker either
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def write_marker(path: str | os.PathLike, repo_root: Path, ref: str, cid: CommitId | None) -> None:
    """Write the marker for `ref` at `path` atomically (Lightning's `fs.exists`, `last` search, links need it).

    A commit of None marks a background commit still running (see `_drop_pending_marker`).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": MARKER_FORMAT, "repository": str(repo_root), "ref": ref, "commit": cid}
    # not the name's (255 bytes fit no longer one), and one a folder commit leaves out as a writer's leftover
    temp = target.with_name(f".ckpt-marker.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    temp.write_text(json.dumps(body, indent=1) + "\n")
    if target.is_symlink():  # save_last="link" left a link here: replace the link, not the file it names
        target.unlink()
    os.replace(temp, target)


def _drop_pending_marker(path: str | os.PathLike) -> None:
    """Remove the marker of a background commit that failed (never a settled marker, nor a user's file)."""
    marker = read_marker(path)
    if marker is not None and marker.get("commit") is None and not os.path.islink(path):
        os.unlink(path)


def monitored_metrics(checkpoint: dict[str, Any], path: str | os.PathLike) -> dict[str, float]:
    """The score each `ModelCheckpoint` monitors, where it ranked the save at `path` (finite ones only).

    A save no callback ranked (`last.ckpt` after a state outside the top k) has no score: Lightning's
    `current_score` there is still that of the callback's last ranked save, steps earlier.
    """
    metrics = {}
    where = os.path.abspath(path)
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (str(key).startswith("ModelCheckpoint") and isinstance(state, dict)):
            continue
        monitor, ranked = state.get("monitor"), state.get("best_k_models") or {}
        score = next((s for p, s in ranked.items() if os.path.abspath(p) == where), None)
        if isinstance(monitor, str) and score is not None and math.isfinite(value := float(score)):
            metrics[monitor] = value
    return metrics


def _warn_off_main_thread() -> None:
    """Say once that saves come from another thread (Lightning's AsyncCheckpointIO): removes do not wait for them."""
    warnings.warn("ckptstore: CkptstoreCheckpointIO saves on a thread of its own here (Lightning's "
                  "AsyncCheckpointIO?): ModelCheckpoint's removes do not wait for those saves, so the tags and "
                  "markers of checkpoints it dropped may stay (keeping their commits from `ckpt prune "
                  "--keep-tagged`). Pass the plugin alone: it commits in the background itself",
                  RuntimeWarning, stacklevel=3)


def _failure_of(handle: BackgroundCommit) -> BaseException | None:
    """Why a finished background commit recorded nothing; None where it did (nothing changed, or its prune failed)."""
    failure = handle.failure()
    return None if isinstance(failure, (NothingToCommitError, RetentionError)) else failure


def _lightning_unwinds() -> bool:
    """Whether the exception being handled is a run's own, caught by Lightning to tear down before re-raising.

    Its traceback begins where it was caught: the innermost `_call_and_handle_interrupt` (Lightning's)
    running now. An exception a caller handles around `fit` (a retry loop) is not the run's, nor another
    trainer's whose handler runs this fit; a Lightning that renamed its handler makes every failure raise.
    """
    handled = sys.exc_info()[1]
    caught = handled.__traceback__ if handled is not None else None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_call_and_handle_interrupt":
        frame = frame.f_back
    # the innermost one on the stack: a fit run from another trainer's handler (an on_exception callback) is
    # inside that one's, caught elsewhere
    return caught is not None and frame is not None and caught.tb_frame is frame


def _device(map_location: Any) -> str | None:
    """A device name from Lightning's map_location (a name or torch.device); anything else loads on the CPU."""
    import torch

    return str(map_location) if isinstance(map_location, (str, torch.device)) else None


class CkptstoreCheckpointIO(*_CHECKPOINT_IO_BASES):
    """Save, load and remove Lightning checkpoints as commits of a ckptstore repository.

    A plugin for `pytorch_lightning.Trainer` and `lightning.pytorch.Trainer` alike (module docstring).

    Args:
        repo: an open Repository (left open), or the folder of one (opened on first use and
            closed at teardown); None: CKPT_REPO, else the one holding the working directory.
        branch: the branch commits go on (default: HEAD's branch); each save's parent is its tip.
        prefix: the first part of every tag name (see `ref_for_path`).
        markers: write a marker file at each checkpoint path (Lightning's `ckpt_path="last"`,
            `save_last="link"` and its file-name versioning look for files there).
        lossy: a lossy level for the commits (default: the repository's); resuming from a lossy
            commit is not bit-exact.
        trust_pickle: let `load_checkpoint` unpickle arbitrary objects from a plain (non-marker)
            checkpoint file; never applies to what the store holds.
        blocking: commit inside `save_checkpoint` (True), or in the background (False, the
            default): the tag and marker then follow as soon as the commit is written (module docstring).
    """

    def __init__(self, repo: Repository | str | os.PathLike | None = None, branch: str | None = None,
                 prefix: str = DEFAULT_PREFIX, markers: bool = True, lossy: str | None = None,
                 trust_pickle: bool = False, blocking: bool = False) -> None:
        ref_names.check_name(prefix)
        ref_names.check_parts(prefix)  # as the tags made under it will be: a '.x' part refused at construction
        self._given = repo if isinstance(repo, Repository) else None
        self._location = None if isinstance(repo, Repository) else repo
        self._opened: Repository | None = None
        self.branch, self.prefix, self.markers, self.lossy = branch, prefix, markers, lossy
        self.trust_pickle, self.blocking = trust_pickle, blocking
        self._paths: dict[str, str] = {}  # ref -> the path that claimed it in this process
        self._pending: tuple[str, str | os.PathLike, BackgroundCommit] | None = None  # (ref, path, handle) in flight
        # AsyncCheckpointIO saves on its thread while the trainer's removes and loads come from the main one
        self._lock = threading.RLock()
        self._loaded: tuple[CommitId, int | None] | None = None  # the commit load_checkpoint gave last, its step
        _PLUGINS.add(self)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (ddp_spawn sends the plugin to each process) as the repository's folder, reopened there."""
        state = dict(self.__dict__, _given=None, _opened=None, _pending=None)
        del state["_lock"]
        if self._given is not None or self._opened is not None:
            state["_location"] = (self._given or self._opened).root
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.RLock())
        _PLUGINS.add(self)

    @property
    def repo(self) -> Repository:
        """The repository, opened on first use when a folder was given."""
        if self._given is not None:
            return self._given
        if self._opened is None:
            self._opened = Repository.open(given_root(self._location))
        return self._opened

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        """Commit `checkpoint`, tag it with `ref_for_path(path)` and write the marker at `path` (once committed)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}); "
                            "leave them unset")
        if self.markers and "://" in os.fspath(path):
            raise CkptError(f"cannot write a marker file at {os.fspath(path)!r}: markers are local files; give "
                            "ModelCheckpoint a local dirpath, or CkptstoreCheckpointIO(markers=False)")
        if threading.current_thread() is not threading.main_thread():
            _warn_off_main_thread()
        with self._lock:
            self._save(checkpoint, path)

    def _save(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
        self._settle_unless_unwinding()  # an on_exception save (OnExceptionCheckpoint) after a failed one
        self._go_on_from_the_loaded(checkpoint.get("global_step"))  # first: where the branch starts counts below
        ref, repo = self._claim(path), self.repo
        if ref in repo.branches():
            raise CkptError(f"checkpoint {os.fspath(path)!r} maps to {ref!r}, which is a branch of {repo.root}; "
                            "pass CkptstoreCheckpointIO(prefix=...) so checkpoint tags do not meet your branches")
        try:
            result = self._commit(checkpoint, path)
        except RetentionError as exc:  # recorded: tag it and go on, the next commit's policy prunes again
            self._record_despite(ref, path, exc)
            return
        if isinstance(result, str):
            self._record(ref, path, result)
            return
        self._pending = (ref, path, result)
        _UNSETTLED.add(self)
        if self.markers and not os.path.lexists(path):
            # a marker without its commit yet, so the path exists now: ModelCheckpoint names the next save
            # of a repeating filename "-v1" only if it sees this one, and save_last="link" links to it
            write_marker(path, repo.root, ref, None)
        result.when_done(self._settle_once_written)  # last: it may run here at once (the lock is ours)

    def _settle_once_written(self, handle: BackgroundCommit) -> None:
        """Write the tag and marker as soon as the commit is written, on its thread.

        A process killed after that (out of memory, preempted) before its next save kept a marker
        naming no commit, or last.ckpt's older one, though the commit was stored. A failure stays
        pending: the next save, load or teardown raises it.
        """
        if _failure_of(handle) is not None:
            return
        with self._lock:
            pending = self._pending
            if pending is None or pending[2] is not handle:  # settled meanwhile by a save, load or teardown
                return
            try:
                self._settle(*pending)
            except Exception:  # nobody to tell on this thread: pending again, the next save raises it
                self._pending = pending
                _UNSETTLED.add(self)

    def _go_on_from_the_loaded(self, step: Any) -> None:
        """A run resumed from a loaded commit: a `branch=` not made yet starts there; else say where commits go.

        Told at the first save that goes on from the loaded commit (a later step), not at the load:
        `trainer.test(ckpt_path="best")` loads such commits without resuming anything. A new branch
        began at HEAD (the old run's tip), unsaid, whatever commit the run resumed from; it starts at
        the loaded commit at any save, as a save at the loaded step itself (an export, an on-exception
        save) used up the load and left it to begin at HEAD.
        """
        loaded = self._loaded
        if loaded is None:
            return
        if self.branch is not None and self.branch not in self.repo.branches():
            self.repo.branch(self.branch, loaded[0])
            self._loaded = None
            return
        if isinstance(step, int) and loaded[1] is not None and step <= loaded[1]:
            return  # not going on from it yet: a later save still says where its commits go
        self._loaded = None
        if not isinstance(step, int) or loaded[1] is None:
            return
        branch = self.branch or self.repo.head()[0]
        tip = self.repo.branches().get(branch) if branch else None
        if tip not in (None, loaded[0]):
            warnings.warn(f"ckptstore: this run resumed from commit {loaded[0][:12]} (step {loaded[1]}), which is "
                          f"not the tip of branch {branch!r}: its commits follow the tip ({tip[:12]}), not it; pass "
                          "CkptstoreCheckpointIO(branch=NEW), NEW a branch not made yet, to go on from it",
                          RuntimeWarning, stacklevel=4)

    def settle(self) -> None:
        """Wait for the commit in flight, then write its tag and marker; raise its failure."""
        with self._lock:
            if self._pending is not None:
                self._settle(*self._pending)

    def _settle(self, ref: str, path: str | os.PathLike, handle: BackgroundCommit) -> None:
        try:
            cid = head_if_unchanged(self.repo, self.branch, handle.result)
        except RetentionError as exc:
            self._settled()
            self._record_despite(ref, path, exc, warn=not handle.warned)
            return
        except Exception as exc:
            self._settled()
            _drop_pending_marker(path)
            raise BackgroundCommitError(
                f"the background commit of checkpoint {os.fspath(path)!r} ({handle.description}) failed: {exc}. "
                f"Nothing of it was recorded and no tag {ref!r} or marker was written: save it again "
                "(trainer.save_checkpoint), or resume from an earlier checkpoint") from exc
        self._settled()  # only now: Ctrl-C or SIGTERM while waiting leaves the commit pending, to settle later
        self._record(ref, path, cid)

    def _settle_unless_unwinding(self) -> None:
        """`settle()`; where Lightning handles the run's own exception, a failed commit is a warning instead."""
        unwinding = _lightning_unwinds()  # here: inside the except clause below, the error caught is the one handled
        try:
            self.settle()
        except BackgroundCommitError as exc:
            if not unwinding:
                raise
            warnings.warn(f"ckptstore: {exc}", RuntimeWarning, stacklevel=3)

    def _settled(self) -> None:
        self._pending = None
        _UNSETTLED.discard(self)

    def _record_despite(self, ref: str, path: str | os.PathLike, exc: RetentionError, warn: bool = True) -> None:
        """Tag and mark a commit whose [retention] prune failed, and say so (once): training goes on."""
        self._record(ref, path, CommitId(exc.commit_id))
        if warn:
            warnings.warn(f"checkpoint {os.fspath(path)!r}: {exc}; it is tagged {ref!r}, and the next commit's "
                          "policy prunes again", RuntimeWarning, stacklevel=2)

    def _record(self, ref: str, path: str | os.PathLike, cid: CommitId) -> None:
        """Tag `cid` as `ref` (moving the tag if the path was saved before) and write the marker."""
        repo = self.repo
        held = repo.tags().get(ref)
        if held != cid:  # tagged already when two threads settled one commit (AsyncCheckpointIO)
            if held is not None:  # the path was saved before (last.ckpt): its tag moves to the new commit
                repo.delete_tag(ref)
            repo.tag(ref, cid)
        if self.markers:
            write_marker(path, repo.root, ref, cid)

    def _claim(self, path: str | os.PathLike) -> str:
        """The tag for `path`, refusing a second path that maps to the same tag in this run, or another run's tag."""
        ref = ref_for_path(path, self.prefix)
        try:  # before the commit, as repo.tag will check it: a tag refused after it left a commit unnamed
            with self.repo.db.read() as tx:
                ref_names.check_made_name(ref, self.repo.config.remotes, tx)
        except InvalidRefNameError as exc:
            raise CkptError(f"checkpoint {os.fspath(path)!r} cannot be tagged: {exc}; pass a shorter or other "
                            "CkptstoreCheckpointIO(prefix=...)") from None
        where = os.path.abspath(os.fspath(path))
        claimed = self._paths.get(ref)
        if claimed is None:
            self._refuse_anothers_tag(ref, path)
            claimed = self._paths[ref] = where
        if claimed != where:
            # a tag names the file, not its folders: metric names with "/" (val/loss) put Lightning's files in
            # subfolders, where two saves with the same rounded value share a file name
            raise CkptError(f"checkpoints {claimed!r} and {where!r} both map to tag {ref!r} (a tag keeps only the "
                            "file name); give each checkpoint its own file name: a filename template without '/' "
                            "(a metric named val/loss makes a subfolder: ModelCheckpoint(filename=..., "
                            "auto_insert_metric_name=False)), different file names for two ModelCheckpoint "
                            "callbacks, or two plugins with different prefixes")
        return ref

    def _refuse_anothers_tag(self, ref: str, path: str | os.PathLike) -> None:
        """Never move a tag that another run's checkpoint holds: its ModelCheckpoint may still list it.

        With `keep_tagged`, the tag is what keeps that commit from retention. A tag moves when the
        same path is saved again (its marker names the tag's commit) or its commit is in the history
        of the branch this plugin commits to (an earlier run of it, or the run resumed). In that last
        case the earlier run's file may still be on disk elsewhere (Lightning's `version_N` folders
        share file names), so its commit keeps a tag of its own, `REF-COMMIT12`.
        """
        repo = self.repo
        held = repo.tags().get(ref)
        marker = read_marker(path) if self.markers else None
        if held is None or (marker or {}).get("commit") == held:
            return
        branch = self.branch or repo.head()[0] or "HEAD"
        try:
            history = {info.id for info in repo.log(branch)}
        except RefNotFoundError:  # an unborn branch has no history
            history = set()
        if held in history:
            if self.markers:  # without markers no earlier file names the commit
                self._keep_earlier(ref, held)
            return
        raise CkptError(
            f"checkpoint {os.fspath(path)!r} maps to tag {ref!r}, which another run's checkpoint holds (commit "
            f"{held[:12]}, not in the history of branch {branch!r}); moving it could lose a checkpoint that "
            "run still lists. Give this run tags of its own (CkptstoreCheckpointIO(prefix=...)), or delete "
            f"that run's tag if it is over (`ckpt tag -d {ref}`)")

    def _keep_earlier(self, ref: str, held: CommitId) -> None:
        """Tag `held` as `REF-COMMIT12` before `ref` moves off it, and say so: an earlier run's file may name it."""
        kept = f"{ref[: ref_names.MAX_NAME - 13]}-{held[:12]}"  # a long checkpoint name's tag still fits
        if kept in self.repo.tags():
            return
        self.repo.tag(kept, held)
        warnings.warn(f"ckptstore: tag {ref!r} moves to this run's checkpoint; the commit it named ({held[:12]}, "
                      f"an earlier run's, whose file may still be on disk) keeps tag {kept!r}, so `ckpt prune "
                      f"--keep-tagged` keeps it: `ckpt tag -d {kept}` once that file is gone", RuntimeWarning,
                      stacklevel=5)

    def _commit(self, checkpoint: dict[str, Any], path: str | os.PathLike) -> CommitId | BackgroundCommit:
        step = checkpoint.get("global_step")
        message = f"Lightning checkpoint {Path(path).name} (epoch {checkpoint.get('epoch')}, step {step})"
        # last.ckpt right after the top-k save of the same state: nothing changed, the head holds it
        return head_if_unchanged(self.repo, self.branch, lambda: self.repo.commit(
            checkpoint, message, step=step if isinstance(step, int) else None,
            metrics=monitored_metrics(checkpoint, path), branch=self.branch, lossy=self.lossy, blocking=self.blocking))

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint a marker path, a checkpoint path's tag, a ref or a commit id names.

        A plain checkpoint file at `path` (not a marker) is read with torch.load: `weights_only` as
        Lightning passes it (`fit(..., weights_only=False)` is the user's explicit ask), and where it
        passes None, weights_only unless this plugin trusts pickles.
        """
        self.settle()
        spec = os.fspath(path)
        self._wait_for_other_saves_of(spec)
        marker = read_marker(spec) if os.path.isfile(spec) else None
        if os.path.isfile(spec) and marker is None:
            return self._load_file(spec, map_location, not self.trust_pickle if weights_only is None else weights_only)
        cid = self._marked_commit(spec, marker) if marker is not None else self._named_commit(spec)
        checkpoint = self.repo.checkout(cid, device=_device(map_location))
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        self._loaded = (cid, step if isinstance(step, int) else None)
        return checkpoint

    def _wait_for_other_saves_of(self, spec: str) -> None:
        """Wait for this process's commits of the checkpoint `spec` names in flight in other plugins (a Trainer's).

        A load right after `trainer.save_checkpoint(path)` read the marker as it was: naming no commit,
        or, for a path saved again, the save before. A failed one is told here and left to its plugin
        to raise at its next save or teardown.
        """
        where, ours = os.path.realpath(spec), os.path.realpath(self.repo.root)
        marker = read_marker(spec) if os.path.isfile(spec) else None  # a link's target's too
        # only one naming no commit yet: a settled marker (another version_N folder's last.ckpt) loads as it is
        marked = marker.get("ref") if marker is not None and marker.get("commit") is None else None
        for plugin in list(_UNSETTLED):
            pending = plugin._pending
            if plugin is self or pending is None or os.path.realpath(plugin.repo.root) != ours:
                continue
            if spec != pending[0] and marked != pending[0] and where != os.path.realpath(pending[1]):
                continue
            handle = pending[2]
            handle.wait()
            failure = _failure_of(handle)
            if failure is not None:
                raise CkptError(f"{spec}: this process's last save of it ({handle.description}) failed: {failure}. "
                                "Load an earlier checkpoint")
            plugin.settle()

    def _load_file(self, path: str, map_location: Any | None, weights_only: bool) -> dict[str, Any]:
        import torch

        return torch.load(path, map_location=map_location, weights_only=weights_only)

    def _named_commit(self, spec: str) -> CommitId:
        """The commit a ref or commit id names, or the tag of a checkpoint path whose marker is gone."""
        tags = _tags_of(spec, self.prefix)
        names = tags if spec.endswith(".ckpt") or tags[0] == spec else [spec, *tags]  # another suffix (final.pt) too
        for name in names:
            try:
                return self.repo.resolve(name)
            except RefNotFoundError:
                pass
        raise CkptError(f"no checkpoint at {spec!r}: no file there, and {' nor '.join(map(repr, names))} names no "
                        f"ref or commit of {self.repo.root}; pass a checkpoint path, a tag such as "
                        f"{self.prefix}/last, or a commit id (`ckpt log --all` lists them)")

    def _marked_commit(self, path: str, marker: dict[str, str]) -> CommitId:
        """The commit a marker names: its id names the same content in any repository that holds it."""
        if marker.get("commit") is None:
            raise CkptError(f"{path} marks a checkpoint not committed: its background commit is still running "
                            "in another process, or its process ended before it was recorded (then delete the "
                            "marker and resume from an earlier checkpoint)")
        try:
            return self.repo.resolve(str(marker.get("commit")))
        except RefNotFoundError:
            raise CkptError(f"{path} marks commit {str(marker.get('commit'))[:12]} of the repository at "
                            f"{marker.get('repository')!r}, which {self.repo.root} does not hold; open that "
                            "repository (CkptstoreCheckpointIO(repo=...)) or fetch from it") from None

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the tag of `path` and its marker (or link); the commit stays for retention to remove."""
        with self._lock:
            self._remove(path)

    def _remove(self, path: str | os.PathLike) -> None:
        self.settle()
        for ref in _tags_of(path, self.prefix):
            try:
                self.repo.delete_tag(ref)
            except RefNotFoundError:
                pass  # never saved here, or already removed: as with a file that is gone
            self._paths.pop(ref, None)
        target = Path(path)
        if target.is_symlink() or read_marker(target) is not None:
            target.unlink()  # a plain checkpoint file here is not ours: it stays

    def teardown(self) -> None:
        """Settle the commit in flight, then close the repository if this plugin opened it (reopened on next use).

        Where the run's own exception is on its way out (Lightning tears down in its handler), a failed
        commit is a warning: raised, it took that exception's place.
        """
        try:
            self._settle_unless_unwinding()
        finally:
            if self._opened is not None:
                self._opened.close()
                self._opened = None


def load_from_checkpoint(module_class: Any, path: str | os.PathLike, repo: Repository | str | os.PathLike | None = None,
                         map_location: Any | None = None, **kwargs: Any) -> Any:
    """`module_class.load_from_checkpoint(path)` for a checkpoint the plugin saved: a marker path, a tag, a commit id.

    Lightning's own reads `path` with torch.load, which a marker file is not; this hands it the
    restored checkpoint instead. `kwargs` go to Lightning's (strict=, hparams_file=, ...). `repo`
    None: as for CkptstoreCheckpointIO, else the repository a marker names.
    """
    import io

    import torch

    marker = read_marker(path) if repo is None else None
    named = marker.get("repository") if marker else None
    # the repository found as the plugin finds it, else the one the marker names (run from outside it)
    places = [repo, named] if isinstance(named, str) else [repo]
    for place in places:
        plugin = CkptstoreCheckpointIO(place)
        try:
            checkpoint = plugin.load_checkpoint(path, map_location)
            break
        except CkptError:
            if place is places[-1]:
                raise
        finally:
            plugin.teardown()
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return module_class.load_from_checkpoint(buffer, map_location=map_location, **kwargs)
