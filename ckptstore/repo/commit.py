"""`commit`: store a checkpoint as a new commit (DESIGN.md's write path, steps 1-3).

The checkpoint is read and its tensors named by content; a lossless tensor already stored is
reused, the others are encoded (lossy ones per their plan) and written as objects; then one
metadata transaction records everything and moves the branch with compare-and-swap.
"""

from __future__ import annotations

import copy
import math
import operator
import os
import time
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore import faults, formats
from ckptstore.errors import (
    CheckpointFormatError,
    CkptError,
    CorruptObjectError,
    NonFiniteError,
    NothingToCommitError,
    SourceRemovedError,
    UnquantizableError,
    UnquantizableTensorsError,
    with_reasons,
)
from ckptstore.formats import filemap
from ckptstore.formats.atomic import changed_while_read, file_stamp
from ckptstore.formats.dcpmeta import is_dcp_dir
from ckptstore.formats.folder import folder_files, is_git_name
from ckptstore.formats.torchcontainer import left_in_container
from ckptstore.hashing import CommitId, ObjectId, TensorId, bytes_digest, tensor_id
from ckptstore.metadata import Tx
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import files as file_rows
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.metadata.commits import CommitInfo
from ckptstore.objectstore.base import lacking, tells_lacking
from ckptstore.objectstore.fallback import held_here
from ckptstore.policy import LossyLevel, level_named
from ckptstore.policy import check_knobs as check_knobs  # `ckpt commit --knob`'s, through ckptstore.repo
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource
from ckptstore.repo import calibrate, chaincost, received
from ckptstore.repo.creation import STAGING
from ckptstore.repo.gcpause import no_cyclic_gc
from ckptstore.repo.manifest import Entry, Manifest
from ckptstore.repo.planecache import cache_of
from ckptstore.repo.progress import NoProgress, Progress
from ckptstore.repo.pruning import after_commit
from ckptstore.repo.repo_folders import nested_repositories, repository_part_holding
from ckptstore.repo.target import Start, commit_target, conflict, default_author, move_ref
from ckptstore.repo.worktree import own_folder_holding
from ckptstore.repo.writer import Job, encode_jobs, lossless_jobs
from ckptstore.state import RawTensor, escape, readable_path, shared_view_paths
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.policy.lossy import LossyPlan
    from ckptstore.policy.mapping import OptimizerMap
    from ckptstore.repo.repository import Repository


MAX_AUTHOR = 255  # the metadata's author column
RESERVED_METRICS = "ckpt."  # metric names ckptstore records itself (calibrate.CALIBRATION_METRIC)


@dataclass
class CommitOptions:
    """What a commit records and where it goes.

    The parent is the tip of `branch` (default: HEAD's branch, or HEAD itself when detached).
    `allow_empty` records a commit even when the checkpoint equals its parent; `trust_pickle` lets
    the checkpoint file unpickle arbitrary objects (only for files the user trusts).
    """

    message: str = ""
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    branch: str | None = None
    allow_empty: bool = False
    trust_pickle: bool = False
    author: str | None = None
    start: Start | None = None  # where it goes, fixed when it was asked for (a background commit); else read at commit
    # a folder's files as the caller found them whole (ckpt watch): one gone when the commit lists it refuses it
    expect_files: frozenset[str] | None = None

    def __post_init__(self) -> None:
        """Refuse what the metadata cannot record before any work (a background commit: in the call, not later)."""
        self.step = _whole_step(self.step)
        self.message = "" if self.message is None else self.message
        self.author = self.author or default_author()
        for what, text in (("message", self.message), ("author", self.author), ("branch", self.branch or "")):
            _check_text(what, text)
        self.message = _cleaned(self.message)
        if len(self.author) > MAX_AUTHOR:
            raise CkptError(f"the author {self.author[:40]!r}... has {len(self.author)} characters; the metadata "
                            f"keeps at most {MAX_AUTHOR} (set a shorter CKPT_AUTHOR)")
        names: dict[str, Any] = {}
        for name, value in self.metrics.items():  # recorded as str(name): {3: 2.0, "3": 5.0} would keep one
            _check_text("metric name", str(name))
            if str(name).startswith(RESERVED_METRICS):
                raise CkptError(f"metric {name!r}: names beginning {RESERVED_METRICS!r} are ckptstore's own (a "
                                "calibrated commit's measured loss change); give it another name")
            if str(name) in names:
                raise CkptError(f"metrics {names[str(name)]!r} and {name!r} are both recorded as {str(name)!r}")
            names[str(name)] = name
            try:
                float(value)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise CkptError(f"metric {name!r} is {value!r}, not a number: give each metric as a float") from None


def _with_loss_change(options: CommitOptions, change: float | None) -> CommitOptions:
    """`options` recording a calibrated commit's measured loss change: a copy, as the options refuse the name."""
    if change is None:
        return options
    recorded = copy.copy(options)
    recorded.metrics = {**options.metrics, calibrate.CALIBRATION_METRIC: change * 100}
    return recorded


def _cleaned(message: str) -> str:
    """The message as git keeps one: each line's trailing spaces dropped, blank lines around it too, runs of them one.

    Lines end at a newline alone, and only spaces, tabs and carriage returns are dropped (git's white space).
    """
    lines: list[str] = []
    for line in message.split("\n"):
        line = line.rstrip(" \t\r")
        if line or (lines and lines[-1]):
            lines.append(line)
    return "\n".join(lines).rstrip("\n")


def _check_text(what: str, text: Any) -> None:
    """Refuse a commit's text that the metadata cannot store as written: not a str, a NUL, not UTF-8."""
    if not isinstance(text, str):
        raise CkptError(f"the commit {what} is a {type(text).__name__} ({text!r}), not text")
    if "\x00" in text:
        raise CkptError(f"the commit {what} holds a NUL character, which the metadata cannot store")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise CkptError(f"the commit {what} {text[:40]!r} holds characters that are not UTF-8 (lone surrogates, as "
                        "os.fsdecode gives for such bytes); ckptstore records text as UTF-8") from None


