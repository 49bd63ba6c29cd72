"""Every error ckptstore raises, defined once; each says what went wrong, on what, and what to do."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
from collections.abc import Iterator, Mapping, Sequence

# What `ckpt` says on Ctrl-C, wherever the command ran (here, or in the repository's daemon)
INTERRUPTED = ("interrupted; nothing half-done is recorded: run the same command again to finish it (a commit, push, "
               "fetch or clone then stores or sends only what is missing; `ckpt gc` removes what an unfinished one "
               "left), and an unfinished checkout leaves the files and HEAD as they were or at the commit")


class CkptError(Exception):
    """Base class of all ckptstore errors; the CLI prints these without a traceback.

    Pickled as it stands (its message and attributes), without running its __init__ again: DCP hands a
    rank's exception to the others pickled, and a subclass whose __init__ takes more than the message came
    back as a TypeError (a rank then waited in a collective for its group's timeout, the real message lost).
    """

    exit_code = 1

    def __reduce__(self) -> tuple:
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[CkptError], said: tuple, state: dict) -> CkptError:
    """A CkptError unpickled: its message and attributes as they were when it was pickled."""
    error = cls.__new__(cls, *said)
    error.args = said
    error.__dict__.update(state)
    return error


class RepoNotFoundError(CkptError):
    """No `.ckpt` repository where one was expected."""


class RepoExistsError(CkptError):
    """`init` on a folder that already holds a repository."""


class CorruptObjectError(CkptError):
    """Stored objects that are missing, truncated or do not match their hash.

    `object_ids` names every object that may hold the damage (a tensor's chunks, when only
    its decoded bytes showed it); `object_id` is the first of them.
    """

    def __init__(self, object_ids: str | Sequence[str], problem: str, commits: Sequence[str] | None = None) -> None:
        self.object_ids = [object_ids] if isinstance(object_ids, str) else list(object_ids)
        self.problem = problem
        self.commits = list(commits or [])
        needed = f"; needed by commits {', '.join(c[:12] for c in self.commits)}" if self.commits else ""
        what = (f"object {self.object_ids[0]} is" if len(self.object_ids) == 1
                else f"one of objects {', '.join(self.object_ids)} is")
        super().__init__(f"{what} {problem}{needed}. Run `ckpt fsck` to list all damage; commits that need no damaged "
                         "object are unaffected.")

    @property
    def object_id(self) -> str:
        return self.object_ids[0] if self.object_ids else ""

    def needed_by(self, commits: Sequence[str]) -> CorruptObjectError:
        """The same damage, naming the commits it breaks."""
        return CorruptObjectError(self.object_ids, self.problem, commits)


class SentObjectError(CorruptObjectError):
    """A damaged object in the repository sending it (a remote on fetch, this one on push): the damage is there."""

    def __init__(self, object_id: str, problem: str, sender: str, pushing: bool = False) -> None:
        super().__init__(object_id, problem)
        if pushing:
            self.args = (f"this repository ({sender}) holds a damaged object ({object_id}: {problem}); nothing was "
                         "recorded on the remote. Run `ckpt fsck` here to see what it damages",)
        else:
            self.args = (f"the repository at {sender} holds a damaged object ({object_id}: {problem}); nothing of "
                         "it was recorded here. Check that repository: `ckpt fsck` in it, or `ckpt fsck --remote "
                         "NAME` from a repository that has it as a remote",)


class RefNotFoundError(CkptError):
    """A ref, commit id or `REF~N` that names nothing."""

    def __init__(self, ref: str, suggestions: list[str] | None = None, detail: str = "") -> None:
        self.ref = ref
        self.suggestions = list(suggestions or [])
        hint = f" Did you mean: {', '.join(self.suggestions)}?" if self.suggestions else ""
        super().__init__(f"unknown ref {ref!r}{detail}.{hint}")


class AmbiguousRefError(CkptError):
    """A commit id prefix that matches more than one commit."""


class RefExistsError(CkptError):
    """Creating a branch or tag whose name is taken."""


class InvalidRefNameError(CkptError):
    """A branch, tag or remote name that cannot be used: a wrong argument, exit 2 as click's own refusals."""

    exit_code = 2


class NothingToCommitError(CkptError):
    """The checkpoint equals its parent; no empty commit is made unless asked."""


class ConflictError(CkptError):
    """Another writer moved the branch while this commit was being written."""

    exit_code = 3


class CheckpointFormatError(CkptError):
    """An input that is not a readable checkpoint (truncated, wrong type, unsafe pickle)."""


class SourceRemovedError(CkptError):
    """A file of the checkpoint was removed while it was committed (a rotation): nothing was recorded."""


class PickledObjectsError(CheckpointFormatError):
    """A torch.save file whose pickle holds objects that will not (or, trusted, cannot) be rebuilt here."""


class UnsupportedStateError(CkptError):
    """A value inside a checkpoint that ckptstore cannot store without pickle."""


class MalformedSkeletonError(CkptError):
    """A stored skeleton that no flatten wrote (damaged, or forged by a remote): it does not rebuild into a state.

    Raised where skeletons are walked (state.unflatten, repo.select), which know no commit; the repo
    layer names the commit and its manifest (repo.manifest.rebuilding_files).
    """

    # what a walk raises on a node of the wrong shape (a list as a dict key, `[]`), or nested past the stack
    WALK_ERRORS = (TypeError, ValueError, IndexError, KeyError, AttributeError, RecursionError)

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"a stored state's structure is damaged or forged ({problem}): it cannot be rebuilt; use "
                         "another commit, or a sound copy of this one")

    @classmethod
    def of(cls, exc: BaseException) -> MalformedSkeletonError:
        """What walking a skeleton raised (one of WALK_ERRORS), said as its damage in one line."""
        if isinstance(exc, RecursionError):  # flatten nests at most state.MAX_DEPTH levels: far from the stack's end
            return cls("it nests deeper than any state ckptstore writes")
        return cls(f"{exc!r:.200}")  # repr: one line, control characters escaped


