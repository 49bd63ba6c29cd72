"""Where a new commit goes and how its ref moves: shared by every path that records commits.

An ordinary commit (repo/commit.py) and a sharded one (repo/sharded.py) both start from the tip
of a branch (or a detached HEAD) and move it with compare-and-swap in their one transaction.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError, ConflictError, CorruptRecordError
from ckptstore.hashing import CommitId
from ckptstore.metadata import Tx
from ckptstore.metadata import refs as ref_rows
from ckptstore.repo import refs

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


@dataclass
class Start:
    """Where a commit goes: the branch to advance (None: a detached HEAD) and the commit it starts from.

    `new`: the branch has no ref yet (HEAD's unborn branch, or one this commit creates), so a ref
    that is gone when the commit is recorded was deleted meanwhile only where `new` is false.
    """

    target: str | None
    commit: CommitId | None
    new: bool = False


def commit_target(tx: Tx, branch: str | None, remotes: Iterable[str] = ()) -> Start:
    """The start of a commit on `branch` (default: HEAD's branch, or HEAD itself when detached).

    A new branch's name must pass today's rules, and name none of `remotes` as its first part.
    """
    if branch is None:
        if ref_rows.ref_row(tx, refs.HEAD) is None:
            raise CorruptRecordError("ref HEAD", "its record is missing")
        branch = refs.head_branch(tx)
        if branch is None:
            return Start(None, refs.head_commit(tx))
    row = ref_rows.ref_row(tx, branch)
    if row is None and branch != refs.head_branch(tx):  # only a name being created must pass today's rules
        refs.check_made_name(branch, remotes, tx)
    if row is not None and row.kind != refs.BRANCH:
        raise CkptError(f"{branch!r} is {'a tag' if row.kind == refs.TAG else 'not a branch'}; commits go on branches")
    if row is not None and not row.commit_id:  # not an unborn branch: a commit there would drop its history
        raise ref_rows.nowhere(branch)
    if row is not None:
        return Start(branch, CommitId(row.commit_id))
    return Start(branch, refs.head_commit(tx) if branch != refs.head_branch(tx) else None, new=True)


def start_now(repo: Repository, branch: str | None) -> Start:
    """`commit_target` of `branch` as the repository is now, in a transaction of its own."""
    with repo.db.read() as tx:
        return commit_target(tx, branch, repo.config.remotes)


def move_ref(tx: Tx, start: Start, new: CommitId) -> None:
    """Compare-and-swap the ref: it must still point where this commit started from (and still exist).

    A branch this commit creates may have been made meanwhile at the very commit it started from:
    then it moves on from there, as it would have had it been made first.
    """
    target, expected = start.target, start.commit
    if target is None:
        moved = expected is not None and ref_rows.swap(tx, refs.HEAD, refs.HEAD_KIND, expected, new)
    elif start.new and ref_rows.ref_row(tx, target) is None:
        ref_rows.insert_ref(tx, target, refs.BRANCH, new)
        moved = True
    else:
        moved = expected is not None and ref_rows.swap(tx, target, refs.BRANCH, expected, new)
    if not moved:
        conflict(tx, start)


def conflict(tx: Tx, start: Start) -> None:
    """Raise the ConflictError that says what became of the ref this commit was to move."""
    now = ref_rows.ref_row(tx, start.target or refs.HEAD)
    began = f"it started from {start.commit[:12] if start.commit else 'an unborn branch'}"
    if now is None and start.new:  # never made: what it was to start from went (only a removed start gets here)
        raise ConflictError(f"{start.target} was to be made at {(start.commit or '')[:12]}, which `ckpt prune` or "
                            "`ckpt gc --prune` removed while this commit was being written; nothing was recorded. "
                            f"Commit again to make {start.target} at HEAD")
    if now is None:
        raise ConflictError(f"{start.target} was deleted while this commit was being written ({began}); nothing "
                            f"was recorded. Commit again to make {start.target} anew at HEAD, or to another branch "
                            "with --branch.")
    where = f"was made at {(now.commit_id or 'nothing')[:12]}" if start.new else \
        f"moved to {(now.commit_id or 'nothing')[:12]}"
    raise ConflictError(
        f"{start.target or 'HEAD'} {where} while this commit was being written ({began}); nothing was recorded. "
        "Another commit went to the same branch meanwhile (another process, or another Repository object of "
        "the same folder): commit again to put this checkpoint on top, or use --branch to keep the two runs apart."
    )


def default_author() -> str:
    """The author of a commit that names none: $CKPT_AUTHOR, else the login name."""
    try:
        return os.environ.get("CKPT_AUTHOR") or getpass.getuser()
    except Exception:
        return "unknown"