def _whole_step(step: Any) -> int | None:
    """The step as a Python int (an int, numpy or torch integer, or a whole float), refused otherwise.

    The metadata stores it as a 64-bit integer and the commit id hashes it: 2.5 or True would be
    stored as another value than the id says, and the commit could never be checked out.
    """
    if step is None:
        return None
    try:
        whole = int(step) if isinstance(step, float) and step.is_integer() else operator.index(step)
    except TypeError:
        whole = None
    if whole is None or isinstance(step, bool):
        raise CkptError(f"step {step!r} is not a whole number: give the training step as an int")
    if not -(1 << 63) <= whole < 1 << 63:
        raise CkptError(f"step {whole} is past what the metadata holds (a 64-bit integer)")
    return whole


@dataclass
class LossyOptions:
    """How lossy a commit is and what steers it.

    `level` picks a lossy level (default: the repository's, normally lossless) and `knobs`
    override its settings; `model` and `optimizer` (the live objects) name which optimizer state
    belongs to which weight; `calibration(model)`, the model's loss on a fixed batch, lets the
    commit measure each weight's sensitivity instead of estimating it from Adam's second moment.
    A calibration function (of the model, or without `model` of the restored state) also makes
    the commit measure the restored checkpoint's loss and tighten until its relative change is
    within `max_loss_change` (default: the level's promise; repo/calibrate.py).
    """

    level: str | LossyLevel | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    optimizer: Any = None
    calibration: Callable[[Any], Any] | None = None
    max_loss_change: float | None = None
    param_names: list[Any] | None = None  # the optimizer's parameter names, read from model and optimizer before
    norm_names: list[Any] | None = None  # the model's norm layers' parameter names, read from model before (the same)


@dataclass
class _Parent(Start):
    """Where a commit goes (target.Start), with what it needs of the commit it starts from."""

    manifest: Manifest | None = None
    records: dict[TensorId, TensorRecord] = field(default_factory=dict)  # the parent's tensors and their chains
    by_path: dict[str, TensorRecord] = field(default_factory=dict)  # without the lost ones
    lost: set[TensorId] = field(default_factory=set)  # recorded, but an object down their chain is gone
    false: set[TensorId] = field(default_factory=set)  # ours, recorded by a received record that lied (received.py)
    checked: set[TensorId] = field(default_factory=set)  # received records this commit checked and found true

    @property
    def renewed(self) -> set[TensorId]:
        """The recorded tensors this commit encodes again and whose rows it takes."""
        return self.lost | self.false


def commit(repo: Repository, source: Any, options: CommitOptions, lossy: LossyOptions | None = None,
           progress: Progress | None = None) -> CommitId:
    """Store `source` (a checkpoint file or folder path, or an in-memory state) as a new commit.

    Raises NothingToCommitError when nothing changed, ConflictError when another writer moved
    the branch meanwhile; in both cases no commit is recorded and earlier ones are untouched.
    """
    lossy = lossy or LossyOptions()
    progress = progress or NoProgress()
    level = level_named(lossy.level if lossy.level is not None else (repo.config.lossy or None), **lossy.knobs)
    if isinstance(source, (str, os.PathLike)) and is_dcp_dir(source):  # torch.distributed.checkpoint's folder
        from ckptstore.repo.dcpfiles import commit_dir

        return commit_dir(repo, source, options, level if lossy.level is not None else None)
    measured = _measured_fisher(lossy, level)
    with repo.lock(), no_cyclic_gc():
        with filemap.guard():  # a file cut short meanwhile: its maps read zeros (not SIGBUS) and it is refused
            source_path, checkpoint, digests, stamps = _read_source(repo, source, options.trust_pickle)
            _refuse_files_gone(source, checkpoint, options.expect_files)
            faults.point("commit:read")  # parsed and hashed whole; the tensors' bytes are read next
            sources = _tensor_ids(repo, checkpoint.tensors)
            guard = calibrate.loss_guard(lossy.calibration, lossy.model, lossy.max_loss_change, level, checkpoint)
            measured = _fisher_by_path(lossy.model, measured, checkpoint)  # once: each encoding attempt plans by it
            with repo.db.read() as tx:
                parent = _parent(repo, tx, options, checkpoint.tensors, sources)
            done, change, level = _encode_or_keep_whole(repo, checkpoint, parent, sources, level, lossy, measured,
                                                        progress, guard)
            _settle_changed(checkpoint, stamps, digests, sources)  # after every byte was read: a save is torn
        entries, encoded, sizes = done.entries, done.records, done.sizes
        options = _with_loss_change(options, change)
        entries.update({path: record.id for path, record in encoded.items() if path in checkpoint.tensors})
        manifest = Manifest(checkpoint.kind, checkpoint.files, {
            p: Entry(entries[p], raw.dtype, raw.shape) for p, raw in checkpoint.tensors.items()
        }, digests, level.name if level else None, done.pairing,
            _importance_note(done.fisher, done.plans, done.pairing), measured=done.remeasured,
            sources={p: sources[p] for p in done.plans}, empty_folders=checkpoint.empty_folders)
        if not options.allow_empty:
            _refuse_unchanged(manifest, parent, level)
        manifest_bytes = manifest.to_bytes()
        manifest_oid = repo.store.put(manifest_bytes)
        sizes[manifest_oid] = len(manifest_bytes)
        faults.point("commit:manifest-written")
        new_records = list({r.id: r for r in encoded.values()}.values())
        new_ids = {r.id for r in new_records}
        with repo.db.write() as tx:  # what is new is decided where it is recorded: no writer slips in between
            # listed records this commit encoded again from its own bytes (a lossy one is not reused for its
            # source): replaced, or found true of our source, they leave the list (received.taken_over)
            replaced, true = received.taken_over(repo, tx, new_records)
            renewed = parent.renewed | replaced
            stored = tensor_rows.newly_stored(tx, new_records, sizes, renewed)
            info = _commit_info(checkpoint, options, manifest_oid, stored, source_path, parent, level)
            move_ref(tx, parent, info.id)
            tensor_rows.save_records(tx, new_records, sizes, replace=renewed)
            commit_rows.insert_commit(tx, info, entries.values())
            tensor_rows.mark_checked(tx, parent.checked | (renewed & new_ids) | true)
            file_rows.remember(tx, [(d, info.id, f.size) for f in _given_back(checkpoint, entries, sources)
                                    if (d := digests.get(f.name))])
        faults.point("commit:ref-moved")
    return after_commit(repo, info.id)  # [retention] in config.toml: prunes once the commit is recorded