class DeviceUnavailableError(CkptError):
    """A checkout to a device (map_location) this machine or this torch build cannot use."""


class DirtyWorktreeError(CkptError):
    """Checkout would overwrite a file whose content is not in the store.

    `problem` is the message without checkout's `advice`, for a caller that gives its own (pull, hf.restore).
    """

    def __init__(self, problem: str, advice: str = "") -> None:
        self.problem, self.advice = problem, advice
        super().__init__(f"{problem}; {advice}" if advice else problem)


class CodecError(CkptError):
    """An unknown codec id or malformed encoded payload."""


class UnquantizableError(CodecError):
    """A lossy codec cannot store these values within its level: the commit stores them lossless instead."""


class NonFiniteError(UnquantizableError):
    """A lossy codec was given NaN or infinite values (a diverged run): they have no step to quantize by."""


def listing(items: Sequence[str], most: int, separator: str = ", ") -> str:
    """The first `most` of `items`, joined, and how many more: how a message names a long list."""
    return separator.join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


# control characters but newline and tab: a commit message, metric or file name holding them (another
# machine's commit, fetched) would otherwise retitle or clear the terminal, or overwrite lines
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown_controls(text: str) -> str:
    """`text` with its control characters written out (ESC as a backslash and x1b): harmless in a terminal."""
    return CONTROL_CHARACTERS.sub(lambda found: f"\\x{ord(found.group()):02x}", text)



def is_utf8(name: str) -> bool:
    """Whether `name` is UTF-8 text: os.fsdecode gives surrogates for the bytes of one that is not, json a lone one."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True

def shown_name(text: str) -> str:
    r"""A file or tensor name for a line of its own: a backslash as \\, a newline as \n, bytes not UTF-8 as \xNN.

    Control characters as \xNN too, as the CLI writes every line: a library warning has no CLI. A newline would
    start a line that looks like an entry of its own (a forged commit line); the backslash
    goes first, so a name holding a backslash and an n cannot look like one holding a newline.
    """
    text = shown_controls(text.replace("\\", "\\\\").replace("\n", "\\n"))
    try:  # os.fsdecode's surrogates stand for the bytes of a name that is not UTF-8
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate no file name decodes to (from a JSON record)
        return text.encode("utf-8", "backslashreplace").decode()


REASONS_SHOWN = 8  # a warning over a 7B model's hundreds of tensors stays a few lines; `ckpt show` lists each


def with_reasons(reasons: Mapping[str, str]) -> str:
    """The first few of `reasons`' keys (tensors a level could not quantize, say) with why, for a warning."""
    return listing([f"{key}: {why}" for key, why in sorted(reasons.items())], REASONS_SHOWN, "; ")


