"""`watch_folder` (`ckpt watch`): commit the checkpoints a training job writes into a folder, each once it is complete.

What is watched: the folder's direct children that are checkpoint files (.pt .pth .bin .ckpt .tar
.safetensors, either case) or Hugging Face Trainer folders named `checkpoint-N`. Hidden names, temporary
files of atomic writers and symlinks are never sources (a symlink so named is reported as such).
A `checkpoint-N` folder itself, or a folder inside one, is refused: its files are parts of one save, not
checkpoints.

When a source counts as complete (torch.save, safetensors and Trainer all write in place, in steps):
- every file of it is unchanged (names, sizes, modification times) between two scans `interval`
  seconds apart, and no atomic writer's temporary file sits in it;
- a zip (torch.save's format) has a readable central directory, which torch writes last; a
  safetensors file is exactly as long as its header says; a legacy (non-zip) torch file has no
  end marker, so for it stability alone decides;
- a Trainer folder holds a `trainer_state.json` that parses: Trainer._save_checkpoint writes it
  after the model, optimizer, scheduler and RNG files; in a folder saved over in place (a version
  of it was handled before), files rewritten since then also need a rewritten trainer_state.json,
  and none of them may be more than 5 s newer than it (a save the watch missed, while it was
  stopped, would otherwise vouch for the next save's first files).

The step comes from trainer_state.json's `global_step`, else from the name (`checkpoint-500`,
`step=1200`, `model_300.pt`: the number after "step", else the last number standing alone between
separators, not an epoch's, a decimal's nor part of a word: `gpt2-final.pt` and `llama-7b.pt` give none).

Nothing is committed twice, across restarts too: each commit's source signature and commit id go into
`.ckpt/watch/<id>.json` (written atomically, at most once a second and after each scan's commits). A
source missing from that file (a kill or a full disk before the write) is first compared with the
newest commit of the branch from the same path: the same blake3 digests mean it is already committed. A source
rewritten in place (Lightning's last.ckpt) is a new checkpoint once it is complete again.
A scan opens only the sources not handled yet: a handled one is told by its signature (stat alone).
One this user may not read is said once (per version) and tried again at each scan, the others go on.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import (
    CheckpointFormatError,
    CkptError,
    ConflictError,
    NothingToCommitError,
    RefNotFoundError,
    SourceRemovedError,
    UnsupportedStateError,
    explain,
    shown_name,
)
from ckptstore.formats.atomic import atomic_write
from ckptstore.formats.filemap import file_digest
from ckptstore.formats.folder import is_git_name, is_temp_name
from ckptstore.formats.safetensors_file import HEADER_PEEK, MAX_HEADER, header_start
from ckptstore.formats.torchfile import zip_not_whole
from ckptstore.hashing import object_id
from ckptstore.repo.lock import held_alone
from ckptstore.state import is_utf8

if TYPE_CHECKING:
    from ckptstore.metadata.commits import CommitInfo
    from ckptstore.repo.repository import Repository

SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".tar", ".safetensors"}
TRAINER_FOLDER = re.compile(r"^checkpoint-(\d+)$")
GLOBAL_STEP = re.compile(r"^global_step\d+$")  # DeepSpeed's folder of one step's shards inside a Trainer save
# in every Accelerate save_state folder: its RNG states (written last) and optimizer file (written second)
ACCELERATE_SAVE = re.compile(r"^(random_states_\d+\.pkl|optimizer\.bin)$")
IN_A_SAVE = ("a part of the Accelerate save_state in the watched folder itself (its files are one save): watch the "
             "folder it is saved in, or `ckpt commit` this one once save_state has returned")
TRAINER_STATE = "trainer_state.json"
# Trainer writes trainer_state.json last (older versions rng_state.pth after it, milliseconds later): a
# file rewritten seconds after it comes from a later save, whose own trainer_state.json is not written yet
SAME_SAVE_NS = 5 * 10**9
LINKED = "a symbolic link, never committed (the file it points to is, when it is in the watched folder)"
SHARD = re.compile(r"-\d{5}-of-\d{5}\.[^.]+$")  # save_pretrained's model-00001-of-00003.safetensors (not fold-1-of-5)
TRAINING_ARGS = "training_args.bin"  # the Trainer's pickled TrainingArguments beside its checkpoint-N folders
_STEP = re.compile(r"step[=_-]?(\d+)", re.IGNORECASE)
# a number standing alone between separators (model_300, ckpt-000123, model.5000), not part of a word (gpt2-final,
# llama-7b, last-v1), of a decimal or an exponent (val_loss=0.1234, lr=1e-05), an epoch's (epoch=3) nor negative (=-5)
_NUMBER = re.compile(r"(?:^|(?<=[_\-.= ]))(?<!\d\.)(?<!\d[eE]-)(?<!\d[eE]\+)(?<!=-)(?<!epoch[=_ -])"
                     r"(\d+)(?!\d)(?!\.\d)(?=$|[_\-.= ])", re.IGNORECASE)
# the whole state is rewritten: once per commit, a watch over N checkpoints wrote N² records
SAVE_EVERY_SECONDS = 1.0
Signature = list[list[Any]]  # [name inside the source, size, mtime_ns] for each of its files


@dataclass
class WatchOptions:
    """How to watch: seconds between scans, the branch and lossy level of the commits, one pass only."""

    interval: float = 10.0
    branch: str | None = None
    lossy: str | None = None
    once: bool = False


@dataclass
class Source:
    """A checkpoint file or folder as one scan found it."""

    name: str
    path: Path
    signature: Signature
    incomplete: str = ""  # why it is not complete yet ("" when it may be)
    passed_over: bool = False  # no checkpoint of its own (`incomplete` says what it is): said once, never committed
    step: int | None = None
    denied: PermissionError | None = None  # it may not be read (another user's): said, tried again at each scan


@dataclass
class WatchReport:
    """What a watch did: the commits it made (name, commit id, step), and sources still incomplete (by shown name)."""

    committed: list[tuple[str, str, int | None]] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    stopped: bool = False
    conflicted: list[str] = field(default_factory=list)  # not committed in the last pass: another writer moved it


def watch_folder(repo: Repository, folder: str | os.PathLike, options: WatchOptions | None = None,
          stop: threading.Event | None = None, say: Callable[[str], None] = lambda line: None) -> WatchReport:
    """Commit each complete checkpoint appearing in `folder` until `stop` is set (or after one pass).

    `say` gets a line per commit. `stop` is checked between commits, so setting it (on Ctrl-C)
    ends the watch after the commit in progress.
    """
    options, stop = options or WatchOptions(), stop or threading.Event()
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise CkptError(f"{folder} is not a folder; `ckpt watch` takes the folder a training job saves into")
    _refuse_inside_a_save(folder)
    repo.db.refuse_writes("watch (it commits)")
    # One watcher per folder: two would each find a checkpoint not yet committed, and the second's commit
    # of it could land on top of the newer checkpoints the first committed meanwhile.
    lock = repo.dir / "watch" / f"{object_id(str(folder).encode())[:16]}.lock"
    with held_alone(lock, lambda pid: CkptError(
            f"another `ckpt watch` (process {pid}) is watching {folder} into this repository: stop it first "
            "(two watchers of one folder would commit its checkpoints twice)")):
        return _watch(repo, folder, options, stop, say)


def _watch(repo: Repository, folder: Path, options: WatchOptions, stop: threading.Event,
           say: Callable[[str], None]) -> WatchReport:
    """Scan `folder` every `options.interval` seconds and commit what is complete, until `stop` (see watch_folder)."""
    state = WatchState.load(repo, folder, options.branch)
    committed = BranchSources(repo, options.branch)
    report, before, told = WatchReport(), scan(folder, state), set()
    while not stop.wait(options.interval):
        now = scan(folder, state)
        for source in now.values():
            if source.denied is not None:
                _say_unreadable(source, source.denied, state, say)
            elif source.passed_over and source.name not in told:
                say(f"{shown_name(source.name)}: not committed: {source.incomplete}")
                told.add(source.name)
        ready = [s for s in now.values() if _ready(s, before.get(s.name), state)]
        report.conflicted = []
        for source in sorted(ready, key=lambda s: (s.step is None, s.step or 0, s.name)):
            if stop.is_set():
                break
            _commit_source(repo, source, options, committed, state, report, say)
        _save_records(state, say)
        report.waiting = {shown_name(s.name): s.incomplete or "changed since the last scan" for s in now.values()
                          if not state.done(s) and s not in ready and s.denied is None and not s.passed_over}
        before = now
        if options.once:
            break
    report.stopped = stop.is_set()
    return report


def _refuse_inside_a_save(folder: Path) -> None:
    """Refuse a `checkpoint-N` folder (what scan() takes for one Trainer save) or a folder inside one.

    Its files are parts of one save, not checkpoints each (DeepSpeed's global_stepN holds the model
    and optimizer files of one step): watched, a half-written save would be committed piece by piece.
    """
    own = TRAINER_FOLDER.match(folder.name)
    save = None if own else next((parent for parent in folder.parents if TRAINER_FOLDER.match(parent.name)), None)
    if save is not None and _is_a_save(save):
        raise CkptError(f"{folder} is inside the checkpoint folder {save}, whose files are parts of one save: watch "
                        f"the folder it is saved in ({save.parent}), or `ckpt commit {save}`")
    if own or GLOBAL_STEP.match(folder.name) or _accelerate_save(folder):  # Trainer's, DeepSpeed's, Accelerate's
        raise CkptError(f"{folder} is a checkpoint folder: watch the folder it is saved in ({folder.parent}), "
                        f"or `ckpt commit {folder}`")


def _accelerate_save(folder: Path | os.DirEntry[str]) -> bool:
    """Whether `folder` is one of Accelerate's save_state folders (its RNG states beside the model and optimizer)."""
    try:
        with os.scandir(folder) as entries:
            return any(ACCELERATE_SAVE.match(entry.name) for entry in entries)
    except OSError:  # not listable: no save known
        return False