def _given_back(checkpoint: formats.Checkpoint, entries: Mapping[str, TensorId], sources: Mapping[str, TensorId]
                ) -> list[formats.CheckpointFile]:
    """The files whose every tensor the commit stores exactly (all, lossless): the store gives their content back.

    A checkout over such a file loses nothing; a file with a quantized tensor stays unsaved, as its
    original's values are in no commit.
    """
    inexact = [p for p, tid in entries.items() if tid != sources[p]]
    if checkpoint.kind != "folder":
        return [] if inexact else checkpoint.files
    roots = {p.split("/", 1)[0] for p in inexact}  # a folder's file keeps its entries under its escaped name
    return [f for f in checkpoint.files if escape(f.name) not in roots]


def _refuse_unchanged(manifest: Manifest, parent: _Parent, level: LossyLevel | None) -> None:
    """NothingToCommitError when the commit would hold what its parent holds.

    Not when the parent lost objects this commit stores again, or held a received record that lied
    (committing the file anew repairs it), nor at a lossy level when the files' own bytes changed: a
    checkpoint that moved less than the level's steps stores the parent's values, and is still the
    next checkpoint.
    """
    if parent.manifest is None or not manifest.same_content(parent.manifest):
        return
    if parent.renewed & {entry.tensor for entry in manifest.entries.values()}:
        return
    if level is not None and manifest.digests and manifest.digests != parent.manifest.digests:
        return
    if level is not None and not manifest.digests:  # a state has no bytes of its own to compare
        what = f"at level {level.name!r} its stored values equal the parent's"
    else:
        what = "the checkpoint equals its parent"
    raise NothingToCommitError(f"nothing changed since {parent.commit[:12]}: {what} (--allow-empty, allow_empty=True "
                               "from Python, records it anyway)")


WHOLE_ROUNDS = 3  # encodings that may each find more tensors to keep whole; then the checkpoint goes all lossless


def _encode_or_keep_whole(repo: Repository, checkpoint: formats.Checkpoint, parent: _Parent,
                          sources: Mapping[str, TensorId], level: LossyLevel | None, lossy: LossyOptions,
                          measured: dict[str, float] | None, progress: Progress, guard: calibrate.LossGuard | None
                          ) -> tuple[_Encoded, float | None, LossyLevel | None]:
    """`_encode_checked`, with the tensors the level cannot quantize (and those coded or paired with them) lossless.

    A float16 second moment that a level's grid would round to zero, say, is kept whole while the rest
    of the checkpoint keeps its level. NaN or infinite values (a diverged run), or no quantizable
    tensor left, keep the whole checkpoint lossless. Returns the level the commit was stored at.
    """
    whole: dict[str, str] = {}
    try:
        if level is not None:
            _refuse_nan(checkpoint)
        for _ in range(WHOLE_ROUNDS):
            try:
                done, change = _encode_checked(repo, checkpoint, parent, sources, level, lossy, measured, progress,
                                               guard, frozenset(whole))
            except UnquantizableTensorsError as exc:
                whole.update(exc.reasons)
                continue
            if whole:
                warn_caller(f"{len(whole)} tensor(s) cannot be quantized at level {level.name!r} "
                            f"({with_reasons(whole)}): they, the optimizer state coded with them and an Adam "
                            "moment's other moment are stored lossless, the rest at the level", RuntimeWarning)
            return done, change, level
        raise UnquantizableError("more tensors each time")
    except UnquantizableError as exc:  # a diverged run's checkpoint, say, is still worth keeping: whole
        what = "holds NaN or infinite values" if isinstance(exc, NonFiniteError) else "cannot be quantized"
        why = f"{with_reasons(whole)}; then {exc}" if whole else str(exc)
        warn_caller(f"the checkpoint {what} ({why}): committed lossless instead of at level {level.name!r}",
                    RuntimeWarning)
        done, change = _encode_checked(repo, checkpoint, parent, sources, None, lossy, measured, progress, None)
        return done, change, None


def _refuse_nan(checkpoint: formats.Checkpoint) -> None:
    """NonFiniteError where any float tensor holds NaN (a diverged run), quantized by the level or not.

    The codecs see only what they quantize: a NaN in a bias or a small tensor the level keeps exact
    let the rest be quantized, with no word of it. An infinity is a diverged run's only where the
    level would quantize it (the codecs say so); a mask buffer of -inf beside the weights is none.
    """
    from ckptstore.codecs.floats import first_with_nan

    found = first_with_nan(checkpoint.tensors)
    if found is not None:
        raise NonFiniteError(f"NaN in {readable_path(found)}")