class UnquantizableTensorsError(UnquantizableError):
    """Some tensors of a lossy commit cannot keep their level (`reasons`, by job key); the others could."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons
        super().__init__(listing([f"{key}: {why}" for key, why in reasons.items()], 1))


class PrunedCommitError(CkptError):
    """A commit `ckpt prune` removed: its row and place in the history stay, its tensors are gone."""


class UnknownMetricError(CkptError):
    """A retention rule names a metric no commit has: a misspelt name, or one not logged yet."""


class RetentionError(CkptError):
    """A commit was recorded, but the [retention] policy's prune after it failed (the next commit's tries again)."""

    def __init__(self, commit_id: str, problem: object) -> None:
        self.commit_id = commit_id
        # the problem's own advice may say to run the command again: that commit would find nothing to do
        said = str(problem).rstrip(".")
        super().__init__(f"commit {commit_id[:12]} was recorded, but the [retention] policy's prune after it "
                         f"failed: {said}{' ' if said.endswith('?') else '. '}To finish the prune, run `ckpt prune` "
                         "once that is fixed (committing again finds nothing changed; the next commit's policy "
                         "prunes again)")


class LostLockError(CkptError):
    """The session that held a repository lock on a shared database ended while the command ran (`ended`: how).

    `deleting`: it ended while gc deleted (its line names what to check); else before anything was deleted.
    """

    def __init__(self, message: str, ended: str, deleting: bool = False) -> None:
        super().__init__(message)
        self.ended, self.deleting = ended, deleting


class RepoLockedError(CkptError):
    """Another process holds a lock this operation needs."""


class StoreUnavailableError(CkptError):
    """An object store (a bucket, a remote) could not be reached or refused the request; nothing was lost."""


class DiskFullError(CkptError):
    """A write ran out of disk space (or quota, or the file size limit); what was stored before is intact."""


class BackgroundCommitError(CkptError):
    """A background commit failed and nobody asked its handle; the repository is as it was before it."""


class OutputError(CkptError):
    """The command's standard output could not be written (its reader left, its disk is full): not the repository's."""

    def __init__(self, cause: OSError, recorded: str = "") -> None:
        """`recorded`: what the command kept before its output failed (`commit ID`), said even to a reader gone."""
        self.cause = cause
        self.errno = cause.errno
        # a reader gone (`ckpt log | head -1`) ends quietly with SIGPIPE's status, as git does
        self.quiet = cause.errno == errno.EPIPE and not recorded
        self.exit_code = 128 + signal.SIGPIPE if cause.errno == errno.EPIPE else 1
        reason = cause.strerror or cause
        super().__init__(f"{recorded} was recorded; its summary could not be written ({reason})" if recorded
                         else f"cannot write the output: {reason}")

    @classmethod
    def closed(cls) -> OutputError:
        """The error of a process started with its stdout closed (`>&-`): Python gives it no stream."""
        return cls(OSError(errno.EBADF, "standard output is closed"))


class ReadOnlyRepoError(CkptError):
    """A write to a repository opened read-only (a read-only mount, or files this user may not write)."""


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_DISK_FULL_WORDS = ("database or disk is full", "no space left on device", "file write failed")
_NOTHING_LOST = ("nothing was lost: the interrupted write is undone and earlier commits are intact. {remedy} and run "
                 "the command again (`ckpt gc` removes what interrupted commits left, on a full disk too)")


def disk_full(detail: str) -> DiskFullError:
    """The error for a write that found the disk full, saying that nothing was lost and what to do."""
    return DiskFullError(f"the disk is full ({detail}); {_NOTHING_LOST.format(remedy='Free some space')}")


def no_inodes_left(path: str | os.PathLike | None) -> str | None:
    """The folder nearest `path` that exists, where its file system has (almost) no file left to make, else None."""
    if not path:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    while folder != os.path.dirname(folder) and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    # a write undone since (a temporary file removed) gave a few back: "almost none" is what tells
    return folder if stats.f_files and stats.f_favail < max(64, stats.f_files // 1000) else None


def no_more_files(folder: str) -> str:
    """The words for a file system with bytes left but no inodes, where `folder` is (no_inodes_left's)."""
    return (f"the file system holding {folder} can make no more files (its inodes are used up: `df -i {folder}`), "
            "though it may have bytes free")


def inodes_used_up(folder: str) -> DiskFullError:
    """The error for a file system with bytes left but no inodes: freeing bytes would not help."""
    return DiskFullError(f"{no_more_files(folder)}; "
                         + _NOTHING_LOST.format(remedy="Remove files there, or use a file system with more inodes"))


def _no_room(exc: OSError) -> DiskFullError:
    """A write refused for want of room: bytes, inodes, a quota, or the largest file allowed."""
    where = f" writing {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC and (held := no_inodes_left(exc.filename)):
        return inodes_used_up(held)
    if exc.errno in DISK_FULL_ERRNOS and _outside_repository(exc) and _TEMP_OF.match(os.path.basename(exc.filename)):
        # a checkout's or export's file beside its target: gc in the repository cannot help there
        return DiskFullError(f"the disk holding {_written_folder(exc)} is full ({exc.strerror or exc}); what was "
                             "there is unchanged and nothing half-written is left: free space there or write elsewhere")
    tell = file_too_large if exc.errno == errno.EFBIG else disk_full
    return tell(f"{exc.strerror or exc}{where}")


def file_too_large(detail: str) -> DiskFullError:
    """EFBIG: freeing space cannot help; the limit is the process's (`ulimit -f`) or the file system's largest file."""
    return DiskFullError(f"a file reached the largest size allowed here ({detail}): the process's file-size limit "
                         "(`ulimit -f`) or the file system's largest file; "
                         + _NOTHING_LOST.format(remedy="Raise the limit or write to another file system"))


def _path_too_odd(exc: RuntimeError) -> CkptError | None:
    """A path no walk can take: a symlink loop (Path.resolve's RuntimeError), folders nested past the stack."""
    if isinstance(exc, RecursionError):  # about 1,000 levels of folders (a walk recurses)
        return CkptError("folders nested too deeply (about 1,000 levels) to walk: store a shallower tree")
    if str(exc).startswith("Symlink loop from"):
        return CkptError(f"{str(exc).split('from', 1)[1].strip()} is a symlink that leads back to itself (a loop): "
                         "remove or repoint it")
    return None


def explain(exc: BaseException) -> CkptError | None:
    """The CkptError for a failure from below ckptstore (the OS, SQLite, torch) with a known cause, else None.

    Follows `__cause__`/`__context__`, since a library may wrap the OS error it hit.
    """
    for current in causes(exc):
        if isinstance(current, CkptError):
            return current
        text = str(current).lower()
        if isinstance(current, OSError) and current.errno in (*DISK_FULL_ERRNOS, errno.EFBIG):
            return _no_room(current)
        if isinstance(current, (RuntimeError, RecursionError)) and (said := _path_too_odd(current)):
            return said
        if (said := _out_of_memory(current, text)) is not None:
            return said
        if isinstance(current, OSError) and (said := _io_failure(current)) is not None:
            return said
        if any(words in text for words in _DISK_FULL_WORDS):
            return disk_full(str(current).splitlines()[0].strip()[:200])
        if isinstance(current, OSError) and current.errno == errno.EROFS and _outside_repository(current):
            return CkptError(f"{_written_folder(current)} is on a read-only file system; write elsewhere")
        if "readonly database" in text or isinstance(current, OSError) and current.errno == errno.EROFS:
            return ReadOnlyRepoError(f"this repository is read-only here ({current}); reading commands work, "
                                     "writing ones need write access to its .ckpt folder")
        if isinstance(current, OSError) and current.errno in (errno.ENOENT, errno.EINVAL) and str(
                current.filename or "").endswith(".ckpt-tmp"):
            return _cannot_make(current)
        if isinstance(current, PermissionError):
            return _permission_denied(current)
        if isinstance(current, IsADirectoryError):  # a folder where the repository keeps a file (.ckpt/lock)
            return CkptError(f"{current.filename or 'a path'} is a folder where a file was expected: move it "
                             "away (if it is inside .ckpt/, the repository is damaged: `ckpt fsck`)")
        if isinstance(current, OSError) and current.errno == errno.ENAMETOOLONG:
            return CkptError(f"{current.filename or 'a path'} is too long for this file system (a name in it, or the "
                             "whole path); choose a shorter one")
        if isinstance(current, UnicodeEncodeError) and "surrogates" in text:
            return CkptError(f"'{shown_name(current.object[:80])}' holds bytes that are not UTF-8; ckptstore records "
                             "names, paths and messages as UTF-8: rename the file, or pass the text in UTF-8")
    return None


@contextlib.contextmanager
def naming_file(path: str | os.PathLike) -> Iterator[None]:
    """An OSError raised inside that names no file (a read, a write, an fsync) names `path`, for its message."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc  # the errno's subclass, as OSError makes it


def _io_failure(exc: OSError) -> CkptError | None:
    """A failing disk (EIO), or too many open files; else None."""
    if exc.errno == errno.EIO:
        return CkptError(f"the disk failed to read or write{f' {exc.filename}' if exc.filename else ''} (input/output "
                         "error): it or its file system may be failing (see `dmesg`); nothing was recorded from a "
                         "write it failed, and `ckpt fsck` lists what can no longer be read")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return CkptError(f"too many open files ({exc.strerror}{_limit_of_open_files()}): raise the limit "
                         "(`ulimit -n 65536`) and run the command again")
    return None


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps (`__cause__`, else `__context__`), each once: a library may wrap the error it hit."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _out_of_memory(exc: BaseException, text: str) -> CkptError | None:
    """The error for memory refused: a MemoryError, or other words (mmap's ENOMEM, a thread or library not mapped).

    The other words are also those of a limit on threads or of a library on a noexec mount: both are said.
    """
    if isinstance(exc, MemoryError):  # numpy's says how much it could not allocate
        return CkptError(f"out of memory ({str(exc) or 'no more could be allocated'}): free memory and run "
                         "the command again (a checkout can restore part of a commit: --only PATTERN)")
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM or isinstance(exc, (RuntimeError, ImportError, OSError)) \
            and any(words in text for words in ("can't start new thread", "failed to map segment",
                                                  "cannot allocate memory")):
        noexec = (", or move the library off a file system mounted without exec (noexec)"
                  if "failed to map segment" in text else "")
        return CkptError(f"out of memory, or a limit reached ({exc}): free memory, or raise the limits on memory "
                         f"and threads (`ulimit -v`, `ulimit -u`){noexec}, and run the command again")
    return None


_LIMIT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EFBIG, *DISK_FULL_ERRNOS})


def out_of_resources(exc: BaseException) -> bool:
    """Whether `exc`, or what it wraps, is a limit met (files, memory, threads, disk), not a fault of what was read.

    A reader's catch-all lets these through before it calls a file damaged: a user told so may delete a good
    checkpoint, and `explain` names the limit instead.
    """
    return any(isinstance(current, OSError) and current.errno in _LIMIT_ERRNOS
               or _out_of_memory(current, str(current).lower()) is not None for current in causes(exc))


def _limit_of_open_files() -> str:
    """", the limit is N" for this process's limit on open files, where it can be read."""
    try:
        import resource

        return f", the limit is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (ImportError, OSError, ValueError):
        return ""


def _in_repository(name: str) -> bool:
    """Whether a path lies in a repository's own `.ckpt` folder: the repository's files, not a user's output."""
    return f"{os.sep}.ckpt" in name


def _outside_repository(exc: OSError) -> bool:
    """Whether the path an OS error names is known and outside any repository's `.ckpt` folder (a user's output)."""
    return bool(exc.filename) and not _in_repository(str(exc.filename))


def _written_folder(exc: OSError) -> str:
    """What failed to be written: the folder of formats.atomic's temporary file beside a target, else the path."""
    name = str(exc.filename or exc)
    return (os.path.dirname(name) or ".") if name.endswith(".ckpt-tmp") else name


_TEMP_OF = re.compile(r"^\.(.+)\.[0-9a-z-]*[0-9a-f]{16}\.ckpt-tmp$")  # formats.atomic.temp_beside's names
_WINDOWS_REFUSED = re.compile(r'[:*?"<>|\\\x00-\x1f]')  # what FAT, exFAT and NTFS refuse in a name


def _cannot_make(exc: OSError) -> CkptError:
    """A temporary file that could not be made beside its target: a folder taking no files, or a name refused."""
    folder = _written_folder(exc)
    named = _TEMP_OF.match(os.path.basename(str(exc.filename)))
    if named and os.path.isdir(folder) and _WINDOWS_REFUSED.search(named.group(1)):  # its file system refuses it
        return CkptError(f"the file system of {folder} does not accept the name {named.group(1)!r} (FAT, exFAT and "
                         "Windows refuse : * ? \" < > | and control characters): write onto another "
                         "file system (or commit the file under another name)")
    return CkptError(f"cannot make a file in {folder} (a folder where files cannot be made, such as /dev/fd or "
                     "/proc, or one removed meanwhile); write elsewhere")


def _permission_denied(exc: PermissionError) -> CkptError:
    """Name what the user can act on: the folder of a temporary file beside a target, the repository's own files."""
    if exc.filename2:  # a rename (os.replace): the folder it moves into is the one not writable, mostly
        folder = os.path.dirname(exc.filename2) or "."
        if os.access(folder, os.W_OK):  # writable, yet refused: a sticky folder (/tmp) keeps another's file there
            return CkptError(f"permission denied replacing {exc.filename2}: another user's file in a folder that "
                             "lets only its owner replace or remove it; ask them to remove it, or write elsewhere")
        return CkptError(f"permission denied moving {exc.filename} into {folder}; ask for write access to that folder")
    name = str(exc.filename or exc)
    hint = " (a repository you may only read opens with --read-only)" if _in_repository(name) else ""
    if name.endswith(".ckpt-tmp"):  # formats.atomic's temporary file: the folder is what is not writable
        return CkptError(f"permission denied writing into {_written_folder(exc)}; ask for access to it"
                         f"{hint or ' or write elsewhere'}")
    return CkptError(f"permission denied on {name}; ask for access to it{hint}")


class CorruptRecordError(CkptError):
    """Metadata records that are lost, damaged or rewritten: they disagree with each other or with their ids.

    `what` names the record (a tensor or commit id, with its path where known); `commits` the
    commits that need it.
    """

    def __init__(self, what: str, problem: str, commits: Sequence[str] | None = None, tensors: Sequence[str] = (),
                 outcome: str = "Nothing was restored from it") -> None:
        self.what = what
        self.problem = problem
        self.commits = list(commits or [])
        self.tensors = list(tensors)
        self.outcome = outcome
        needed = f"; needed by commits {', '.join(str(c)[:12] for c in self.commits)}" if self.commits else ""
        super().__init__(f"the metadata of {what} is damaged: {problem}{needed}. {outcome}; "
                         "run `ckpt fsck` to list all damage")

    def needed_by(self, commits: Sequence[str]) -> CorruptRecordError:
        """The same damage, naming the commits it breaks."""
        return CorruptRecordError(self.what, self.problem, commits, self.tensors, self.outcome)


class DamageListedPastError(CkptError):
    """A listing (`ckpt log`, `stats`, `branch`, `tag`) that went on past damaged records, each warned of: exit 1.

    So a script notices what was left out, and one damaged branch does not hide the rest of the history.
    """

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} damaged record{'s' * (count != 1)} of the metadata (warned of above) "
                         f"{'were' if count != 1 else 'was'} left out or shown in part; the rest was listed. Run "
                         "`ckpt fsck` to list all damage")


class CorruptDatabaseError(CkptError):
    """The metadata database file itself is damaged: SQLite cannot read its pages or their text."""


class MissingDatabaseError(CorruptDatabaseError):
    """A repository's metadata database is missing or holds no schema (opening never creates one)."""
