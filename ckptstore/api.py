"""`save` and `load`, shaped like torch.save and torch.load, on top of a Repository."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ckptstore.hashing import CommitId
from ckptstore.repo import Repository

if TYPE_CHECKING:
    from ckptstore.repo.background import BackgroundCommit

RepoLike = Repository | str | os.PathLike | None


def with_repo(repo: RepoLike, fn: Callable[[Repository], Any]) -> Any:
    """`fn(repo)` for an open Repository as it is, or for the one at that path (or here), opened and closed."""
    if isinstance(repo, Repository):
        return fn(repo)
    with Repository.open(repo) as opened:
        return fn(opened)


def save(obj: Any, repo: RepoLike = None, message: str = "", step: int | None = None,
         metrics: Mapping[str, float] | None = None, branch: str | None = None, lossy: str | None = None,
         model: Any = None, optimizer: Any = None, calibration: Callable[[Any], Any] | None = None,
         max_loss_change: float | None = None, blocking: bool = True, buffer_budget: int | None = None,
         **knobs: Any) -> CommitId | BackgroundCommit:
    """Commit `obj` (any nesting of tensors, containers and scalars) and return the commit id.

    `lossy` picks a lossy level; passing the live `model` and `optimizer` tells it exactly which
    optimizer state belongs to which weight, and `calibration(model)` (its loss on a fixed batch)
    lets it measure which weights the loss is sensitive to, and holds the restored checkpoint's
    loss within `max_loss_change` (relative; default: the level's promise) of the original's.
    `blocking=False` returns a handle as soon as `obj` is copied (`Repository.commit`); a
    repository given by path (or None) then stays open until that commit is done.
    """
    def run(r: Repository) -> CommitId | BackgroundCommit:
        return r.commit(obj, message=message, step=step, metrics=metrics, branch=branch, lossy=lossy, model=model,
                        optimizer=optimizer, calibration=calibration, max_loss_change=max_loss_change,
                        blocking=blocking, buffer_budget=buffer_budget, **knobs)

    if blocking or isinstance(repo, Repository):
        return with_repo(repo, run)
    from ckptstore.repo.background import close_when_done

    opened = Repository.open(repo)
    try:
        handle = run(opened)
    except BaseException:
        opened.close()
        raise
    return close_when_done(handle, opened)


def load(ref: str = "HEAD", repo: RepoLike = None, map_location: str | None = None,
         keys: Iterable[str] | None = None) -> Any:
    """The state committed at `ref`, with tensors on `map_location` (default: the CPU).

    `keys`: glob patterns such as ["model.*"]; only the matching values come back, and only their
    stored chains are read (see ckptstore.repo.select).
    """
    device = str(map_location) if map_location is not None else None
    return with_repo(repo, lambda r: r.checkout(ref, device=device, keys=keys))