def _encode_checked(repo: Repository, checkpoint: formats.Checkpoint, parent: _Parent,
                    sources: Mapping[str, TensorId], level: LossyLevel | None, lossy: LossyOptions,
                    measured: dict[str, float] | None, progress: Progress,
                    guard: calibrate.LossGuard | None, whole: Set[str] = frozenset()) -> tuple[_Encoded, float | None]:
    """`_encode`, again at tighter levels while the calibration loss changes more than the guard allows.

    Returns `_encode`'s result and the measured relative change (None without a guard).
    """
    for attempt in range(calibrate.ATTEMPTS if guard else 1):
        result = _encode(repo, checkpoint, parent, sources, calibrate.tighter(level, attempt) if attempt else level,
                         lossy, measured, progress, whole, retry=attempt > 0)
        if guard is None:
            return result, None
        restored = {p: result.records.get(p) or parent.by_path[p] for p in result.plans}
        change = guard.change(calibrate.restored_tensors(repo, restored, parent.records))
        if guard.holds(change):
            if attempt == calibrate.ATTEMPTS - 1:
                warn_caller(f"no quantized weight step kept the calibration loss within {guard.max_change:.3%}: the "
                            f"weights are stored lossless, the rest at level {level.name!r}", RuntimeWarning)
            return result, change
    raise CkptError(f"the calibration loss changed {change:+.3%} (limit {guard.max_change:.3%}) even with "
                    "lossless weights: is the calibration function deterministic, and of the weights? Nothing "
                    "was committed; `ckpt gc` removes the attempts' objects")


@dataclass
class _Encoded:
    """A checkpoint planned and encoded at one level: what the commit records."""

    entries: dict[str, TensorId]  # manifest ids known before encoding (lossless, or kept from the parent)
    records: dict[str, TensorRecord]  # the new records, by job key
    sizes: dict[ObjectId, int]
    plans: dict[str, LossyPlan]
    pairing: str | None
    fisher: dict[str, float] | None  # measured, by path
    remeasured: dict[str, list]  # [error, bound, codec] by path, where a tensor restores as an older record


def _encode(repo: Repository, checkpoint: formats.Checkpoint, parent: _Parent, sources: Mapping[str, TensorId],
            level: LossyLevel | None, lossy: LossyOptions, measured: dict[str, float] | None,
            progress: Progress, whole: Set[str] = frozenset(), retry: bool = False) -> _Encoded:
    """`_encode_once`, again without the parent's records whose objects it found damaged (`_set_apart`).

    A commit checks only that the parent's objects are there, not their hashes (that would read every
    reused object on every commit): a flipped byte shows when a base is decoded, and blocked the branch.
    """
    while True:
        try:
            return _encode_once(repo, checkpoint, parent, sources, level, lossy, measured, progress, whole, retry)
        except CorruptObjectError as exc:
            _set_apart(repo, parent, exc)  # re-raises where no record of the parent needs the object


def _set_apart(repo: Repository, parent: _Parent, error: CorruptObjectError) -> None:
    """The parent's records that need an object `error` names, set apart as lost (their tensors are stored whole).

    `error` itself where none does: the damage is elsewhere, and each call sets at least one record apart.
    """
    with repo.db.read() as tx:
        lost = lost_records(repo, tx, {r.id for r in parent.by_path.values()}, parent.records, set(error.object_ids))
    if not lost:
        raise error
    paths = sorted(p for p, r in parent.by_path.items() if r.id in lost)
    more = " and more" if len(paths) > 3 else ""
    warn_caller(f"the parent commit {(parent.commit or '')[:12]}'s tensor(s) {', '.join(map(repr, paths[:3]))}{more} "
                f"need a damaged object ({error.object_id} is {error.problem}): this commit stores them whole instead "
                "of as residuals on them. Run `ckpt fsck` to see the damage")
    parent.lost |= lost
    parent.by_path = {p: r for p, r in parent.by_path.items() if r.id not in lost}


def _encode_once(repo: Repository, checkpoint: formats.Checkpoint, parent: _Parent, sources: Mapping[str, TensorId],
                 level: LossyLevel | None, lossy: LossyOptions, measured: dict[str, float] | None,
                 progress: Progress, whole: Set[str] = frozenset(), retry: bool = False) -> _Encoded:
    """Plan and encode the checkpoint's new tensors at `level`, those in `whole` lossless; no metadata is written.

    `retry`: a calibration's tighter attempt, which keeps no lossy reconstruction of the parent's (see encoding_jobs).
    """
    with repo.db.read() as tx:
        plans, pairing = _plan(repo, checkpoint, parent, level, lossy, measured) if level else ({}, None)
        fisher = measured if level else None
        if whole:
            from ckptstore.policy.lossy_base import plans_without

            plans = plans_without(plans, whole)
            if not plans:
                raise UnquantizableError("no other tensor it quantizes")
        entries, jobs = encoding_jobs(repo, tx, checkpoint.tensors, sources, parent.by_path, parent.records,
                                     plans, level, parent.renewed, parent.manifest.sources if parent.manifest else {},
                                     keep_lossy=not retry, figures=parent.manifest.measured if parent.manifest else {})
    progress.start("commit", sum(j.raw.nbytes for j in jobs))
    # a record kept from the parent for the same input keeps the figures the parent measured of it
    remeasured = {p: m for p, m in (parent.manifest.measured if parent.manifest else {}).items()
                  if p in plans and p in entries}
    with repo.store.batch():
        try:
            records, sizes = encode_jobs(jobs, ChainSource(repo.store, parent.records), repo.pool, progress.advance,
                                         cache=cache_of(repo), remeasured=remeasured)
        finally:
            progress.finish()
    faults.point("commit:objects-written")
    # a reconstruction equal to an older commit's record is stored as that row, with the figures measured then:
    # this encoding's are the manifest's where they differ (not by float noise: another chunking sums apart)
    coded = {key: r for key, r in records.items() if key in plans and key not in remeasured and "rel_error" in r.params}
    with repo.db.read() as tx:
        older = tensor_rows.existing_tensor_ids(tx, {r.id for r in coded.values()})
        rows = tensor_rows.load_records(tx, older, with_bases=False) if older else {}
    remeasured.update((key, [r.params["rel_error"], r.params.get("max_error"), r.codec]) for key, r in coded.items()
                      if r.id in rows and not _same_figures(r.params, rows[r.id].params))
    return _Encoded(entries, records, sizes, plans, pairing, fisher, remeasured)


def _same_figures(new: Mapping[str, Any], kept: Mapping[str, Any]) -> bool:
    """Whether two records' error and bound agree, but for float noise."""
    return all(isinstance(kept.get(k), (int, float)) and math.isclose(new[k], kept[k], rel_tol=1e-6, abs_tol=1e-12)
               for k in ("rel_error", "max_error") if new.get(k) is not None)


