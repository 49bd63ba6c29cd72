"""`save` and `load`, shaped like torch.save and torch.load, on top of a Repository."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore import formats
from ckptstore.errors import CkptError
from ckptstore.hashing import CommitId
from ckptstore.repo import Repository
from ckptstore.repo.forked import ProcessLock
from ckptstore.repo.location import given_root
from ckptstore.signals import signals_waiting
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.repo.background import BackgroundCommit

RepoLike = Repository | str | os.PathLike | None


# Repositories opened by path, kept while a call uses them or one of their background commits is in
# flight (or failed unseen): one repository object per folder means one lane, so each save there waits
# for the commit before it (and raises its failure) instead of racing it on the branch. Once idle, a kept
# repository is closed and the next call opens the folder afresh (it may have been made anew meanwhile).
_KEPT: dict[Path, Repository] = {}
# The calls and background commits using each kept repository now: a thread that took it is about to
# commit or check out on it, so another thread that finds it idle must not close it under that call.
_USERS: dict[Path, int] = {}
_KEPT_LOCK = ProcessLock()
# Kept repositories whose folder was made anew while a call used them (a folder's repository named by its
# `.ckpt` folder's identity), by id: closed by their last user; the folder's next call opens the new one.
_STALE: dict[int, tuple[Repository, int]] = {}
_KEPT_IDENTITY: dict[Path, tuple[int, int] | None] = {}  # each kept repository's `.ckpt` when it was opened
# Whether _close_kept is registered with atexit: once per process (a forked child inherits the hook with
# the flag). Registering whenever _KEPT was empty added one more callback at each save after an idle spell.
_close_kept_hooked: list[bool] = []


def _close_kept() -> None:
    with _KEPT_LOCK:
        kept = [*_KEPT.values(), *(repository for repository, _ in _STALE.values())]
        _KEPT.clear()
        _USERS.clear()
        _STALE.clear()
    for repository in kept:
        repository.close()


def _forget_users_in_child() -> None:
    """A forked child has none of the parent's threads or commit threads: none of their uses will end there."""
    _USERS.clear()
    _STALE.clear()


os.register_at_fork(after_in_child=_forget_users_in_child)


def _identity(repository: Repository) -> tuple[object, ...] | None:
    """What init there again changes: the `.ckpt` folder's and a SQLite file's device and inode, and its config.

    The open connection pins the old database file's inode, so a new one cannot reuse it (a folder's can,
    at once on ext4); a server's database is named by the config's URLs, which init writes anew (its other
    keys may change under a repository, `ckpt remote add` writes there).
    """
    import tomllib

    database = repository.db.where
    try:
        places = [os.stat(place) for place in [repository.dir, *([database] if os.path.isabs(database) else [])]]
        core = tomllib.loads((repository.dir / "config.toml").read_text()).get("core", {})
    except (OSError, ValueError):  # gone, or no config one can read: not the repository it was
        return None
    # as RepoConfig reads them: a key left out is "" (`ckpt remote add` writes it so, under a commit in flight)
    return (*((found.st_dev, found.st_ino) for found in places), core.get("metadata_url") or "",
            core.get("objects_url") or "")


def _take_kept(root: Path) -> Repository | None:
    """The folder's kept repository, now used by the caller until `_let_go`; an idle one is closed and forgotten.

    Idle: nobody uses it, and no commit of it is in flight or failed unseen. Found and taken under one lock: a
    thread closing it between another's finding it and committing on it lost that commit. One whose folder
    was made anew meanwhile is never handed out: a save there went into the deleted database, unsaid.
    """
    from ckptstore.repo.background import busy, forget_failure  # the snapshot machinery, loaded when first used

    with _KEPT_LOCK:
        kept = _KEPT.get(root)
        if kept is None:
            return None
        same = _identity(kept) == _KEPT_IDENTITY.get(root)
        if same and (_USERS.get(root, 0) > 0 or busy(kept)):
            _USERS[root] = _USERS.get(root, 0) + 1
            return kept
        del _KEPT[root]
        users = _USERS.pop(root, 0)
        if users > 0:  # its users (a background commit among them) finish with it; the last closes it (_let_go)
            _STALE[id(kept)] = (kept, users)
            return None
    if not same:
        forget_failure(kept)  # warned of where it failed: no later call on this folder can raise it
    kept.close()
    return None


def _let_go(root: Path, repository: Repository, close_idle: bool = False) -> None:
    """One use of the folder's kept repository ended (a call returned, or a background commit finished).

    With `close_idle` (a call returned), one now idle is closed at once, as a repository a call opened for
    itself was; a background commit's thread leaves it to the next call, which closes it if still idle.
    """
    from ckptstore.repo.background import busy, forget_failure

    with _KEPT_LOCK:
        if id(repository) in _STALE:  # its folder was made anew: the last user closes it
            users = _STALE[id(repository)][1] - 1
            _STALE[id(repository)] = (repository, users)
            if users > 0:
                return
            del _STALE[id(repository)]
            forget_failure(repository)  # warned of where it failed: no later call on this folder can raise it
        elif _KEPT.get(root) is not repository or _USERS.get(root, 0) == 0:  # the exit or a fork forgot it meanwhile
            return
        else:
            _USERS[root] -= 1
            if not close_idle or _USERS[root] > 0 or busy(repository):
                return
            del _KEPT[root]
            del _USERS[root]
    repository.close()


