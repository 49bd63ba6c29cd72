"""Making a repository's `.ckpt` folder whole or not at all (init, clone).

The folder is built under a temporary name beside where it goes (config, then the metadata
schema and HEAD) and renamed into place only once complete. An init or clone killed meanwhile
(SIGKILL, a power cut) leaves no `.ckpt`, so no command mistakes the half-made folder for a
damaged repository, and the next init or clone there removes the leftover and starts over.
Metadata on a server (PostgreSQL) or objects on S3 are outside the folder: a redo joins the
schema the killed run made, and finds the prefix still empty (init writes no objects).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Set
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore import faults
from ckptstore.errors import CkptError, RepoExistsError
from ckptstore.repo import owner, refs
from ckptstore.repo.config import RepoConfig
from ckptstore.repo.joining import MADE_ID, open_over_objects
from ckptstore.repo.location import REPO_DIR
from ckptstore.repo.repo_folders import repository_part_holding

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

STAGING = REPO_DIR + "-init-"  # + host-pid: the folder being built, its maker named so a leftover is recognised


def create(root: Path, config: RepoConfig) -> Repository:
    """A new repository at `root` with `config`, HEAD on an unborn branch: its `.ckpt` appears whole or not at all."""
    from ckptstore.repo.repository import Repository

    part = repository_part_holding(root)
    if part is not None:  # its objects would lie in the other's store, unseen by its fsck and gc
        raise CkptError(f"{root} is inside {part}, a repository's own folder or object store: make the repository "
                        "elsewhere")
    final = root / REPO_DIR
    if final.exists():
        raise RepoExistsError(f"{final} already exists")
    if final.is_symlink():  # to nothing: a store moved away and its link left behind
        raise RepoExistsError(f"{final} is a symlink to {os.readlink(final)}, which does not exist: repoint it at "
                              "the moved repository's .ckpt, or remove it to make a new repository here")
    made_root = not root.exists()
    staging = root / f"{STAGING}{socket.gethostname()}-{os.getpid()}"
    try:
        killed_inits = remove_leftovers(root)
        staging.mkdir(parents=True)
    except OSError as exc:
        raise CkptError(f"cannot create {final}: {exc.strerror or exc}") from None
    try:
        fresh = _build(root, staging, config, killed_inits)
        (staging / MADE_ID).unlink(missing_ok=True)  # only a killed init's half-made folder keeps it
        try:
            os.rename(staging, final)  # atomic: a killed init never leaves a .ckpt without config and schema
        except OSError:
            if final.exists():  # another init finished first
                raise RepoExistsError(f"{final} already exists") from None
            raise
        faults.point("init:renamed")
        made = Repository(root, config)
        made.joined = not fresh  # metadata a teammate's init made (with commits or without)
        owner.claim(made)  # its store names it: a copy's or another repository's gc refuses there
        return made
    except BaseException:
        import shutil  # only here: it imports the compression modules

        _withdraw_claim(config, staging)
        if config.metadata_url and (staging / MADE_ID).is_file():  # its metadata stays: the next init takes it up
            for part in staging.iterdir():
                if part.is_dir():
                    shutil.rmtree(part, ignore_errors=True)
                elif part.name != MADE_ID:
                    part.unlink(missing_ok=True)
        else:
            shutil.rmtree(staging, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):  # only if nothing else arrived there meanwhile
                root.rmdir()
        raise


def _build(root: Path, staging: Path, config: RepoConfig, killed_inits: Set[str]) -> bool:
    """The repository's folder made complete at `staging`: config, then the metadata with HEAD.

    True where this init made the metadata's schema; False where it found one (it joins that repository).
    `killed_inits`: the repository ids of this folder's earlier inits, killed (an S3 prefix they claimed is ours).
    """
    from ckptstore.repo.repository import Repository

    faults.point("init:folder-made")
    config.save(staging / "config.toml")
    faults.point("init:config-written")
    if config.objects_url or config.metadata_url:  # either may be another repository's: checked before joined
        repo = open_over_objects(root, config, create=True, folder=staging, joining=True, killed_inits=killed_inits)
    else:
        repo = Repository(root, config, create=True, folder=staging)
    try:
        owner.refuse_init(repo)  # a store another repository still owns: nothing is left of this init
        refs.ensure_head(repo)
        fresh = repo.db.made
    finally:
        repo.close()
    faults.point("init:metadata-made")
    return fresh


def remove_leftovers(root: Path) -> set[str]:
    """Remove the folders that inits on this machine left at `root` when killed (their process is gone).

    Returns the ids of the metadata they made (joining.MADE_ID): an S3 prefix one of them claimed, or a
    database one of them made, is this folder's own.
    """
    import shutil

    mine, killed = f"{STAGING}{socket.gethostname()}-", set()
    for folder in root.glob(STAGING + "*") if root.is_dir() else ():
        pid = folder.name[len(mine):] if folder.name.startswith(mine) else ""
        # another machine's, or a running init's, stay; one named by this process is an earlier one's with its pid
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            killed |= _made_ids(folder)
            shutil.rmtree(folder, ignore_errors=True)
    return killed


def _withdraw_claim(config: RepoConfig, staging: Path) -> None:
    """Give back the S3 prefix this failed init claimed for the metadata it made in `staging` (removed next)."""
    ids = _made_ids(staging) if config.objects_url else set()
    if ids:
        from ckptstore.objectstore import open_store

        with contextlib.suppress(Exception):  # the failure that got here may be the bucket's: its claim stays
            owner.withdraw_claim(open_store(config.objects_url, staging / "tmp", staging), ids)


def _made_ids(folder: Path) -> set[str]:
    """The id an init's half-made `folder` notes of the metadata it made (written before any claim or HEAD)."""
    try:
        return {(folder / MADE_ID).read_text().strip()}
    except (OSError, UnicodeDecodeError):
        return set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