def _other_repositories(folder: Path, excluded: list[Path]) -> list[Path]:
    """What other repositories inside `folder` keep there (`nested_repositories`), left out with a warning."""
    nested = nested_repositories(folder, excluded)
    if nested:
        more = f" and {len(nested) - 1} more" if len(nested) > 1 else ""
        warn_caller(f"other repositories' own folders or object stores inside {folder} are left out of the commit "
                    f"({nested[0]}{more}): commit in those repositories instead")
    return nested


def _refuse_files_gone(source: Any, checkpoint: formats.Checkpoint, expected: frozenset[str] | None) -> None:
    """Refuse a folder that lacks a file its caller found whole: a rotation removing it (Trainer's save_total_limit).

    The watch kept such a commit and said what it lacked after: a half-present checkpoint was the branch's tip,
    and a retention policy after it counted it as a checkpoint kept.
    """
    folder = os.fspath(source) if expected else ""
    gone = sorted(name for name in (expected or frozenset()) - {record.name for record in checkpoint.files}
                  if not os.path.lexists(os.path.join(folder, name)))  # not one a commit leaves out (.git, a repo)
    if gone:
        raise _removed(os.path.join(folder, gone[0]))


def _removed(path: str | os.PathLike) -> SourceRemovedError:
    return SourceRemovedError(f"{os.fspath(path)} was removed while it was committed (a rotation?); nothing was "
                              "recorded")


def _read_source(repo: Repository, source: Any, trust_pickle: bool
                 ) -> tuple[str | None, formats.Checkpoint, dict[str, str], dict[str, tuple[Path, Any]]]:
    """(path relative to the repository or absolute, or None for a state; the checkpoint; digests; stamps).

    A file's stamp (by record name: its path, then its stamp) is taken before it is read, for
    `_settle_changed` once every byte has been.
    """
    if isinstance(source, formats.Checkpoint):  # a state flattened already (a background commit's snapshot)
        return None, source, {}, {}
    if not isinstance(source, (str, os.PathLike)):
        return None, formats.from_state(source), {}, {}
    path = Path(source).resolve()
    kind = formats.kind_on_disk(path, source)
    own = own_folder_holding(repo, path)
    if own is not None:  # its .ckpt/, or its object store where objects_url put it outside
        raise CheckpointFormatError(f"{path} is inside the repository's own {own.name}/ folder")
    recorded = path.relative_to(repo.root) if path.is_relative_to(repo.root) else path  # as worktree reads it back
    if any(is_git_name(part) for part in recorded.parts):  # no checkout writes git's files: formats/folder.py
        raise CheckpointFormatError(f"{path} is inside a .git folder, git's own files: a checkpoint is no part of "
                                    "them, and no checkout would write it back there; move it out first")
    other = repository_part_holding(Path(source))  # as given, and resolved: a link may hide what it leads to
    if other is not None:  # a checkout of it would roll that repository back
        raise CheckpointFormatError(f"{path} is inside {other}, another repository's own folder or object store: a "
                                    "repository is no checkpoint")
    # Hash the files while they are parsed: both read the same pages, and the load is single-threaded.
    # A commit never holds the repository's own directory (`ckpt commit .` at the root), nor its object
    # store where config objects_url puts it outside .ckpt/.
    excluded = [*repo.own_folders(), *repo.root.glob(STAGING + "*")]  # and what killed inits left, anywhere
    if kind != "file":
        excluded += _other_repositories(path, excluded)
    on_disk = [path] if kind == "file" else [f.path for f in folder_files(path, excluded)]
    stamps = {p: file_stamp(p) for p in on_disk}
    pending = {p: repo.pool.submit(filemap.file_digest, str(p), filemap.current()) for p in on_disk}
    try:
        checkpoint = formats.read_checkpoint(path, trust_pickle, exclude=excluded)
    except FileNotFoundError as exc:  # listed, then gone as it was opened: a rotation, not a fault of ours
        if exc.filename is None or not Path(exc.filename).is_relative_to(path):
            raise
        raise _removed(exc.filename) from None
    digests, stamped = {}, {}
    for record in checkpoint.files:
        target = formats.destination(checkpoint.kind, record, path)
        digests[record.name] = pending[target].result() if target in pending else filemap.file_digest(str(target))
        if target in stamps:
            stamped[record.name] = (target, stamps[target])
    try:
        relative = path.relative_to(repo.root).as_posix()
    except ValueError:
        relative = str(path)
    return relative, checkpoint, digests, stamped


def _settle_changed(checkpoint: formats.Checkpoint, stamps: Mapping[str, tuple[Path, Any]],
                    digests: dict[str, str], sources: Mapping[str, TensorId]) -> None:
    """Refuse a commit whose tensor files changed while it read them: what it read may be half old, half new.

    A plain file (a log the run appends to) keeps the bytes read, with their digest, where they are
    still what was hashed at the start: the file was replaced, or grew. One rewritten in place or
    cut shorter is refused too; one whose map was read past a new end (zeros read in place of its
    bytes) is refused by the guard this runs in (filemap.guard), whatever is decided here.
    """
    for record in checkpoint.files:
        path, before = stamps.get(record.name, (None, None))
        now = file_stamp(path) if path is not None else before
        if now == before:
            continue
        if now is None and record.format != formats.BLOB:  # gone: no save is still writing it (a rotation removed it)
            raise _removed(path)
        entry = record.skeleton[1] if record.format == formats.BLOB else None
        replaced = now is None or now[:2] != before[:2]  # our map is of the old file, which no writer touches
        if entry is None or not (replaced or now[2] >= before[2]):
            raise changed_while_read(path)
        raw = checkpoint.tensors[entry]
        if tensor_id(raw.dtype, raw.shape, raw.data) != sources[entry]:
            raise changed_while_read(path)
        digests[record.name] = bytes_digest(raw.data)


