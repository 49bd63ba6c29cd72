"""Hugging Face Trainer: commit each `checkpoint-N` folder as the Trainer saves it, and restore one to resume.

`CkptCallback` commits on `on_save`, on the main process only, byte for byte (or lossy), with the
step, the latest logged metrics (an evaluation's only from that step) and the run name; with
`keep_folders=K` it then deletes the older folders it has committed, keeping the newest K on disk
for the Trainer's own resume.

The commit begins at the first hook after on_save (the next step's or epoch's beginning, the
epoch's end, or on_train_end), so files that callbacks after this one write into the folder in
their own on_save are in it. By default it runs in the background (`blocking=False`): the thread
reads the folder later, so the folder must stay until the commit is done. The Trainer deletes
folders only in its own rotation (`save_total_limit`, inside its next save, before that save's
on_save) and, with `save_total_limit=1` and a best model, right before on_train_end with no hook
between. So the callback waits for the commit in flight at `on_step_end` / `on_epoch_end` whenever
the Trainer is about to save or evaluate (a save follows only those), and commits the last save of
a run inside on_save, blocking, when `save_total_limit=1` and a best model is tracked. A folder is
deleted by `keep_folders` only once its commit's result is in; a failed commit raises at the next
step, save or on_train_end, and its folder stays. A save whose next hook never comes (the step
after it failed) is committed when the next `train()` begins, or at exit. `restore` writes a
committed folder back as `output_dir/checkpoint-N` for `trainer.train(resume_from_checkpoint=...)`.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 (its exit hook must be registered before ours: _commit_the_waiting)
import json
import os
import re
import shutil
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptstore.api import with_repo
from ckptstore.errors import BackgroundCommitError, CkptError, DirtyWorktreeError, RefExistsError, RetentionError
from ckptstore.hashing import CommitId
from ckptstore.integrations.unchanged import head_if_unchanged
from ckptstore.repo import background
from ckptstore.repo.location import given_root
from ckptstore.repo.watch import TRAINER_STATE
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptstore.repo import Repository
    from ckptstore.repo.background import BackgroundCommit

_FOLDER = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")


def latest_metrics(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The latest logged value of every numeric key in the Trainer's `state.log_history` up to `step`.

    An evaluation's metrics (`eval_*`) count only when logged at `step` itself: an earlier one's
    would stand for a checkpoint it never evaluated, and `--keep-best eval_loss` would keep it.
    """
    metrics: dict[str, float] = {}
    for entry in log_history:
        at = entry.get("step")
        if isinstance(at, int) and at > step:
            continue
        for key, value in entry.items():
            fresh = at == step or not key.startswith("eval_")
            if key != "step" and fresh and isinstance(value, int | float) and not isinstance(value, bool):
                metrics[key] = float(value)
    return metrics


