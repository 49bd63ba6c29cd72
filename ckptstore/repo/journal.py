"""The rename step of a checkout, journalled: a process killed between its renames is finished by the next.

A checkout writes every file under a temporary name first, then deletes what the commit lacks
and renames the new files into place. Those last steps take moments, but a `kill -9` among them
left a folder holding files of two commits (a trainer resuming from it would mix weights and
optimizer). Before them, the plan goes to `.ckpt/journals/` (durably); the checkout holds an
flock on it until the renames are durable and the journal is removed. The next process that
opens the repository for writing finds journals whose lock is free (their process died) and
carries out what is left: renames whose temporary file is still there, deletions of what is
still there, the commit's folders that hold no file (an older journal names none). A target or
a file to delete that changed since the journal was written (the user wrote it anew) is left as
it is, and its temporary file removed: nothing of the user's is lost to a late rename. A
checkout in place also moves HEAD once its renames are done; the journal names that move, so
HEAD and the files agree however the checkout ended (Ctrl-C finishes the renames and moves HEAD;
a process that finishes a dead one's renames moves it too, unless it had to leave a rename
undone; a failure, such as a full disk, after the first rename keeps the journal for the next
command to finish, as after a kill). A journal written in another place (the repository was copied or moved
since) is dropped with a warning: its paths name the old place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptstore.errors import CkptError, PrunedCommitError
from ckptstore.warn import warn_caller

FOLDER = "journals"
MoveHead = Callable[[str, "str | None"], None]  # (commit, branch or None for detached): refs.move_head's part


@dataclass(frozen=True)
class HeadMove:
    """HEAD's move that ends a checkout in place: to `commit`, on `branch` (None: detached), made by `move`."""

    commit: str
    branch: str | None
    move: MoveHead


@contextlib.contextmanager
def renaming(repo_dir: Path | None, renames: Sequence[tuple[Path, Path]], deletions: Sequence[Path],
             head: HeadMove | None = None, made: Sequence[Path] = ()) -> Iterator[None]:
    """Hold a durable journal of `renames` (temporary file, target), `deletions` and folders `made` for the block.

    `made`: the commit's folders that hold no file, made after the renames (a trainer's `runs/`).

    The block ends with the renames durable (its folders synced), then `head` is moved: the
    journal goes after both. With `repo_dir` None (a read-only repository), or where `.ckpt/`
    cannot take a journal (a full disk: `checkout -o` elsewhere still works), the block runs
    without one; a file where `.ckpt/journals/` belongs is refused (CkptError), nothing touched.
    """
    plan = {"root": str(repo_dir), "renames": [[str(a), str(b), _stamp(b)] for a, b in renames],
            "deletions": [[str(p), _stamp(p)] for p in deletions],
            "head": [head.commit, head.branch] if head is not None else None,
            "made": [str(folder) for folder in made]}
    fd, path = _write(repo_dir, plan) if repo_dir is not None else (None, None)
    kept = False
    try:
        yield
        if head is not None:
            head.move(head.commit, head.branch)
    except KeyboardInterrupt:  # Ctrl-C among the renames: finish them, the checkout is one step to the user
        if _carry_out(plan) and head is not None:
            head.move(head.commit, head.branch)
        raise
    except PrunedCommitError:  # HEAD's move refused for good (its commit removed meanwhile): the error says so
        raise
    except Exception as exc:
        if not _begun(plan):  # nothing replaced or deleted yet: the folder is as it was
            raise
        # a full disk (a folder's mkdir), EIO (a sync), HEAD's database write: the folder holds files of both
        # commits, so the journal stays for the next command to finish, as after a kill
        kept = fd is not None
        raise CheckoutInterruptedError(exc, kept) from exc
    finally:
        if fd is not None:
            if not kept:
                path.unlink(missing_ok=True)
            os.close(fd)


class CheckoutInterruptedError(CkptError):
    """A failure after a checkout began replacing files; `journal_kept`: its journal (and staged files) stay."""

    def __init__(self, cause: Exception, journal_kept: bool) -> None:
        self.journal_kept = journal_kept
        then = ("run any ckpt command (e.g. `ckpt status`) to finish it" if journal_kept else
                "the folder holds files of both commits: check it out again")
        super().__init__(f"the checkout was interrupted after it began replacing files: {_what_failed(cause)}; {then}")


