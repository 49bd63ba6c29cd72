"""Every error ckptstore raises, defined once; each says what went wrong, on what, and what to do."""

from __future__ import annotations

from collections.abc import Sequence


class CkptError(Exception):
    """Base class of all ckptstore errors; the CLI prints these without a traceback."""

    exit_code = 1


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
        super().__init__(f"{what} {problem}{needed}. Run `ckpt fsck` to list all damage; other commits are unaffected.")

    @property
    def object_id(self) -> str:
        return self.object_ids[0] if self.object_ids else ""

    def needed_by(self, commits: Sequence[str]) -> CorruptObjectError:
        """The same damage, naming the commits it breaks."""
        return CorruptObjectError(self.object_ids, self.problem, commits)


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
    """A branch or tag name that cannot be used."""


class NothingToCommitError(CkptError):
    """The checkpoint equals its parent; no empty commit is made unless asked."""


class ConflictError(CkptError):
    """Another writer moved the branch while this commit was being written."""

    exit_code = 3


class CheckpointFormatError(CkptError):
    """An input that is not a readable checkpoint (truncated, wrong type, unsafe pickle)."""


class UnsupportedStateError(CkptError):
    """A value inside a checkpoint that ckptstore cannot store without pickle."""


class DirtyWorktreeError(CkptError):
    """Checkout would overwrite a file whose content is not in the store."""


class CodecError(CkptError):
    """An unknown codec id or malformed encoded payload."""


class RepoLockedError(CkptError):
    """Another process holds a lock this operation needs."""
