"""Where a repository is (the `.ckpt` folder found from a path, CKPT_REPO or the cwd), and whether it is writable.

Its own module, importing nothing heavy, so the `ckpt` launcher can find the repository of a
command before deciding where to run it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptstore.errors import RepoNotFoundError

REPO_DIR = ".ckpt"


def find_root(start: str | os.PathLike | None = None) -> Path:
    """The folder holding `.ckpt`: CKPT_REPO if set, else walking up from `start` (or the cwd)."""
    if start is None and os.environ.get("CKPT_REPO"):
        start = os.environ["CKPT_REPO"]
        candidate = Path(start).resolve()
        if (candidate / REPO_DIR).is_dir():
            return candidate
        raise RepoNotFoundError(f"CKPT_REPO={start} holds no ckptstore repository ({REPO_DIR}/)")
    here = Path(start or os.getcwd()).resolve()
    for folder in [here, *here.parents]:
        if (folder / REPO_DIR).is_dir():
            return folder
    raise RepoNotFoundError(f"no ckptstore repository in {here} or any parent; run `ckpt init` first")


def unwritable(folder: Path) -> str:
    """Why this process cannot write the repository folder `folder` (its database included), or ""."""
    for path in (folder, folder / "ckpt.db"):
        if path.exists() and not os.access(path, os.W_OK):
            return f"{path} is not writable"
    return ""