def _use(root: Path) -> Repository:
    """The folder's kept repository, or one opened now and kept, used by the caller until `_let_go`.

    Every call by path on a folder goes through one object while anyone uses it: a blocking save that opened
    its own beside a background save's kept one committed on a second lane and raced it for the branch.
    """
    kept = _take_kept(root)
    if kept is not None:
        return kept
    opened = Repository.open(root)
    with _KEPT_LOCK:
        kept = _KEPT.get(root)  # another thread's first save kept one meanwhile: one object, one lane per folder
        if kept is None:
            if not _close_kept_hooked:
                atexit.register(_close_kept)
                _close_kept_hooked.append(True)
            _KEPT[root], _KEPT_IDENTITY[root] = opened, _identity(opened)
            kept = opened
        _USERS[root] = _USERS.get(root, 0) + 1
    if kept is not opened:
        opened.close()
    return kept


def _save_in_background(root: Path, run: Callable[[Repository], Any]) -> BackgroundCommit:
    """`run` on the folder's kept repository, which its commit goes on using until it finishes."""
    with signals_waiting():  # as in with_repo: a handler that saves by path would take the kept ones' lock again
        kept = _use(root)
        try:
            handle = run(kept)
            with _KEPT_LOCK:
                _USERS[root] = _USERS.get(root, 0) + 1
            handle.when_done(lambda _: _let_go(root, kept))  # at once where it already finished
            return handle
        finally:
            _let_go(root, kept, close_idle=True)


def with_repo(repo: RepoLike, fn: Callable[[Repository], Any]) -> Any:
    """`fn(repo)` for an open Repository as it is, or for the folder's repository at that path (or here).

    By path, the call goes through the repository every other call there uses meanwhile (a background save's
    commit in flight, another thread's save), so its commit waits on that one lane; it is closed once idle.
    """
    if isinstance(repo, Repository):
        return fn(repo)
    root = given_root(repo)
    with signals_waiting():  # a SIGTERM handler that saves by path takes the lock of the kept repositories again
        used = _use(root)
        try:
            return fn(used)
        finally:
            _let_go(root, used, close_idle=True)


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
    repository given by path (or None) then stays open while that commit runs, so each later save
    or load there waits for it (and raises its failure), as calls on one Repository do.
    """
    _warn_off_rank_zero()
    state = _in_memory(obj)

    def run(r: Repository) -> CommitId | BackgroundCommit:
        return r.commit(state, message=message, step=step, metrics=metrics, branch=branch, lossy=lossy, model=model,
                        optimizer=optimizer, calibration=calibration, max_loss_change=max_loss_change,
                        blocking=blocking, buffer_budget=buffer_budget, **knobs)

    if blocking or isinstance(repo, Repository):
        return with_repo(repo, run)
    return _save_in_background(given_root(repo), run)


def _in_memory(obj: Any) -> Any:
    """`obj` as a state to commit: a str is a value, as torch.save stores it; Repository.commit reads one as a path.

    save("") committed the current folder's files and save("step 5") failed with "step 5 does not exist".
    """
    if isinstance(obj, str):
        return formats.from_state(obj)  # flattened here: a Checkpoint is what commit takes as a state, never a path
    if isinstance(obj, os.PathLike):  # stored only through pickle; what the caller meant is one of two things
        raise CkptError(f"ckptstore.save({obj!r}): a path object is no value ckptstore stores; to commit the file "
                        "or folder there use Repository.commit(path) or `ckpt commit PATH`, to store its text save "
                        "str(path)")
    return obj


def _warn_off_rank_zero() -> None:
    """Warn a rank other than 0 of a torch.distributed job: each rank's save raced the others' for the branch."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)  # a job that imported no torch runs no ranks
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        warn_caller(f"ckptstore.save on rank {dist.get_rank()} of {dist.get_world_size()}: where every rank commits "
                    "to one branch, all but one fail or commit again; save on rank 0 only (with the state it holds "
                    "whole), or save sharded state with dcp.save and CkptStorageWriter from every rank")


def load(ref: str = "HEAD", repo: RepoLike = None, map_location: str | None = None,
         keys: Iterable[str] | None = None) -> Any:
    """The state committed at `ref`, with tensors on `map_location` (default: the CPU).

    `map_location` is one device, by name or as a torch.device (not torch.load's dict or function).
    `keys`: glob patterns such as ["model.*"]; only the matching values come back, and only their
    stored chains are read (see ckptstore.repo.select).
    """
    if isinstance(map_location, dict) or callable(map_location):
        raise CkptError(f"map_location={map_location!r}: give one device, by name ('cpu', 'cuda:0') or as a "
                        "torch.device; ckptstore.load restores every tensor onto it (no mapping by location)")
    device = str(map_location) if map_location is not None else None

    def run(r: Repository) -> Any:
        from ckptstore.repo.background import wait_in_flight

        wait_in_flight(r)  # a save(blocking=False) still writing there: load reads what it writes
        return r.checkout(ref, device=device, keys=keys)

    return with_repo(repo, run)
