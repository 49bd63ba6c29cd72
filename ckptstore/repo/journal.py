"""The rename step of a checkout, journalled: a process killed between its renames is finished by the next.

A checkout writes every file under a temporary name first, then deletes what the commit lacks
and renames the new files into place. Those last steps take moments, but a `kill -9` among them
left a folder holding files of two commits (a trainer resuming from it would mix weights and
optimizer). Before them, the plan goes to `.ckpt/journals/` (durably); the checkout holds an
flock on it until the journal is removed. The next process that opens the repository for
writing finds journals whose lock is free (their process died) and carries out what is left:
renames whose temporary file is still there, deletions of what is still there. A target or a
file to delete that changed since the journal was written (the user wrote it anew) is left as
it is, and its temporary file removed: nothing of the user's is lost to a late rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

FOLDER = "journals"


@contextlib.contextmanager
def renaming(repo_dir: Path, renames: Sequence[tuple[Path, Path]], deletions: Sequence[Path]) -> Iterator[None]:
    """Hold a durable journal of `renames` (temporary file, target) and `deletions` for the length of the block.

    Where `.ckpt/` cannot take it (a read-only mount, a full disk: `checkout -o` elsewhere still
    works), the block runs without one, as before journals.
    """
    from ckptstore.formats.atomic import file_stamp  # here: the formats package loads numpy, an open need not

    plan = {"renames": [[str(a), str(b), file_stamp(b)] for a, b in renames],
            "deletions": [[str(p), file_stamp(p)] for p in deletions]}
    path, fd = repo_dir / FOLDER / f"{secrets.token_hex(8)}.json", None
    try:
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(plan).encode())
        os.fsync(fd)
    except OSError:
        if fd is not None:
            os.close(fd)
            path.unlink(missing_ok=True)
        fd = None
    try:
        yield
    except KeyboardInterrupt:  # Ctrl-C among the renames: finish them, the checkout is one step to the user
        _carry_out(plan)
        raise
    finally:
        if fd is not None:
            path.unlink(missing_ok=True)
            os.close(fd)


def finish_interrupted(repo_dir: Path) -> int:
    """Carry out what journals of dead checkouts left undone; returns how many were finished."""
    folder = repo_dir / FOLDER
    if not folder.is_dir():
        return 0
    finished = 0
    for path in sorted(folder.glob("*.json")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # its checkout ended meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a checkout in progress
            os.close(fd)
            continue
        try:
            with contextlib.suppress(ValueError):  # cut off while written: no rename had begun
                _carry_out(json.loads(path.read_bytes()))
                finished += 1
        except OSError as exc:  # a folder moved away, no permission: say so once, never stop the command
            warnings.warn(f"an interrupted checkout could not be finished ({exc}); check its files out again",
                          RuntimeWarning, stacklevel=3)
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)
    return finished


def _carry_out(plan: dict) -> None:
    for deleted, stamp in plan["deletions"]:
        if _same(deleted, stamp):
            Path(deleted).unlink(missing_ok=True)
    for staging, target, stamp in plan["renames"]:
        if not Path(staging).exists():  # renamed already
            continue
        if _same(target, stamp):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging, target)
        else:
            Path(staging).unlink(missing_ok=True)


def _same(path: str, stamp: list | None) -> bool:
    from ckptstore.formats.atomic import file_stamp

    now = file_stamp(path)
    return (None if now is None else list(now)) == stamp
