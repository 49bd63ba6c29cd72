"""Which repository owns a local object store: gc and prune delete only in their own.

An object store is named by its path alone. A copy of a repository whose objects live outside its
`.ckpt/` (`cp -a`), or a config edited to name another repository's objects folder, reached that
store too, and its gc deleted what the other repository needed. Beside each local store that init
makes for a repository with its own SQLite metadata, `<store>.owner` names the repository's folder
(beside, not inside: the store's folder holds objects only). gc and prune refuse in a store outside
their `.ckpt/` while the repository it names is still there and is not them; one that has gone
(moved, or an init that failed) is taken over. A store inside another repository's `.ckpt/` is
refused whatever it holds. A store inside this `.ckpt/` is its own by place: a copy of the folder
copied it. A shared database (PostgreSQL) owns its store by the records it holds.
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


def claim(repo: Repository) -> None:
    """Write this repository as the owner of its local store (init, and a store taken over)."""
    folder = _local_store(repo)
    if folder is None:
        return
    temp = folder.with_name(f".{folder.name}{SUFFIX}.{os.getpid()}.tmp")  # not formats.atomic: numpy
    try:
        temp.write_text(json.dumps({"repository": os.path.realpath(repo.root)}))
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
        owner = Path(json.loads(marker(folder).read_bytes())["repository"])
    except FileNotFoundError:
        return  # made before owners were written: nothing names another
    except (OSError, ValueError, TypeError, KeyError):
        owner = None  # damaged: taken over below only if no repository can be told from it
    if owner is not None and owner != Path(os.path.realpath(repo.root)) and (owner / REPO_DIR).is_dir():
        raise _refusal(folder, owner)
    if owner != Path(os.path.realpath(repo.root)):  # moved here, or its maker's init failed: ours now
        claim(repo)


def marker(folder: Path) -> Path:
    """Where the owner of the store in `folder` is named: beside it."""
    return folder.with_name(folder.name + SUFFIX)


def _refusal(folder: Path, owner: Path) -> CkptError:
    return CkptError(f"the object store {folder} belongs to the repository at {owner}, not this one: a gc here would "
                     "delete the objects that one needs, so nothing was deleted. A copy of a repository needs "
                     "objects of its own (`ckpt clone` makes one); point objects_url at this repository's own")


def _local_store(repo: Repository) -> Path | None:
    """The resolved folder of the repository's local object store, where its metadata is SQLite."""
    root = getattr(held_here(repo.store), "root", None)
    if root is None or repo.config.metadata_url.startswith(POSTGRES):
        return None
    return Path(os.path.realpath(root))