def _is_a_save(folder: Path) -> bool:
    """Whether a `checkpoint-N` folder holds a save: trainer_state.json, DeepSpeed's global_stepN or checkpoint files.

    A project folder named like one (checkpoint-2024/ with its README and runs) does not.
    """
    try:
        with os.scandir(folder) as entries:
            return any(entry.name == TRAINER_STATE or GLOBAL_STEP.match(entry.name)
                       or entry.is_file() and _checkpoint_name(entry.name) for entry in entries)
    except OSError:  # not listable: as named, a save
        return True


def _ready(source: Source, before: Source | None, state: WatchState) -> bool:
    return (not source.incomplete and before is not None and before.signature == source.signature
            and not state.done(source))


def _commit_source(repo: Repository, source: Source, options: WatchOptions, committed: BranchSources,
                   state: WatchState, report: WatchReport, say: Callable[[str], None]) -> None:
    """Commit one complete source unless a commit of the branch already holds it; remember it either way.

    What is wrong with one source (not a checkpoint, a name that is not UTF-8, unreadable, removed
    by a rotation) is said and the watch goes on; what is wrong with the repository ends it.
    """
    shown = shown_name(source.name)
    if not is_utf8(source.name):  # recorded in the message and the path, which the metadata keeps as UTF-8
        state.record(source, None)  # a new name is a new source
        say(f"{shown}: not committed: its name is not UTF-8; rename it")
        return
    try:
        found = already_committed(repo, source, committed)
        if found is not None:
            state.record(source, found)
            return
        cid = commit_whole(repo, source, options)
    except NothingToCommitError:
        state.record(source, None)
        say(f"{shown}: unchanged since the last commit, not committed")
        return
    except ConflictError as exc:  # another writer moved the branch: the next scan tries again
        say(f"{shown}: {_why(exc)}")
        report.conflicted.append(shown)
        return
    except (CheckpointFormatError, UnsupportedStateError, FileNotFoundError, SourceRemovedError, UnicodeEncodeError,
            PermissionError) as exc:  # UnicodeEncodeError: a folder above whose name is not UTF-8
        unreadable = isinstance(exc, PermissionError)
        if unreadable and not Path(exc.filename or "/").is_relative_to(source.path):
            raise  # the repository's own files: no source will commit
        # not a checkpoint ckptstore can store (tried again once it changes), or removed meanwhile (rotation);
        # an unreadable one is tried at each scan (access given back changes neither its size nor its time),
        # and said once per version
        if source.path.exists() and not unreadable:
            state.record(source, None)
        if unreadable:
            _say_unreadable(source, exc, state, say)
        else:
            say(f"{shown}: not committed: {_why(exc)}")
        return
    report.committed.append((source.name, cid, source.step))
    say(f"[{cid[:12]}] {shown}" + (f" (step {source.step})" if source.step is not None else ""))
    _record_commit(state, source, cid, say)


