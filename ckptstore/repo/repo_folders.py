"""Other repositories' folders and object stores, known so no commit takes them and no checkout writes over them.

A repository's folder is known by its config and its database or its own names beside it; a local
object store by its owner file or its layout. What may not be read counts as another's: never written over.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import tomllib

from ckptstore.errors import CkptError
from ckptstore.formats.folder import is_temp_name
from ckptstore.repo import journal
from ckptstore.repo.location import DATABASE, REPO_DIR
from ckptstore.repo.owner import SUFFIX as OWNER_SUFFIX

_STORE_FAN = re.compile(r"^[0-9a-f]{2}$")  # a local object store's folders (objects/ab/ab12...)
_OBJECT_NAME = re.compile(r"^[0-9a-f]{62}$")  # an object id past its folder's two digits
_SQLITE = b"SQLite format 3\x00"
# what a joined shared repository's own folder may hold beside its config (its database and objects are elsewhere)
# all a repository keeps in its own folder, besides the temporary files of atomic writes and a store
# configured inside it: config, locks, the watch's records, the daemon's files (daemon.py), the cost model
# (chaincost.FILE), checkout journals (journal.FOLDER), fetched files' commits (worktree.FETCHED), a pull in progress
# (remote.PULLING), SQLite's database and its -wal/-shm; tests/repo/test_repo_folders.py keeps it complete
REPOSITORY_FOLDER_NAMES = frozenset({
    "config.toml", "config.toml.lock", "lock", "lock.gate", "tmp", "watch", "daemon.log", "daemon.lock",
    "daemon.json", "chaincost.json", journal.FOLDER, "fetched", "pulling.json", "ckpt.db", "ckpt.db-wal",
    "ckpt.db-shm", "ckpt.db-journal"})


def is_repository_folder(path: Path) -> bool:
    """Whether `path` is a repository's own folder: `.ckpt/` with a config, or a folder whose config.toml is ours.

    Ours: only ckptstore's sections and core keys, and either a SQLite `ckpt.db` beside it (a `.ckpt`
    linked in from `disk/meta`, an older config without every key too) or a configured metadata URL
    in a folder holding only a repository's own names (a joined shared repository's). A run folder's
    copy of a repository's config, or a user's own `[core]`, is none. What is there but may not be
    read (another user's config or database) counts as a repository's: never written over.
    """
    from ckptstore.repo.config import CORE_KEYS, SECTIONS

    try:
        if not (path / "config.toml").is_file():
            return False
        if path.name == REPO_DIR:
            return True
        data = tomllib.loads((path / "config.toml").read_text())
    except PermissionError:  # another user's config (it may hold a password)
        return _database_beside(path) or _holds_only_repository_names(path, {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):  # a folder it may not look into is no repository
        return False
    core = data.get("core", {})
    if not (set(data) <= set(SECTIONS) and isinstance(core, dict) and set(core) <= set(CORE_KEYS)):
        return False
    if core.get("metadata_url"):  # a joined shared repository's folder: its config and its own files alone
        return _holds_only_repository_names(path, core)
    return _database_beside(path)


def _database_beside(path: Path) -> bool:
    """Whether a SQLite `ckpt.db` is beside `path`'s config.

    One there that cannot be read (another user's, a link to a disk not mounted) counts; a readable
    file of other bytes does not.
    """
    database = path / DATABASE
    try:
        with open(database, "rb") as handle:
            return handle.read(len(_SQLITE)) == _SQLITE
    except OSError:
        return os.path.lexists(database)


def _holds_only_repository_names(path: Path, core: dict[str, Any]) -> bool:
    """Whether every name in `path` is one a repository keeps there (its objects too, where they are inside it)."""
    names = set(REPOSITORY_FOLDER_NAMES)
    objects = core.get("objects_url") or "objects"  # relative to the folder, as Repository opens it
    if isinstance(objects, str) and "://" not in objects and not os.path.isabs(objects):
        store = PurePosixPath(objects).parts[0] if PurePosixPath(objects).parts else ""
        names |= {store, store + OWNER_SUFFIX}
    try:
        with os.scandir(path) as entries:
            return all(entry.name in names or is_temp_name(entry.name) for entry in entries)
    except OSError:  # its config is ours, its listing not to be read: as a repository's, never written over
        return True


def is_object_store(path: Path) -> bool:
    """Whether `path` is a local object store: `<store>.owner` beside it (repo/owner.py), or its layout.

    The layout, for a store made before owner files: two-hex-digit folders (and its own `tmp/` where it
    lies on another disk than its repository), objects in them named by the other 62 hex digits of
    their ids, the first fan holding any deciding (a user's numbered `00/ 01/` hold other names, or none).
    """
    try:
        if not path.name or not path.is_dir():
            return False
        if path.with_name(path.name + OWNER_SUFFIX).is_file():
            return True
        fans = []
        with os.scandir(path) as entries:  # stops at the first other name: /scratch may hold 100,000
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False) or not (_STORE_FAN.match(entry.name)
                                                                   or entry.name == "tmp"):
                    return False
                fans += [entry.name] if entry.name != "tmp" else []
        for fan in fans:
            with os.scandir(path / fan) as entries:
                names = [entry.name for entry in entries]
            if names:
                return all(_OBJECT_NAME.match(name) for name in names)
    except OSError:
        return False
    return False  # every fan empty: no objects to keep (a user's emptied numbered folders are none either)


def repository_part_holding(path: Path, below: Path | None = None) -> Path | None:
    """Another repository's folder or object store that `path` is or lies in, by the path given or the real one.

    With `below`, only the folders under it are looked at (the caller checked `below` itself), each
    spelling of the path against the same spelling of `below`. The caller has refused this
    repository's own first (`own_folder_holding`).
    """
    spellings = [(os.path.abspath, Path(os.path.abspath(path))), (os.path.realpath, Path(os.path.realpath(path)))]
    for spell, given in spellings:
        limit = Path(spell(below)) if below is not None else None
        for folder in [given, *given.parents]:
            if limit is not None and (folder == limit or not folder.is_relative_to(limit)):
                break
            if is_repository_folder(folder) or is_object_store(folder):
                return folder
    return None


def nested_repositories(folder: Path, skipped: Iterable[Path]) -> list[Path]:
    """What other repositories inside `folder` keep there: their own folders, object stores and owner files.

    Never walks into `skipped` (this repository's own). None of it is a checkpoint's content:
    committed, a checkout of an older commit wrote it back over theirs; left out of the commit, an
    exact checkout deleted it.
    """
    skip = {os.path.realpath(p) for p in skipped}
    found: list[Path] = []
    for top, folders, _ in os.walk(folder):
        for name in list(folders):
            inner = Path(top, name)
            if os.path.realpath(inner) in skip:
                folders.remove(name)
            elif is_repository_folder(inner):  # a link to one (moved to another disk) too
                folders.remove(name)
                found += [inner, *_local_store_of(inner)]
            elif is_object_store(inner):  # a store whose repository lives elsewhere
                folders.remove(name)
                found += _with_owner(inner)
    return found


def _local_store_of(repository_folder: Path) -> list[Path]:
    """The local object store another repository's config names, and its owner file ([] for its default)."""
    from urllib.parse import unquote, urlparse

    from ckptstore.repo.config import RepoConfig

    try:
        url = RepoConfig.load(repository_folder / "config.toml").objects_url
    except CkptError:  # damaged or unreadable: its own folder is still left alone
        return []
    if url.startswith("file://"):
        store = Path(unquote(urlparse(url).path))
    elif url and "://" not in url:
        store = repository_folder / url
    else:
        return []
    return _with_owner(store)


def _with_owner(store: Path) -> list[Path]:
    """A store and its owner file, where there is one."""
    owner = store.with_name(store.name + OWNER_SUFFIX)
    return [store, owner] if owner.is_file() else [store]
