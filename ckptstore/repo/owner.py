"""Which repository owns a local object store: gc and prune delete only in their own.

An object store is named by its path alone. A copy of a repository whose objects live outside its
`.ckpt/` (`cp -a`), or a config edited to name another repository's objects folder, reached that
store too, and its gc deleted what the other repository needed. Beside each local store of a
repository with its own SQLite metadata, `<store>.owner` names the `.ckpt/` folder of the repository
that first wrote there: by device and inode, which a move keeps and a copy does not (beside, not
inside: the store's folder holds objects only). gc and prune refuse in a
store outside this `.ckpt/` that another one owns. A store inside `.ckpt/` is its own by place: a
copy of the folder copied it. A shared database (PostgreSQL) owns its store by the records it holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError
from ckptstore.objectstore.fallback import held_here

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

SUFFIX = ".owner"  # `.ckpt/objects.owner` for the default store


def claim(repo: Repository) -> None:
    """Write this repository as the owner of its local store, where no repository is named there yet.

    Called on every writable open, so stores made before owners were written get one too. A store
    this process may not write is left as it is.
    """
    folder = _local_store(repo)
    try:
        if folder is None or marker(folder).exists():
            return
        ckpt = os.stat(repo.dir)
        record = {"repository": os.path.realpath(repo.root), "device": ckpt.st_dev, "inode": ckpt.st_ino}
        temp = folder.with_name(f".{folder.name}{SUFFIX}.{os.getpid()}.tmp")  # not formats.atomic: numpy
        temp.write_bytes(json.dumps(record).encode())
        os.replace(temp, marker(folder))
    except OSError:
        pass


def refuse_anothers(repo: Repository) -> None:
    """Raise unless this repository may delete in its local store (gc, prune): it owns it, or it is inside .ckpt/."""
    folder = _local_store(repo)
    if folder is None or folder.is_relative_to(os.path.realpath(repo.dir)):
        return
    try:
        owner = json.loads(marker(folder).read_bytes())
        named = (owner["device"], owner["inode"])
    except FileNotFoundError:
        return claim(repo)
    except (OSError, ValueError, TypeError, KeyError):
        raise CkptError(f"{marker(folder)} cannot be read: it names the repository that owns the object store "
                        f"{folder}; nothing was deleted. Delete it if this repository is the one the store "
                        "belongs to (the next command writes it anew)") from None
    ckpt = os.stat(repo.dir)
    if named != (ckpt.st_dev, ckpt.st_ino):
        raise CkptError(f"the object store {folder} belongs to the repository at {owner.get('repository')}, not "
                        f"this one: a gc here would delete the objects that one needs, so nothing was deleted. A copy "
                        f"of a repository needs objects of its own (`ckpt clone` makes one); if this repository is "
                        f"that one moved to another disk or restored from a backup, delete {marker(folder)}")


def marker(folder: Path) -> Path:
    """Where the owner of the store in `folder` is named: beside it."""
    return folder.with_name(folder.name + SUFFIX)


def _local_store(repo: Repository) -> Path | None:
    """The resolved folder of the repository's local object store, if it has one and metadata of its own."""
    root = getattr(held_here(repo.store), "root", None)
    if root is None or repo.config.metadata_url:
        return None
    return Path(os.path.realpath(root))