def commit_whole(repo: Repository, source: Source, options: WatchOptions) -> str:
    """Commit `source` as found: a folder lacking a file the scan found whole is refused (a rotation), not kept.

    Trainer's save_total_limit removes a folder file by file: committed without its optimizer.pt, the folder
    was the branch's tip, said to be partial only after, and a retention policy counted it as one kept.
    """
    from ckptstore.repo.background import commit_call
    from ckptstore.repo.commit import CommitOptions, LossyOptions

    judged = frozenset(name for name, _, _ in source.signature if name) or None  # a folder's files; a file's: none
    commit = CommitOptions(f"watch: {source.name}", source.step, branch=options.branch, expect_files=judged)
    return commit_call(repo, source.path, commit, LossyOptions(options.lossy), None, True, None)


def _record_commit(state: WatchState, source: Source, cid: str, say: Callable[[str], None]) -> None:
    """Remember that `source` is committed as `cid`; a record that cannot be written is said, then raised.

    The commit is in, its line said: a full disk here ends the watch as any other of the repository's
    writes does, but the user must not read its error as "nothing was committed".
    """
    try:
        state.record(source, cid)
    except OSError as exc:
        say(f"committed {shown_name(source.name)} ({cid[:12]}); the watch's record of it could not be written "
            f"({exc.strerror or exc}): a restart finds it committed")
        raise


