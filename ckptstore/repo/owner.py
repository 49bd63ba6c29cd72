"""Which repository owns a local object store: gc and prune delete only in their own.

An object store is named by its path alone. A copy of a repository whose objects live outside its
`.ckpt/` (`cp -a`), or a config edited to name another repository's objects folder, reached that
store too, and its gc deleted what the other repository needed. Beside each local store that init
makes, `<store>.owner` names the repository (its path, and its `.ckpt/` folder's device and inode:
a move on one disk keeps them, a copy does not). gc and prune refuse in a store outside their
`.ckpt/` unless it names them: by path (a remount changes the device), or by inode where the named
path is gone (a move: the name is updated). A store inside another repository's `.ckpt/` is refused
whatever it holds; one inside this `.ckpt/` is its own by place. A database shared by repositories
(PostgreSQL, or one SQLite file named by an absolute path) owns its store by the records it holds.
The file lies beside the store, not inside: the store's folder holds objects only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError
from ckptstore.objectstore.fallback import held_here
from ckptstore.repo.location import REPO_DIR

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

SUFFIX = ".owner"  # `.ckpt/objects.owner` for the default store
POSTGRES = ("postgresql:", "postgres:")
SQLITE = "sqlite:///"


def claim(repo: Repository, taking_over: bool = False) -> None:
    """Write this repository as the owner of its local store (init), or as the one moved here (`taking_over`).

    At init, a store naming another repository that is still there keeps that name: a second init
    over an empty store then has its own gc refused, not the first's.
    """
    folder = _local_store(repo)
    if folder is None or (not taking_over and _named(folder) not in (None, _me(repo))):
        return
    ckpt = os.stat(repo.dir)
    record = {"repository": str(_me(repo)), "device": ckpt.st_dev, "inode": ckpt.st_ino}
    temp = folder.with_name(f".{folder.name}{SUFFIX}.{os.getpid()}.tmp")  # not formats.atomic: numpy
    try:
        temp.write_text(json.dumps(record))
        os.replace(temp, marker(folder))
    except OSError:  # a store this process may not write beside: left unnamed
        temp.unlink(missing_ok=True)


def refuse_anothers(repo: Repository) -> None:
    """Raise unless this repository may delete in its local store (gc, prune); see the module docstring."""
    folder = _local_store(repo)
    own = Path(os.path.realpath(repo.dir))
    if folder is None or folder.is_relative_to(own):
        return
    holder = next((p for p in folder.parents if p.name == REPO_DIR and (p / "config.toml").is_file()), None)
    if holder is not None:  # another repository's own folder, named or not
        raise _refusal(folder, holder.parent)
    try:
        owner = json.loads(marker(folder).read_bytes())
        named, at = Path(owner["repository"]), (owner["device"], owner["inode"])
    except FileNotFoundError:
        return  # made before owners were written, or its owner file deleted: nothing names another
    except (OSError, ValueError, TypeError, KeyError):
        raise CkptError(f"{marker(folder)} cannot be read: it names the repository that owns the object store "
                        f"{folder}; nothing was deleted. Delete it if this repository is the one the store "
                        "belongs to") from None
    if named == _me(repo):
        return
    ckpt = os.stat(repo.dir)
    if (named / REPO_DIR).is_dir() or at != (ckpt.st_dev, ckpt.st_ino):
        raise _refusal(folder, named)
    claim(repo, taking_over=True)  # the named repository moved here on its disk: the name follows


def marker(folder: Path) -> Path:
    """Where the owner of the store in `folder` is named: beside it."""
    return folder.with_name(folder.name + SUFFIX)


def _refusal(folder: Path, owner: Path) -> CkptError:
    return CkptError(f"the object store {folder} belongs to the repository at {owner}, not this one: a gc here would "
                     "delete the objects that one needs, so nothing was deleted. A copy of a repository needs "
                     "objects of its own (`ckpt clone` makes one). If this repository is that one, moved to another "
                     f"disk or restored, and no copy uses the store, delete {marker(folder)}")


def _named(folder: Path) -> Path | None:
    """The repository the store's owner file names, if it can be read and that repository is still there."""
    try:
        named = Path(json.loads(marker(folder).read_bytes())["repository"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return named if (named / REPO_DIR).is_dir() else None


def _me(repo: Repository) -> Path:
    return Path(os.path.realpath(repo.root))


def _local_store(repo: Repository) -> Path | None:
    """The resolved folder of the repository's local object store, unless its database may be shared."""
    root, url = getattr(held_here(repo.store), "root", None), repo.config.metadata_url
    shared = url.startswith(POSTGRES) or (url.startswith(SQLITE) and os.path.isabs(url[len(SQLITE):]))
    return None if root is None or shared else Path(os.path.realpath(root))