class CkptCallback(TrainerCallback):
    """Commit each `checkpoint-N` folder right after the Trainer writes it.

    Args:
        repo: an open `Repository`, or the folder of one; None: CKPT_REPO, else the one holding the current folder.
        lossy: lossy level for the commits (None: the repository's default).
        branch: commit to this branch (created at HEAD if new) instead of HEAD's.
        keep_folders: once a folder's commit is recorded, delete the committed `checkpoint-*`
            folders except the newest K on disk (None: delete nothing). Never deletes a folder
            this callback did not commit, nor one committed lossy (warned of once: the store holds no
            exact copy of it), nor the Trainer's best model checkpoint.
        blocking: commit before training goes on (True), or in the background while it does
            (False, the default; see the module's docstring for when it waits). `calibration=`
            runs the live model, so it always commits blocking.
        **knobs: lossy knobs, as for `Repository.commit`.
    """

    def __init__(self, repo: str | os.PathLike | Repository | None = None, *, lossy: str | None = None,
                 branch: str | None = None, keep_folders: int | None = None, blocking: bool = False,
                 **knobs: Any) -> None:
        if keep_folders is not None and (type(keep_folders) is not int or keep_folders < 0):
            raise CkptError(f"keep_folders={keep_folders!r}: pass a whole number of folders to keep, 0 or more, "
                            "or None to delete none")
        self.repo, self.lossy, self.branch, self.keep_folders, self.knobs = repo, lossy, branch, keep_folders, knobs
        self.blocking = blocking or knobs.get("calibration") is not None
        self.committed: dict[Path, CommitId] = {}  # folders this callback committed (resolved), and their commits
        self._lossy: set[Path] = set()  # committed folders whose commit is lossy: the only exact copy, never deleted
        self._saved: _Saved | None = None  # a save whose commit has not begun
        self._pending: tuple[Path, CommitId | BackgroundCommit] | None = None  # the latest commit, not yet settled
        self._opened: Repository | None = None  # the repository opened from a path, kept open for commits in flight
        self._prune_at_end = False  # the last save was committed inside on_save: prune at on_train_end
        self._output_dir: Path | None = None  # where the folders committed last were saved
        _ALL.add(self)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Note `args.output_dir/checkpoint-{global_step}` for a commit at the next hook (main process only).

        Every rank waits here for the others first: each writes its own `rng_state_K.pth` into the
        folder, and no barrier of the Trainer's comes between those writes and this hook.
        """
        _every_rank_saved()
        if not state.is_world_process_zero:
            return
        self._settle(state)
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise CkptError(f"the Trainer saved step {state.global_step} but {folder} is not a folder: CkptCallback "
                            "commits the checkpoint-N folders of args.output_dir (no hyperparameter search runs)")
        # with save_total_limit=1 the Trainer deletes the last folder before on_train_end (when it is
        # not the best one) and no hook runs in between: that last commit (at max_steps, or where a
        # callback such as early stopping ends training) must read the folder now
        last = state.global_step >= state.max_steps or control.should_training_stop
        now = args.save_total_limit == 1 and last and state.best_model_checkpoint is not None
        self._note(args, state, folder, self.blocking or now, _live(kwargs))
        if now:  # its pruning waits for on_train_end: callbacks after this one may still read the folder
            self._prune_at_end = True
            self._begin()

    def _note(self, args: TrainingArguments, state: TrainerState, folder: Path, blocking: bool,
              live: dict[str, Any]) -> None:
        """Keep `folder` for a commit at the next hook, or at exit where none comes (the next step failed).

        Another Trainer's save of the same folder left waiting (a failed `train()` before this resumed
        one) is this one's now: it is not committed twice.
        """
        for other in list(_WAITING):
            if other._saved and other._saved.state is not state and other._saved.folder.resolve() == folder.resolve():
                other._saved = None
                _WAITING.discard(other)
        self._saved = _Saved(folder, state.global_step, latest_metrics(state.log_history, state.global_step),
                             blocking, args, state, live)
        _WAITING.add(self)
        background.end_on_sigterm_after(_holding)  # a SIGTERM before the next hook: commit it at the exit

    def _begin(self, blocking: bool | None = None) -> None:
        """Begin the commit of the folder on_save noted, if any: every callback's on_save has written it by now."""
        saved, self._saved = self._saved, None
        _WAITING.discard(self)
        if saved is None:
            return
        folder, step, metrics, args, state = saved.folder, saved.step, saved.metrics, saved.args, saved.state
        blocking = saved.blocking if blocking is None else blocking
        run = args.run_name or Path(args.output_dir).name
        repo = self._repository()
        _warn_of_a_training_metric_kept_best(repo, args)
        _COMMITTING.append(self)  # a SIGTERM meanwhile ends the process as an exit does: its hook commits it
        try:
            result = head_if_unchanged(repo, self.branch, lambda: repo.commit(
                folder, message=f"{run}: {folder.name}", step=step, metrics=metrics, branch=self.branch,
                lossy=self.lossy, blocking=blocking, **saved.live, **self.knobs))
        except RetentionError as exc:
            result = _recorded_despite(exc, folder)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, a SIGTERM: nothing recorded, and the exit commits it
            self._saved = saved
            _WAITING.add(self)
            raise
        finally:
            _COMMITTING.remove(self)
        self._pending = (folder, result)
        if blocking:
            self._settle(state)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """Begin the commit of the last step's save."""
        self._begin()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Begin the commit of the last epoch's save."""
        self._begin()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Wait for the commit in flight before the Trainer saves again or ends: either may delete that folder.

        A save follows only should_save or should_evaluate (save_strategy="best"); once training
        stops, the Trainer's end-of-training rotation runs before on_train_end. on_epoch_end runs
        after the loop breaks, so a stop set by a callback after this one is seen there.
        """
        if control.should_save or control.should_evaluate or control.should_training_stop:
            self._settle(state)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Begin the commit of the last step's save; then as on_step_end, for the saves at the end of an epoch."""
        self._begin()
        self.on_step_end(args, state, control)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Wait for the commit in flight where a callback before this one asked for a save here.

        That save's rotation (`save_total_limit`) may delete the folder the commit is reading.
        """
        if control.should_save:
            self._settle(state)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """As on_log, for a save asked for on an evaluation."""
        self.on_log(args, state, control)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Open the repository on the main process now: a wrong path said at the first save wasted the steps before.

        A run resumed from `checkpoint-N` of output_dir gets that folder committed at the first step
        unless the branch's head holds it already (the run that saved it may have died in its commit).
        Saves of earlier `train()` calls that failed before their next hook are committed now, before
        this run's: at exit they would have gone on top of its commits.
        """
        self._prune_at_end = False  # an earlier train() that failed after its last save
        if state.is_world_process_zero:
            repo = self._repository()
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if state.global_step and _resumed_from(folder, state, kwargs.get("model")):
                holders = _holders(repo, folder, state.global_step)
                if not holders:
                    self._note(args, state, folder, self.blocking, _live(kwargs))  # takes over another Trainer's save
                else:  # its commits go on from the commit holding it: a new branch starts there, else it is said
                    _go_on_from(repo, folder, holders, self.branch)
            _commit_waiting([c for c in _WAITING if c is not self],
                            lambda line: warn_caller(line, RuntimeWarning))
            self._begin()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Commit the last save, wait for it (raising its failure), prune, and close the repository opened here."""
        try:
            self._begin()
            self._settle(state)
            self._prune_at_end = False
            self._prune(state)
        finally:
            if self._opened is not None:
                self._opened.close()
                self._opened = None

    def _repository(self) -> Repository:
        from ckptstore.repo import Repository

        if isinstance(self.repo, Repository):
            return self.repo
        if self._opened is None:
            self._opened = Repository.open(given_root(self.repo))
        return self._opened

    def _settle(self, state: TrainerState) -> None:
        """Take the latest commit's result, record its folder as committed, then prune; raise its failure."""
        if self._pending is None:
            return
        folder, result = self._pending
        if not isinstance(result, str):
            handle = result
            try:
                result = _result_of(handle, folder, self._repository(), self.branch)
            except BaseException:
                if handle.done():  # the commit's own failure; Ctrl-C while waiting leaves it pending
                    self._pending = None
                raise
        self._pending = None
        self.committed[folder.resolve()] = result
        self._output_dir = folder.parent
        if self.keep_folders is not None:
            self._note_lossy(folder, result)
        self._prune(state)

    def _note_lossy(self, folder: Path, commit: CommitId) -> None:
        """Spare `folder` from keep_folders when its commit is lossy: the store holds no exact copy of it."""
        level = self._repository().commit_info(commit).lossy
        if not level:
            return
        if not self._lossy:
            warn_caller(f"[keep_folders] {folder.name} was committed lossy ({level}), so it is kept on disk as the "
                        "only exact copy; keep_folders deletes only folders committed byte for byte: pass "
                        "lossy='none' to commit them so", RuntimeWarning)
        self._lossy.add(folder.resolve())

    def _prune(self, state: TrainerState) -> None:
        """`keep_folders`: delete the older committed folders no other CkptCallback has yet to commit."""
        if self.keep_folders is None or self._prune_at_end or self._output_dir is None:
            return
        held = {folder.resolve() for other in list(_ALL) if other is not self for folder in other._holds()}
        held |= self._lossy
        remove_committed_folders(self._output_dir, self.committed, self.keep_folders, state.best_model_checkpoint,
                                 state.global_step, held)

    def _holds(self) -> list[Path]:
        """The folders this callback has yet to commit: noted, or in flight."""
        return [*([self._saved.folder] if self._saved else []), *([self._pending[0]] if self._pending else [])]