def _save_records(state: WatchState, say: Callable[[str], None]) -> None:
    """Write the records a scan's commits left unwritten; a failure is said with the commits it leaves unrecorded."""
    try:
        state.save()
    except OSError as exc:
        names = ", ".join(map(shown_name, state.unsaved_commits))
        say(f"the watch's record of {names} could not be written ({exc.strerror or exc}): a restart finds "
            f"{'them' if len(state.unsaved_commits) > 1 else 'it'} committed")
        raise


def _say_unreadable(source: Source, exc: PermissionError, state: WatchState, say: Callable[[str], None]) -> None:
    """Say that `source` may not be read, once per version of it.

    It is tried again at each scan all the same: access given back changes neither its size nor its time.
    """
    if state.unreadable.get(source.name) != source.signature:
        say(f"{shown_name(source.name)}: not committed: {_why(exc)}")
    state.unreadable[source.name] = source.signature


def _why(exc: BaseException) -> str:
    """What went wrong with a source, for its line: the message names the source's path, which may hold a newline."""
    return shown_name(str(explain(exc) or exc))


def scan(folder: Path, state: WatchState | None = None) -> dict[str, Source]:
    """The candidate sources in `folder` now, each with its signature and completeness.

    A source `state` has already handled in this very version (same signature, from stat alone) is
    left out without being read: it is neither ready nor waiting, and once it changes it is read again.
    What `state` holds of sources gone from the folder is dropped (`WatchState.forget_gone`).
    """
    found, seen = {}, set()
    try:
        entries = os.scandir(folder)
    except FileNotFoundError:
        raise CkptError(f"{folder}, the watched folder, went away; what was committed stays: watch it again once "
                        "it is back") from None
    with entries:
        for entry in entries:
            seen.add(entry.name)
            if entry.name.startswith(".") or is_temp_name(entry.name):
                continue
            if entry.is_symlink():  # Lightning's save_last="link": its target is a checkpoint of its own
                if TRAINER_FOLDER.match(entry.name) or _checkpoint_name(entry.name):
                    found[entry.name] = Source(entry.name, Path(entry.path), [], LINKED)
                continue
            try:
                source = _candidate(entry, state)
            except FileNotFoundError:  # removed while being looked at (checkpoint rotation)
                continue
            if source is not None:
                found[entry.name] = source
    if any(ACCELERATE_SAVE.match(name) for name in seen):  # save_state into the watched folder after the watch began
        found = {name: Source(name, source.path, [], IN_A_SAVE, passed_over=True) if not source.path.is_dir()
                 else source for name, source in found.items()}
    if state is not None:
        state.forget_gone(seen)
    return found