_SMALL_TENSOR = 64 << 10  # tensors up to this size are hashed in batches: a task each cost more than the hash
_BATCH = 256


def _tensor_ids(repo: Repository, tensors: Mapping[str, RawTensor]) -> dict[str, TensorId]:
    small = [p for p, r in tensors.items() if r.nbytes <= _SMALL_TENSOR]
    futures = {p: repo.pool.submit(tensor_id, r.dtype, r.shape, r.data)
               for p, r in tensors.items() if r.nbytes > _SMALL_TENSOR}
    batches = [(paths, repo.pool.submit(_ids_of, [tensors[p] for p in paths]))
               for paths in (small[i : i + _BATCH] for i in range(0, len(small), _BATCH))]
    ids = {p: f.result() for p, f in futures.items()}
    for paths, batch in batches:
        ids.update(zip(paths, batch.result()))
    return {p: ids[p] for p in tensors}


def _ids_of(raws: list[RawTensor]) -> list[TensorId]:
    return [tensor_id(r.dtype, r.shape, r.data) for r in raws]


def _parent(repo: Repository, tx: Tx, options: CommitOptions, tensors: Mapping[str, RawTensor],
            sources: Mapping[str, TensorId]) -> _Parent:
    """Where the commit goes, with the parent's manifest and the records of its tensors at our paths.

    Records whose objects were lost (ours by content, or the parent's) are set apart: the commit
    encodes those tensors afresh rather than chaining on or reusing them.
    """
    start = options.start or commit_target(tx, options.branch, repo.config.remotes)
    parent = _Parent(start.target, start.commit, start.new)
    if parent.commit is not None and options.start is not None and commit_rows.removed(tx, parent.commit):
        conflict(tx, start)  # fixed when a background commit was called: its branch moved or went, and gc or prune
        # removed the commit meanwhile (read as "metadata has no commit", damage that was not there)
    if parent.commit is not None:
        parent.manifest = parent_manifest(repo, parent.commit, commit_rows.manifest_object(tx, parent.commit))
    if parent.manifest is not None:
        ids = {p: e.tensor for p, e in parent.manifest.entries.items() if p in tensors}
        parent.records = tensor_rows.load_records(tx, set(ids.values()))
        parent.by_path = {p: parent.records[t] for p, t in ids.items() if t in parent.records}
    parent.lost = lost_records(repo, tx, {r.id for r in parent.by_path.values()} | set(sources.values()),
                               parent.records)
    parent.by_path = {p: r for p, r in parent.by_path.items() if r.id not in parent.lost}
    # records that came from elsewhere: decoded and checked once before they are reused (received.py)
    parent.by_path, parent.false, parent.checked = received.check(repo, tx, set(sources.values()), parent.by_path,
                                                                  parent.records, parent.lost)
    return parent


def parent_manifest(repo: Repository, cid: CommitId, oid: ObjectId) -> Manifest | None:
    """The parent commit's manifest; None, with a warning, where its object is damaged.

    The commit then stores every tensor afresh: a lost parent manifest used to block every commit on its branch.
    """
    try:
        return repo.read_manifest(oid)
    except CorruptObjectError as exc:
        warn_caller(f"the parent commit {cid[:12]}'s manifest is damaged (object {oid} is {exc.problem}); this "
                    "commit stores every tensor whole instead of as residuals on it. Run `ckpt fsck` to see the damage")
        return None


def _plan(repo: Repository, checkpoint: formats.Checkpoint, parent: _Parent, level: LossyLevel,
          lossy: LossyOptions, fisher: dict[str, float] | None) -> tuple[dict[str, LossyPlan], str]:
    """A lossy commit's plans, and how it paired optimizer state with weights; `fisher`: measured, by path.

    Imported here, not at the top: a lossless commit (most `ckpt commit` processes) never loads the planners.
    """
    from ckptstore.policy.lossy import plan_lossy
    from ckptstore.policy.mapping import optimizer_state_paths, paths_in_any_naming

    optimizer_map = _optimizer_map(checkpoint, lossy)
    # a view sharing its storage with another view: quantizing one would change the other
    shared = {path for f in checkpoint.files for path in shared_view_paths(f.skeleton)}
    # a tensor whose record its file's container keeps: `ckpt checkout -o` writes that record's committed bytes
    shared |= {path for f in checkpoint.files if f.container for path in left_in_container(f.skeleton, f.container)}
    optimizer_state = {path for f in checkpoint.files for path in optimizer_state_paths(f.skeleton)}
    # the parameters of the model's norm layers, whatever their names and shapes: docs/guide.md keeps them exact
    norms = lossy.norm_names if lossy.norm_names is not None else norm_names_of(lossy.model)
    shared |= paths_in_any_naming(checkpoint.tensors, norms)  # a copy's too (an EMA's): kept exact is never wrong
    plans = plan_lossy(checkpoint.tensors, parent.by_path, level, repo.config.encoding, optimizer_map, fisher,
                       shared, optimizer_state)
    return plans, optimizer_map.how


def _optimizer_map(checkpoint: formats.Checkpoint, lossy: LossyOptions) -> OptimizerMap:
    """Which optimizer state belongs to which weight: from the live objects, else the skeletons."""
    from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs

    found_ids = [ids for ids in (param_ids(f.skeleton) for f in checkpoint.files) if ids is not None]
    found_lrs = [lrs for lrs in (param_lrs(f.skeleton) for f in checkpoint.files) if lrs]
    names = lossy.param_names if lossy.param_names is not None else param_names_of(lossy.model, lossy.optimizer)
    return map_optimizer(checkpoint.tensors, names,
                         found_ids[0] if len(found_ids) == 1 else None, found_lrs[0] if len(found_lrs) == 1 else None,
                         by_name=_listed_by_name(checkpoint))