def _what_failed(exc: Exception) -> str:
    """The failure in a few words, without a full disk's "nothing was lost: the write is undone" (not so here)."""
    from ckptstore.errors import explain

    said = explain(exc)
    if said is None and isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(said or exc).split("; nothing was lost", 1)[0]


def _begun(plan: dict) -> bool:
    """Whether the plan's steps began: a file it deletes is gone, or a staged file was renamed into place."""
    return (any(stamp is not None and _stamp(deleted) is None for deleted, stamp in plan["deletions"])
            or any(not Path(staging).exists() for staging, _, _ in plan["renames"]))


def _write(repo_dir: Path, plan: dict) -> tuple[int | None, Path | None]:
    """The journal, locked, written and synced under a temporary name, then renamed to its own."""
    from ckptstore.formats.atomic import sync_dir  # here: the formats package loads numpy, an open need not

    folder = repo_dir / FOLDER
    temp, fd = folder / f".{secrets.token_hex(8)}.tmp", None
    if os.path.lexists(folder) and not folder.is_dir():  # damage, not a full disk: running unjournalled would let a
        # kill among the renames leave HEAD and the files disagreeing, where moving the file away is one step
        raise CkptError(f"{folder} is not a folder (a file stands where checkouts keep their journals): move it "
                        "away and run the command again")
    try:
        folder.mkdir(exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides who may finish it
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(plan).encode())
        os.fsync(fd)
        path = temp.with_name(temp.name[1:-4] + ".json")
        os.replace(temp, path)  # seen by others only whole, and locked
        sync_dir(folder)
        return fd, path
    except OSError:
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):  # the error that stopped the journal may stop this too
            temp.unlink(missing_ok=True)
        return None, None


def finish_interrupted(repo_dir: Path, move_head: MoveHead | None = None) -> int:
    """Carry out what journals of dead checkouts left undone, HEAD's moves by `move_head`; returns how many.

    Nothing here stops the command that opened the repository: what cannot be done is one warning.
    """
    folder = repo_dir / FOLDER
    if not folder.is_dir():
        return 0
    finished = 0
    for path in sorted(folder.glob("*.json")):
        try:
            finished += _finish(path, repo_dir, move_head)
        except (OSError, ValueError, KeyError, TypeError, RecursionError, CkptError) as exc:
            warn_caller(f"an interrupted checkout's journal {path} could not be finished ({exc}); check its "
                        "files out again", RuntimeWarning)
    return finished


def _finish(path: Path, repo_dir: Path, move_head: MoveHead | None) -> int:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:  # its checkout ended meanwhile
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a checkout in progress
            return 0
        if os.fstat(fd).st_nlink == 0:  # its checkout ended between our open and our lock
            return 0
        with os.fdopen(os.dup(fd), "rb") as handle:
            plan = json.loads(handle.read())
        path.unlink(missing_ok=True)
        if plan["root"] != str(repo_dir):
            raise ValueError(f"it was written for {plan['root']}: the repository was copied or moved since")
        head = plan.get("head")  # none in a journal of an earlier version, or of a checkout elsewhere
        if _carry_out(plan) and head and move_head is not None:
            move_head(*head)
        return 1
    finally:
        os.close(fd)


def _carry_out(plan: dict) -> bool:
    """The plan's deletions, renames and folders made, each where its target is as the journal found it.

    False if one was not: a target written anew, or a file standing where a folder is made (the user's: kept).
    """
    whole = True
    for deleted, stamp in plan["deletions"]:
        if _stamp(deleted) == stamp:
            Path(deleted).unlink(missing_ok=True)
    for staging, target, stamp in plan["renames"]:
        if not Path(staging).exists():  # renamed already
            continue
        if _stamp(target) in (stamp, None):  # as the journal found it, or removed by the checkout (a folder)
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, target)
        else:
            Path(staging).unlink(missing_ok=True)
            whole = False
    for folder in plan.get("made") or []:  # none in a journal of an earlier version
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            whole = False
    return whole


def _stamp(path: str | os.PathLike) -> list[int] | None:
    """Device, inode, size and mtime of a file (not ctime: the checkout's own deletions change a link's)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]