def _candidate(entry: os.DirEntry[str], state: WatchState | None) -> Source | None:
    """The source `entry` is, judged; None when it is none, or one `state` handled in this very version.

    One that may not be read (another user's, saved under umask 077) comes back with `denied` set, so
    that it is said and the others are still judged.
    """
    passed_over = _passed_over(entry)
    if passed_over:
        return Source(entry.name, Path(entry.path), [], passed_over, passed_over=True)
    if entry.is_dir() and TRAINER_FOLDER.match(entry.name):
        try:
            source = Source(entry.name, Path(entry.path), _folder_signature(Path(entry.path)))
        except PermissionError as exc:  # a folder it may not list: its own stat tells its versions apart
            info = entry.stat()
            return Source(entry.name, Path(entry.path), [["", info.st_size, info.st_mtime_ns]], "permission denied",
                          denied=exc)
        handled = state.sources.get(entry.name) if state else None  # a damaged state file: not a dict
        judge = functools.partial(_judge_saved_over, handled=handled) if isinstance(handled, dict) else _judge_folder
    elif entry.is_file() and _checkpoint_name(entry.name):
        info = entry.stat()
        source = Source(entry.name, Path(entry.path), [["", info.st_size, info.st_mtime_ns]])
        judge = _judge_file
    else:
        return None
    if state is not None and state.done(source):
        return None
    try:
        return judge(source)
    except PermissionError as exc:
        source.denied, source.incomplete = exc, "permission denied"
        return source


def _passed_over(entry: os.DirEntry[str]) -> str:
    """What an entry the watch takes for no checkpoint of its own is, and what to do instead; "" for others."""
    if entry.is_file() and SHARD.search(entry.name) and _checkpoint_name(entry.name):
        return ("a part of a sharded save (save_pretrained's shards, with their index): commit the folder that "
                "holds them all with `ckpt commit`")
    if entry.is_file() and entry.name == TRAINING_ARGS:
        return "the Trainer's pickled TrainingArguments, no checkpoint (each checkpoint-N folder holds a copy)"
    if entry.is_dir() and GLOBAL_STEP.match(entry.name):
        return "DeepSpeed's folder of one step's shards: the watch takes checkpoint-N folders; `ckpt commit` it"
    if entry.is_dir() and not TRAINER_FOLDER.match(entry.name) and _accelerate_save(entry):
        return ("an Accelerate save_state folder: the watch takes Trainer's checkpoint-N folders and checkpoint "
                "files; `ckpt commit` it once save_state has returned")
    return ""


def _judge_file(source: Source) -> Source:
    """`source` (a file) with its completeness and step filled in: reads the file."""
    source.incomplete, source.step = file_incomplete(source.path), step_of(source.name)
    return source


def _folder_signature(path: Path) -> Signature:
    """[name, size, mtime_ns] of each file under `path`; PermissionError on a folder it may not list.

    os.walk alone skips such a folder: another user's 0700 checkpoint would look empty, waiting forever.
    """
    signature = []
    for root, folders, files in os.walk(path, onerror=_raise_denied):
        folders[:] = sorted(name for name in folders if not is_git_name(name))  # a commit leaves git's files out
        for name in sorted(name for name in files if not is_git_name(name)):
            full = Path(root, name)
            info = full.lstat()
            signature.append([full.relative_to(path).as_posix(), info.st_size, info.st_mtime_ns])
    return signature


def _raise_denied(error: OSError) -> None:
    """os.walk's onerror: raise a PermissionError; other errors (a folder rotated away) stay skipped, as before."""
    if isinstance(error, PermissionError):
        raise error


