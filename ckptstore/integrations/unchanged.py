"""The commit id of a save whose state the branch's head already holds (a rerun, or last.ckpt after top-k)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ckptstore.errors import NothingToCommitError, RefExistsError

if TYPE_CHECKING:
    from ckptstore.hashing import CommitId
    from ckptstore.repo import Repository


def head_if_unchanged(repo: Repository, branch: str | None, get: Callable[[], CommitId]) -> CommitId:
    """`get()` (a commit, or a background commit's result); where nothing changed, the branch's head."""
    try:
        return get()
    except NothingToCommitError:  # stored all the same: the head holds exactly this state
        if branch is not None and branch not in repo.branches():  # a new branch that would start with HEAD's state
            try:
                return repo.branch(branch, "HEAD")
            except RefExistsError:  # made meanwhile by another process
                pass
        return repo.resolve(branch or "HEAD")