def _listed_by_name(checkpoint: formats.Checkpoint) -> set[str]:
    """The paths of tensors from safetensors files, which list them sorted by name, not in the model's order."""
    # paths begin with the file's name escaped (state.escape): `sub/model.safetensors` is `sub%2Fmodel.safetensors/`
    prefixes = [escape(f.name) + "/" if f.name else "" for f in checkpoint.files if f.format == formats.SAFETENSORS]
    return {path for path in checkpoint.tensors for prefix in prefixes if path.startswith(prefix)}


def encoding_jobs(repo: Repository, tx: Tx, tensors: Mapping[str, RawTensor], sources: Mapping[str, TensorId],
                  parents: Mapping[str, TensorRecord], chains: Mapping[TensorId, TensorRecord],
                  plans: Mapping[str, LossyPlan], level: LossyLevel | None,
                  lost: Set[TensorId] = frozenset(), inputs: Mapping[str, TensorId] | None = None,
                  keep_lossy: bool = True, figures: Mapping[str, list] | None = None
                  ) -> tuple[dict[str, TensorId], list[Job]]:
    """Manifest ids known before encoding, and the jobs that encode everything else.

    `tensors`, their content ids `sources` and the `parents` they chain on are by path (a
    sharded commit's: by shard key); `chains` holds every record down the parents' chains (where a
    parent at the chain's limit finds its base, the next residual's anchor). Lossless tensors are
    named by their content and chain as the repository's costs allow (`max_chain = "auto"`:
    repo/chaincost.py); a lossy tensor whose source equals the parent commit's input there keeps the
    parent's reconstruction (not with `keep_lossy` False: a calibration's retry at finer steps, which
    kept the same coarse reconstruction three times over, then fell to lossless weights); the rest are
    named after encoding. `inputs`: the parent commit's lossy inputs by path, as its manifest records
    them (else its records' sources); `figures`: the [error, bound] it measured of records it kept (its
    manifest's `measured`). A kept reconstruction must meet this commit's error bound (`_meets_bound`).
    Commits and sharded commits (repo/sharded.py) both build their jobs here.
    """
    entries: dict[str, TensorId] = {}
    reused: dict[str, TensorRecord] = {}
    for path in plans:
        parent = parents.get(path)
        # the parent's record may be an earlier commit's (a change rounded to nothing), made from that one's input;
        # an input is a lossy record's own claim: a received manifest claimed one for an exact record of other bytes
        if parent is not None and (parent.id == sources[path] or keep_lossy and "source" in parent.params and (
                (inputs or {}).get(path, parent.params["source"]) == sources[path])
                and _meets_bound(parent, plans[path], (figures or {}).get(path))):
            entries[path] = parent.id
            reused[path] = parent
    # a first moment's error is of m / sqrt(v): kept only beside the very v it was coded against (its base), else
    # measured anew (a record an earlier version kept beside a v coded anew would be carried on for ever)
    for path in [p for p in reused if plans[p].sibling in plans and (
            plans[p].sibling not in reused or reused[p].base_id not in (None, reused[plans[p].sibling].id))]:
        del reused[path], entries[path]
    lossless = [p for p in tensors if p not in plans]
    present = tensor_rows.existing_tensor_ids(tx, [sources[p] for p in lossless])
    new: dict[TensorId, RawTensor] = {}
    parent_of: dict[TensorId, TensorRecord | None] = {}
    for path in lossless:
        entries[path] = sources[path]
        if (sources[path] not in present or sources[path] in lost) and sources[path] not in new:
            new[sources[path]] = tensors[path]
            # a record encoded again replaces its lost one: whole, since its parent may chain on it
            parent_of[sources[path]] = None if sources[path] in lost else parents.get(path)
    jobs = lossless_jobs(new, parent_of, repo.config.encoding,
                         chaincost.auto_costs(repo) if any(parent_of.values()) else None, chains)
    jobs += [lossy_job(plan, tensors, sources[path], level, plans, reused)
             for path, plan in plans.items() if path not in reused]
    return entries, jobs


def _meets_bound(record: TensorRecord, plan: LossyPlan, figures: list | None) -> bool:
    """Whether a lossy record kept for an unchanged input holds the error bound this commit's plan asks.

    The input's bytes name the record, so a finer knob (`--knob max_weight_error=...`) on the same tensors
    kept the coarser reconstruction and did nothing, unsaid. Kept where its recorded bound (`figures`: the
    parent commit's, where it kept an earlier record) is no looser: a looser one's error within the new
    bound may still break its bulk rule (auditor 443). Else encoded again, on the old reconstruction as its base.
    """
    bound = plan.params.get("max_error")
    if not bound:
        return True
    error, kept_bound = figures[:2] if figures else (record.params.get("rel_error"), record.params.get("max_error"))
    if kept_bound is not None:  # a looser bound's record may break this one's bulk rule, which no record keeps
        return kept_bound <= bound * (1 + 1e-9)  # the same level's bound, as float math gave it
    return error is not None and error <= bound  # a record of a version that kept no bound: its error alone


def lost_records(repo: Repository, tx: Tx, ids: set[TensorId], known: Mapping[TensorId, TensorRecord],
                 damaged: Set[ObjectId] = frozenset()) -> set[TensorId]:
    """The recorded `ids` whose chains need an object the store lacks (where it can tell cheaply) or in `damaged`.

    A commit reusing or chaining on such a record would be recorded broken; encoding the tensor
    again (the commit has its bytes) gives the record objects again, and every commit that names
    it is whole. `known`: records loaded already (with their chains). The objects a read here found
    corrupted count too (the local store's damage list; a lazy clone's, whose store tells no lack).
    """
    listed = getattr(held_here(repo.store), "damage", None)
    damaged = set(damaged) | (listed.ids() if listed is not None else set())
    if not damaged and not tells_lacking(repo.store):  # a bucket: no request per object on every commit
        return set()
    records = dict(known)
    unknown = ids - set(known)
    if unknown:
        records.update(tensor_rows.load_records(tx, unknown, problems={}))
    objects = {chunk.object_id for record in records.values() for chunk in record.chunks}
    missing = lacking(repo.store, objects) | (objects & damaged)
    if not missing:
        return set()

    def broken(tid: TensorId | None) -> bool:
        record = records.get(tid) if tid else None
        return record is not None and (any(c.object_id in missing for c in record.chunks) or broken(record.base_id))

    return {tid for tid in ids if broken(tid)}