def _judge_folder(source: Source) -> Source:
    """`source` (a Trainer folder) with its completeness and step filled in: reads its trainer_state.json."""
    temps = [Path(name).name for name, _, _ in source.signature if is_temp_name(Path(name).name)]
    trainer = _trainer_state(source.path / TRAINER_STATE)
    if trainer is None:
        source.incomplete = f"no readable {TRAINER_STATE} yet (Trainer writes it last)"
    else:
        source.incomplete = f"a file is still being written ({shown_name(temps[0])})" if temps else ""
    step = trainer.get("global_step") if isinstance(trainer, dict) else None
    source.step = step if type(step) is int and 0 <= step < 1 << 63 else step_of(source.name)
    return source


def _judge_saved_over(source: Source, handled: dict[str, Any]) -> Source:
    """A Trainer folder saved over a version handled before: files rewritten since need a new trainer_state.json.

    The old trainer_state.json still parses while Trainer writes new weights and optimizer state
    over the old ones, whatever their names (adapters, FSDP shards, DeepSpeed folders). A file gone
    is a new save's doing (save_pretrained deletes the old weights' names before writing its own).
    Files only added within 5 s of trainer_state.json (a callback's, an older Trainer's
    rng_state.pth) count at once; one written later, or rewritten later, is the next save's.
    """
    source = _judge_folder(source)
    before = {entry[0]: entry for entry in handled.get("signature") or [] if isinstance(entry, list) and entry}
    now = {entry[0]: entry for entry in source.signature}
    rewritten = [name for name, entry in now.items() if name != TRAINER_STATE and before.get(name, entry) != entry]
    added = [name for name in now if name not in before and name != TRAINER_STATE]
    gone = [name for name in before if name not in now and name != TRAINER_STATE]
    if source.incomplete or not (rewritten or added or gone):
        return source
    state_unchanged = before.get(TRAINER_STATE) == now.get(TRAINER_STATE)
    if state_unchanged and (rewritten or gone):
        changed = f"{shown_name(rewritten[0])} is new" if rewritten else f"{shown_name(gone[0])} is gone"
        source.incomplete = f"saved over in place: {changed}, its {TRAINER_STATE} still the earlier one's"
    elif TRAINER_STATE in now:  # a save the watch missed (it was stopped) must not vouch for the next one's files
        state_time = now[TRAINER_STATE][2]
        late = [name for name in rewritten + added if now[name][2] - state_time > SAME_SAVE_NS]
        if late:
            source.incomplete = (f"saved over in place: {shown_name(late[0])} was written more than "
                                 f"{SAME_SAVE_NS // 10**9} s after {TRAINER_STATE}, by a later save")
    return source


def _trainer_state(path: Path) -> Any:
    """The parsed trainer_state.json at `path`, None while it is missing or half-written.

    PermissionError is raised: a file this user may not read is not one Trainer has yet to write.
    """
    try:
        return json.loads(path.read_text())
    except PermissionError:
        raise
    except (OSError, ValueError):
        return None


def file_incomplete(path: Path) -> str:
    """Why the checkpoint file at `path` is not complete yet, or "" when its own structure says it is."""
    with open(path, "rb") as handle:
        head = handle.read(8 + HEADER_PEEK)  # a safetensors header's length, and the "{" that starts the header
    if path.suffix.lower() == ".safetensors":
        return _safetensors_incomplete(path, head)
    if head.startswith(b"PK"):  # a torch.save zip: its central directory and end record are written last
        return zip_not_whole(path)
    return ""


def _safetensors_incomplete(path: Path, head: bytes) -> str:
    size = path.stat().st_size
    if len(head) < 8:
        return "shorter than a safetensors header"
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER or header_start(head) not in (b"", b"{"):
        return ""  # no safetensors header being written (text, a zip so named): the commit refuses it and says why
    if 8 + length > size:
        return "its header is not written yet"
    with open(path, "rb") as handle:
        handle.seek(8)
        try:
            header = json.loads(handle.read(length))
        except (ValueError, RecursionError):  # RecursionError: forged nesting, no header being written
            return "its header is not written yet"
    if not isinstance(header, dict):
        return ""  # whole, but no safetensors file: the commit refuses it and says why
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
            and type(v["data_offsets"][1]) is int]
    return "" if 8 + length + max(ends, default=0) <= size else "its tensor data is not all written yet"