def _live(hook_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's model and optimizer a hook was given, for a lossy commit's pairing; none unless both."""
    live = {key: hook_kwargs[key] for key in ("model", "optimizer") if hook_kwargs.get(key) is not None}
    return live if len(live) == 2 else {}


@dataclass
class _Saved:
    """A save noted in on_save, committed at the next hook: the folder and what the commit records."""

    folder: Path
    step: int
    metrics: dict[str, float]
    blocking: bool
    args: TrainingArguments
    state: TrainerState
    live: dict[str, Any]  # the Trainer's model and optimizer: a lossy commit pairs weights with moments by them


# callbacks holding a save not yet begun; held strongly: a Trainer gone out of scope with its failed
# run (a script's main() that raised) must still have its save committed at exit
_WAITING: set[CkptCallback] = set()
_ALL: weakref.WeakSet[CkptCallback] = weakref.WeakSet()  # every callback: keep_folders spares what others hold


_COMMITTING: list[CkptCallback] = []  # callbacks inside a commit they began (a blocking one may be interrupted)


def _holding() -> bool:
    return bool(_WAITING or _COMMITTING)


def _commit_waiting(callbacks: list[CkptCallback], say: Callable[[str], None]) -> None:
    """Commit (blocking) the saves `callbacks` hold; a folder gone since is passed over, a failure said."""
    for callback in callbacks:
        folder = callback._saved.folder if callback._saved else None
        if folder is None or not folder.is_dir():  # rotated out, or deleted by the user since: nothing to commit
            callback._saved = None
            _WAITING.discard(callback)
            continue
        try:
            callback._begin(blocking=True)
        except Exception as exc:  # the folder stays on disk
            say(f"{folder} was not committed ({exc}); commit it with `ckpt commit {folder}`")


def _commit_the_waiting() -> None:
    """At exit, commit the saves whose next hook never came: the step after failed, or Ctrl-C.

    Ctrl-C or a second SIGTERM meanwhile ends it: the folders committed stay recorded, the rest stay on disk,
    and the exit status stays as set (143 after the SIGTERM that began the exit). A SystemExit out of an
    exit hook was printed as a traceback and skipped the hooks after it.
    """
    try:
        _commit_waiting(list(_WAITING), lambda line: print(f"ckptstore: {line}", file=sys.stderr))
    except (KeyboardInterrupt, SystemExit):  # at exit, not raised: the folders stay on disk
        left = sorted({str(callback._saved.folder) for callback in _WAITING if callback._saved})
        _WAITING.clear()  # given up: a SIGTERM from here ends the process as its default would (_on_sigterm)
        print(f"ckptstore: interrupted while committing saved checkpoint folders at exit; not committed: "
              f"{', '.join(left) or 'none'}; they stay on disk: commit them with `ckpt commit`, or resume from "
              "them", file=sys.stderr)


def _resumed_from(folder: Path, state: TrainerState, model: Any) -> bool:
    """Whether `folder` is the one the run resumed from: its state and weights are what the run just loaded.

    Its trainer_state.json is the state, its model.safetensors the model's weights. Another run's
    folder of the same step, left in output_dir, is not: its weights differ (its history may not,
    where no step was logged yet).
    """
    try:
        saved = json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(saved, dict) and saved.get("global_step") == state.global_step
            and saved.get("log_history") == state.log_history):
        return False
    weights = folder / "model.safetensors"
    if model is None or not weights.is_file():  # sharded or .bin weights: the state alone tells
        return True
    from safetensors import safe_open

    loaded = model.state_dict()
    try:
        with safe_open(weights, framework="pt") as stored:  # a tensor at a time: no second copy of a large model
            shared = [k for k in stored.keys() if k in loaded]
            return bool(shared) and all(_same_tensor(stored.get_tensor(k), loaded[k]) for k in shared)
    except Exception:  # not a safetensors file the library reads: not the weights the model loaded
        return False


def _same_tensor(stored: Any, loaded: Any) -> bool:
    """Bit for bit (a NaN weight is its own equal here)."""
    import torch

    if stored.shape != loaded.shape or stored.dtype != loaded.dtype:
        return False
    as_bytes = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (stored, loaded)]
    return torch.equal(*as_bytes)


def _holders(repo: Repository, folder: Path, step: int) -> set[CommitId]:
    """The commits that each hold every file of `folder` as it is (committed, or written by a checkout of them).

    A folder restored from a lossy commit differs from the originals that commit records, so
    committing it again would not be refused as unchanged: a second commit of the same save. A lossy
    commit's own folder (kept by keep_folders) is found by the digests its manifest records, among
    the commits of its `step` (manifests read for those only): the store gives other bytes back, so no file
    row names them.
    """
    from ckptstore.formats.filemap import file_digest
    from ckptstore.metadata import files as file_rows

    try:
        digests = {path.relative_to(folder).as_posix(): file_digest(path) for path in sorted(folder.rglob("*"))
                   if path.is_file()}
        with repo.db.read() as tx:
            holders = [set(file_rows.commits_of_digest(tx, digest)) for digest in digests.values()]
        if holders and (found := set.intersection(*holders)):
            return found
        return {info.id for info in repo.log(all_refs=True) if info.kind == "folder"
                and info.lossy and not info.pruned and info.step == step and repo.manifest(info.id).digests == digests}
    except (CkptError, OSError):
        return set()


def _go_on_from(repo: Repository, folder: Path, holders: set[CommitId], branch: str | None) -> None:
    """A run resumed from `folder`, which `holders` hold: `branch`, not made yet, starts at that commit.

    Else a branch whose tip is another commit is said (its commits follow that tip), unless `restore`
    wrote the folder and said it. A resume from a folder left in output_dir went on from the tip unsaid.
    """
    branches = repo.branches()
    target = branch or repo.head()[0]
    tip = branches.get(target) if target else repo.head()[1]
    if tip in holders:
        return
    held = sorted(holders)[0]
    if branch is not None and branch not in branches:
        repo.branch(branch, held)
        return
    if str(folder.resolve()) in _RESTORED:
        return
    warn_caller(f"this run resumed from {folder.name} ({held[:12]}), which is not the tip of "
                f"{f'branch {target!r}' if target else 'HEAD'} ({str(tip)[:12]}): its commits follow that tip, not "
                "it; pass CkptCallback(branch=NEW), NEW a branch not made yet, to go on from it")


_RESTORED: set[str] = set()  # folders `restore` wrote, where it said whether their resume follows the tip


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) leaves the parent's waiting saves to the parent.

    Its exit hook committed them too, racing the parent's: the loser said 'was not committed'.
    """
    for callback in list(_WAITING):
        callback._saved = None
    _WAITING.clear()
    _COMMITTING.clear()


# before the thread pools stop at exit (atexit.register runs after: a commit could not start its pool)
getattr(threading, "_register_atexit", atexit.register)(_commit_the_waiting)
os.register_at_fork(after_in_child=_forget_in_child)


def _result_of(handle: BackgroundCommit, folder: Path, repo: Repository, branch: str | None) -> CommitId:
    """The commit id of a background commit of `folder`; its failure as a BackgroundCommitError."""
    try:
        return head_if_unchanged(repo, branch, handle.result)
    except RetentionError as exc:
        return _recorded_despite(exc, folder, warn=not handle.warned)
    except Exception as exc:
        raise BackgroundCommitError(
            f"the background commit of {folder} ({handle.description}) failed: {exc}. Nothing of it was recorded, "
            f"and CkptCallback never deletes a folder it has not committed: where it is still there, commit it "
            f"with `ckpt commit {folder}` or resume training from it") from exc


def _recorded_despite(exc: RetentionError, folder: Path, warn: bool = True) -> CommitId:
    """The id of a commit whose [retention] prune failed, said (once) as a warning: training goes on."""
    if warn:
        warnings.warn(f"{folder}: {exc}; the next commit's policy prunes again", RuntimeWarning, stacklevel=3)
    return CommitId(exc.commit_id)


def _warn_of_a_training_metric_kept_best(repo: Repository, args: TrainingArguments) -> None:
    """Say where [retention] keep_best keeps another checkpoint than the Trainer counts best.

    `keep_best = "loss"` keeps the best training loss (the Trainer's `metric_for_best_model="loss"` is
    eval_loss); keep_best keeps the minimum unless `:max` says otherwise (accuracy's best is its largest).
    """
    best, wanted = repo.config.retention.best(), args.metric_for_best_model
    if best and wanted and not wanted.startswith("eval_") and best[0] == wanted:
        warn_caller(f"[retention] keep_best = {best[0]!r} keeps the commit with the best logged {best[0]!r} (a "
                    f"training metric), while the Trainer's metric_for_best_model {wanted!r} means "
                    f"'eval_{wanted}': write keep_best = 'eval_{wanted}' to keep the checkpoint the Trainer counts "
                    "best")
    elif best and wanted and best[0] in (wanted, f"eval_{wanted}") and (best[1] == "max") != bool(
            args.greater_is_better):
        way = "max" if args.greater_is_better else "min"
        warn_caller(f"[retention] keep_best = {best[0]!r} keeps its {best[1]}imum, while the Trainer counts the "
                    f"{way}imum of {wanted!r} best: write keep_best = '{best[0]}:{way}'")


def remove_committed_folders(output_dir: Path, committed: dict[Path, Any], keep: int,
                             protected: str | None = None, step: int | None = None,
                             held: Set[Path] = frozenset()) -> list[Path]:
    """Delete the `checkpoint-N` folders in `output_dir` that are in `committed`, except the newest `keep`.

    Newest by step among the checkpoint folders on disk, committed or not, but for those past `step`
    (the run's own) that were not: an earlier run's, left ahead of a run resumed from an older
    checkpoint, which would otherwise push the resumed run's newest folders out. `protected` (the
    best model's folder) is never deleted, nor one in `held` (resolved: another callback has yet to
    commit it). Returns the folders deleted, which leave `committed`.
    """
    on_disk = sorted((int(found[1]), path) for path in output_dir.iterdir()
                     if path.is_dir() and (found := _FOLDER.match(path.name)))
    ranked = [(n, path) for n, path in on_disk if step is None or n <= step or path.resolve() in committed]
    newest = {path for _, path in ranked[max(0, len(ranked) - keep):]}
    spared = {Path(protected).resolve()} if protected else set()
    spared |= held
    removed = []
    for _, path in on_disk:
        real = path.resolve()
        if path in newest or real in spared or real not in committed:
            continue
        if path.is_symlink():  # a folder linked in (a resume from elsewhere): the link goes, its target stays
            path.unlink()
        else:
            shutil.rmtree(path)
        del committed[real]
        removed.append(path)
    return removed


def restore(repo: str | os.PathLike | Repository, ref: str, output_dir: str | os.PathLike,
            force: bool = False, branch: str | None = None) -> Path:
    """Write the Trainer folder committed at `ref` to `output_dir/checkpoint-N`, byte for byte; return it.

    N is the commit's step. Pass the path to `trainer.train(resume_from_checkpoint=...)`. An
    existing folder of that name is written over only where its files are in the store, unless
    `force` (as `ckpt checkout -o`); files the commit does not hold are left in it. `branch`
    creates that branch at the commit, for `CkptCallback(branch=...)`: the resumed run's commits
    then follow the commit it resumed from. Without it, a commit behind HEAD's tip is warned of:
    the resumed run's commits would follow that tip instead.
    """
    return with_repo(repo, lambda opened: _restore(opened, ref, Path(output_dir), force, branch))


def _restore(opened: Repository, ref: str, output_dir: Path, force: bool, branch: str | None) -> Path:
    info = opened.commit_info(ref)
    if info.kind != "folder":
        raise CkptError(f"commit {info.id[:12]} ({ref}) is a {info.kind} commit, not a Trainer checkpoint folder: "
                        f"write it with `ckpt checkout {info.id[:12]} -o PATH` instead")
    step = info.step if info.step is not None else _step_of(info.source_path)
    if step is None:
        raise CkptError(f"commit {info.id[:12]} ({ref}) records no step and was not committed from a "
                        f"{PREFIX_CHECKPOINT_DIR}-N folder: write it with `ckpt checkout {info.id[:12]} -o PATH`")
    folder = output_dir / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    if _branch_at(opened, ref, info.id, branch):  # its resume was said here: the callback does not say it again
        _RESTORED.add(str(folder.resolve()))
    output_dir.mkdir(parents=True, exist_ok=True)
    try:
        return opened.checkout_to(info.id, folder, force=force)
    except DirtyWorktreeError as exc:  # its advice names the CLI's flags; a caller here has arguments
        if "--force" not in exc.advice:  # no flags to translate ("changed meanwhile ... commit it first"): as it is
            raise
        raise DirtyWorktreeError(exc.problem, "restore into another output_dir, or pass force=True") from None


def _every_rank_saved() -> None:
    """A barrier over the job's ranks, where torch.distributed runs one of several."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _branch_at(opened: Repository, ref: str, cid: CommitId, branch: str | None) -> bool:
    """Make `branch` at `cid` for the resumed run's commits; without one, warn where they would not follow it.

    Whether it warned.
    """
    if branch is not None:
        if opened.branches().get(branch, cid) != cid:
            raise CkptError(f"branch {branch!r} exists at another commit; pass a new name to branch from {ref!r}")
        if branch not in opened.branches():
            try:
                opened.branch(branch, cid)
            except RefExistsError:  # another rank's restore made it meanwhile: fine where it is at the commit
                if opened.branches().get(branch) != cid:
                    raise
    elif opened.head()[1] not in (None, cid):
        warn_caller(f"{ref!r} ({cid[:12]}) is not the tip of HEAD: a run resumed from it commits after the "
                    "tip, not after it; pass branch=NAME here and to CkptCallback to branch from it")
        return True
    return False


def _step_of(source_path: str | None) -> int | None:
    found = _FOLDER.match(Path(source_path).name) if source_path else None
    return int(found[1]) if found else None