def lossy_job(plan: LossyPlan, tensors: Mapping[str, RawTensor], source: TensorId, level: LossyLevel,
               plans: Mapping[str, LossyPlan], reused: Mapping[str, TensorRecord]) -> Job:
    """The encoding job of one planned lossy tensor, given which tensors keep their parent's reconstruction."""
    params = dict(plan.params, source=source, level=level.name)
    base, sibling = plan.base, plan.sibling
    if sibling in reused:  # its second moment did not change: replay that one as the base
        base, sibling = reused[sibling], None
    mask_from = plan.mask_from if plan.mask_from in plans and plan.mask_from not in reused else None
    paced_by = plan.paced_by if plan.paced_by not in reused else None
    if plan.paced_by in reused:  # the weight did not move at all: as fine as it gets
        params["step"] = params["fine_step"]
    reference = tensors.get(plan.sibling) if plan.sibling else None  # a first moment's original second moment
    return Job(plan.path, tensors[plan.path], plan.codec, params, base, sibling, mask_from,
               tensors.get(plan.importance) if plan.importance else None, plan.prune, plan.stage, paced_by=paced_by,
               reference=reference)


def _commit_info(checkpoint: formats.Checkpoint, options: CommitOptions, manifest_oid: ObjectId, stored: int,
                 source_path: str | None, parent: _Parent, level: LossyLevel | None) -> CommitInfo:
    """The commit's row, named by the blake3 of its canonical record."""
    raw_total = (sum(f.size for f in checkpoint.files) if checkpoint.kind != "state"
                 else sum(r.nbytes for r in checkpoint.tensors.values()))
    info = CommitInfo(
        id=CommitId(""), manifest_object=manifest_oid, message=options.message,
        author=options.author, created_at=time.time(), step=options.step,
        metrics={str(k): float(v) for k, v in options.metrics.items()}, kind=checkpoint.kind,
        source_path=source_path, raw_bytes=raw_total, stored_bytes=stored,
        parents=[parent.commit] if parent.commit else [], lossy=level.name if level else None,
    )
    info.id = info.computed_id()
    return info


def _measured_fisher(lossy: LossyOptions, level: LossyLevel | None) -> dict[str, float] | None:
    """Per parameter name, the empirical Fisher measured with the calibration loss (None when not asked)."""
    if lossy.calibration is None:
        return None
    if level is None:
        raise CkptError("a calibration loss steers lossy commits: give a lossy level (--lossy LEVEL, lossy=)")
    if lossy.model is None or not level.weights_lossy:
        return None  # without the live model, or with lossless weights, it only checks the restored loss
    from ckptstore.policy.sensitivity import measure_fisher

    return measure_fisher(lossy.model, lossy.calibration)


def _fisher_by_path(model: Any, measured: dict[str, float] | None, checkpoint: formats.Checkpoint
                    ) -> dict[str, float] | None:
    """The Fisher measured by live parameter name, by checkpoint path, in the naming of the level the state is from.

    A name in two copies none of which holds the live values steers neither; copies holding them, each.
    """
    if measured is None:
        return None
    from ckptstore.policy.livenames import checkpoint_paths

    named = dict(model.named_parameters())
    found = checkpoint_paths(model, {name: named[name] for name in measured}, checkpoint.tensors)
    by_path = {path: measured[name] for name, path in found.paths.items()}
    by_path.update((path, measured[name]) for name, paths in found.copies.items() for path in paths)
    return by_path


def _importance_note(fisher: Mapping[str, float] | None, plans: Mapping[str, Any], pairing: str | None
                     ) -> str | None:
    """What the manifest says of the weights' sensitivity: measured (steering how many), or nothing to go by.

    None where Adam's second moments weighed them: what `show` says of a manifest without a note.
    """
    if fisher is not None:
        steered = sum(1 for path in fisher if path in plans)
        return f"measured on a calibration batch ({steered} weights)"
    from ckptstore.policy.mapping import NO_OPTIMIZER_STATE

    weights = [plan for plan in plans.values() if plan.codec == "deadzone"]
    if pairing == NO_OPTIMIZER_STATE or not weights or any(plan.importance for plan in weights):
        return None
    if any(plan.codec in ("log2moment", "normmoment") for plan in plans.values()):  # Adam's, left unpaired (a GAN's)
        return "none: the weights were not paired with the optimizer's moments"
    return "none: no Adam second moment to weigh the weights by"  # RMSprop, Sophia, Adagrad


def param_names_of(model: Any, optimizer: Any) -> list[Any] | None:
    """Names of the optimizer's parameters in state order, from the live model and optimizer.

    None for a parameter the model does not hold: that one stays unpaired, the others keep their names.
    A wrapped model's (DDP, torch.compile) that differ come as (as given, as the model it wraps names them):
    the state may be either's, and policy/mapping.py picks the naming that matches.
    """
    if model is None or optimizer is None:
        return None
    from ckptstore.policy.livenames import level_names

    return level_names(model, [p for group in optimizer.param_groups for p in group["params"]])


# torch.nn's normalization layers, by class name along a module's class hierarchy (`_NormBase`: BatchNorm's and
# InstanceNorm's); torch itself stays out of this module
_NORM_LAYERS = {"LayerNorm", "GroupNorm", "RMSNorm", "_NormBase", "LocalResponseNorm"}


def norm_names_of(model: Any) -> list[Any]:
    """Names of the parameters of the model's torch.nn norm layers: kept exact however many dimensions they have."""
    if model is None:
        return []
    from ckptstore.policy.livenames import level_names

    return level_names(model, [param for _, module in model.named_modules()
                               if any(c.__name__ in _NORM_LAYERS and c.__module__.startswith("torch.nn.")
                                      for c in type(module).__mro__)
                               for param in module.parameters(recurse=False)])