def _checkpoint_name(name: str) -> bool:
    """Whether a file so named is a checkpoint file to watch: its suffix one of SUFFIXES, in either case (MODEL.PT)."""
    return Path(name).suffix.lower() in SUFFIXES


def step_of(name: str) -> int | None:
    """The training step a checkpoint's name gives: after "step" or "checkpoint-", else its last number standing alone.

    Not an epoch's number, a metric's decimals nor Lightning's version: `epoch=3-val_loss=0.12-v1.ckpt`
    gives no step.
    """
    stem = name.removesuffix(Path(name).suffix) if _checkpoint_name(name) else name
    found = _STEP.search(stem) or TRAINER_FOLDER.match(stem)
    numbers = [found.group(1)] if found else _NUMBER.findall(stem)
    step = int(numbers[-1]) if numbers else None
    return step if step is not None and step < 1 << 63 else None  # a run id, say: no step the metadata holds


def already_committed(repo: Repository, source: Source, committed: BranchSources) -> str | None:
    """A commit of the branch made from the source's path with exactly its files, if any.

    A pruned one's files are gone with its manifest: one made after the source's files were last written, of
    as many bytes, is taken for it (a copy keeping older times and the same size is not told apart).
    """
    # only the newest: a kill between commit and record leaves that one, and a file rewritten back to an
    # older content (A, B, A) is a new checkpoint, not the first A again
    newest = committed.newest(_source_path(repo, source.path))
    if newest is None:
        return None
    if newest.pruned:  # its manifest is gone with its tensors: files none written since are the ones it was made of
        # (committed again, an old checkpoint would land on the branch's tip and push the newer ones into the
        # retention's cut); a file rewritten after it is a new checkpoint
        return newest.id if _written_before(repo, source.path, newest.created_at, newest.raw_bytes) else None
    files = {name: source.path / name if name else source.path for name, _, _ in source.signature}
    manifest = repo.read_manifest(newest.manifest_object)
    if sorted(f.name for f in manifest.files) != sorted(files):
        return None
    digests = {n: file_digest(str(p)) for n, p in files.items()}
    return newest.id if all(digests[f.name] == manifest.digests.get(f.name) for f in manifest.files) else None


def _written_before(repo: Repository, path: Path, when: float, size: int) -> bool:
    """Whether the files a commit of `path` reads were all last written before `when`, `size` bytes together.

    As the commit reads them: links followed, the repository's own folders and git's files left out.
    """
    from ckptstore.formats.folder import folder_listing

    try:
        listed = folder_listing(path, repo.own_folders(), quiet=True).files if path.is_dir() else None
        files = [path] if listed is None else [f.path for f in listed]
        found = [os.stat(file) for file in files]
    except (CkptError, OSError):  # what a commit would refuse: its own error says it
        return False
    return all(info.st_mtime_ns < when * 1e9 for info in found) and sum(info.st_size for info in found) == size


class BranchSources:
    """The newest commit of a branch from each source path: its history walked once, then each commit on top added.

    Asked for every source a watch has no record of, a walk of the branch per source made a first
    watch of N checkpoints cost N² (1,600 files: 38 s).
    """

    def __init__(self, repo: Repository, branch: str | None) -> None:
        self.repo, self.branch = repo, branch
        self.head: str | None = None
        self.newest_ids: dict[str | None, str] = {}

    def newest(self, where: str) -> CommitInfo | None:
        """The newest commit of the branch made from `where`, as its record is now (retention may have pruned it)."""
        try:
            head = self.repo.resolve(self.branch or "HEAD")
        except RefNotFoundError:  # a branch the watch has not created yet
            return None
        if head != self.head:
            info = self.repo.commit_info(head)
            if self.head is not None and info.parents == [self.head]:
                self.newest_ids[info.source_path] = head
            else:  # another writer moved the branch elsewhere (or the first question): walk it
                self.newest_ids = {}
                for commit in self.repo.log(head):
                    self.newest_ids.setdefault(commit.source_path, commit.id)
            self.head = head
        cid = self.newest_ids.get(where)
        return None if cid is None else self.repo.commit_info(cid)


