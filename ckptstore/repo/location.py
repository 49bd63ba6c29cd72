"""Where a repository is (the `.ckpt` folder found from a path, CKPT_REPO or the cwd), and whether it is writable.

Its own module, importing nothing heavy, so the `ckpt` launcher can find the repository of a
command before deciding where to run it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptstore.errors import RepoNotFoundError

REPO_DIR = ".ckpt"
DATABASE = "ckpt.db"  # inside REPO_DIR, where no metadata URL is configured
SQLITE_PREFIX = "sqlite:///"  # metadata/sqlite.py's, not imported: the launcher imports this module, and nothing heavy


def named_root(folder: str | os.PathLike, named_by: str = "CKPT_REPO=") -> Path:
    """The repository folder a user named (CKPT_REPO, `ckpt --repo`): that folder itself, never one above it.

    A typo or a run not yet initialised must not send commits to whatever repository holds its parent.
    """
    candidate = Path(folder).resolve()
    if (candidate / REPO_DIR).is_dir():
        return candidate
    if candidate.exists() and not candidate.is_dir():
        raise RepoNotFoundError(f"{named_by}{folder} is a file; it must name a repository's folder")
    if candidate.name == REPO_DIR and (candidate / "config.toml").is_file():
        raise RepoNotFoundError(f"{named_by}{folder} is a repository's own {REPO_DIR}/ folder: name the folder that "
                                f"holds it ({candidate.parent})")
    raise RepoNotFoundError(f"{named_by}{folder} holds no ckptstore repository ({REPO_DIR}/); it names the "
                            f"repository's folder itself (`ckpt init {folder}` makes one there)")


def given_root(folder: str | os.PathLike | None, named_by: str = "repo=") -> Path:
    """The repository a Python caller named: a folder names its own (as CKPT_REPO, --repo); None, the one found."""
    return find_root() if folder is None else named_root(folder, named_by)


def find_root(start: str | os.PathLike | None = None) -> Path:
    """The folder holding `.ckpt`: CKPT_REPO if set, else walking up from `start` (or the cwd)."""
    if start is None and os.environ.get("CKPT_REPO"):
        return named_root(os.environ["CKPT_REPO"])
    here = Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / REPO_DIR).is_dir():
            return folder
    raise RepoNotFoundError(f"no ckptstore repository in {here} or any parent; run `ckpt init` first")


def unwritable(folder: Path, metadata_url: str = "") -> str:
    """Why this process cannot write the repository folder `folder` or its SQLite database, or "".

    The database is `folder`'s ckpt.db unless the config's `metadata_url` names a SQLite file
    elsewhere (relative to the repository's folder, as recorded): there SQLite writes beside its
    file (-wal, -shm), so that file's folder must be writable too. A server's is not checked here.
    """
    database = folder / DATABASE
    if metadata_url.startswith(SQLITE_PREFIX):
        database = folder.parent / metadata_url[len(SQLITE_PREFIX):]  # an absolute path replaces the base
    elif metadata_url:
        database = None
    beside = [] if database is None else [database.parent, *(Path(f"{database}{end}") for end in ("", "-wal", "-shm"))]
    for path in dict.fromkeys([folder, *beside]):
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path} is not writable{_owned_by(path)}"
    return ""


def _owned_by(path: Path) -> str:
    """", it belongs to USER" where that is another user: they (or an admin) can give the group write access."""
    try:
        return "" if path.stat().st_uid == os.geteuid() else f"; it belongs to {path.owner()}"
    except (KeyError, OSError):  # gone meanwhile, or a user id with no name here
        return ""