def _source_path(repo: Repository, path: Path) -> str:
    """The path a commit of `path` records (as repo.commit computes it)."""
    try:
        return path.resolve().relative_to(repo.root).as_posix()
    except ValueError:
        return str(path.resolve())


def _record_name(header: Mapping[str, Any]) -> str:
    return object_id(json.dumps(header, sort_keys=True).encode())[:16]


class WatchState:
    """What a watcher of one folder and branch has committed: `.ckpt/watch/<id>.json`, rewritten atomically."""

    def __init__(self, path: Path, header: dict[str, Any], sources: dict[str, dict[str, Any]]) -> None:
        self.path, self.header, self.sources = path, header, sources
        self.unreadable: dict[str, Signature] = {}  # said to be unreadable, in this version: tried on, not said again
        self.unsaved, self.saved_at = False, time.monotonic()
        self.unsaved_commits: list[str] = []  # names of sources committed since the last write
        self.legacy: Path | None = None  # the record an earlier version kept, read in place of `path`

    @classmethod
    def load(cls, repo: Repository, folder: Path, branch: str | None) -> WatchState:
        """The record of `folder` into `branch` (None: HEAD's, named, so `--branch main` finds the same one)."""
        header = {"folder": str(folder), "branch": branch or repo.head()[0]}
        path, older = (repo.dir / "watch" / f"{_record_name(h)}.json" for h in (header, {**header, "branch": branch}))
        legacy = older if older != path and not path.exists() and older.exists() else None
        try:  # earlier versions kept a watch without --branch under "branch": null: read, removed at the next write
            record = json.loads((legacy or path).read_text())
            sources = record["sources"] if isinstance(record.get("sources"), dict) else {}
        except (OSError, ValueError, AttributeError, RecursionError):  # missing or damaged: the commits say it
            sources = {}
        kept = {}
        for name, known in sources.items():  # [name, size, mtime_ns]: a state written with more per file still matches
            signature = known.get("signature") if isinstance(known, dict) else None
            if isinstance(signature, list) and all(isinstance(e, list) and len(e) >= 3 and isinstance(e[0], str)
                                                   and all(isinstance(n, int) for n in e[1:3]) for e in signature):
                kept[name] = {**known, "signature": [e[:3] for e in signature]}  # others: damaged, looked at anew
        state = cls(path, header, kept)
        state.legacy = legacy
        return state

    def done(self, source: Source) -> bool:
        """True when this very version of `source` (same files, sizes, times) was handled."""
        known = self.sources.get(source.name)
        return isinstance(known, dict) and known.get("signature") == source.signature

    def forget_gone(self, present: Iterable[str]) -> None:
        """Drop what it holds of sources gone from the folder (a rotation deleted them).

        The state then stays the size of the folder, not of the run (it is rewritten with the
        next records); a source that comes back is told committed by `already_committed`.
        """
        for name in self.sources.keys() - set(present):
            del self.sources[name]

    def record(self, source: Source, commit: str | None) -> None:
        """Remember what was done with `source`; written when the last write is a second old (else by `save`)."""
        self.sources[source.name] = {"signature": source.signature, "commit": commit}
        self.unsaved = True
        if commit is not None:
            self.unsaved_commits.append(source.name)
        if time.monotonic() - self.saved_at >= SAVE_EVERY_SECONDS:
            self.save()

    def save(self) -> None:
        """Write what is not written yet (atomically: a kill leaves the last version whole)."""
        if not self.unsaved:
            return
        self.path.parent.mkdir(exist_ok=True)
        text = json.dumps({**self.header, "sources": self.sources}, separators=(",", ":")).encode()
        atomic_write(self.path, lambda handle: handle.write(text))
        if self.legacy is not None:
            self.legacy.unlink(missing_ok=True)
            self.legacy = None
        self.unsaved, self.unsaved_commits, self.saved_at = False, [], time.monotonic()
