"""Facts about a path given by the user that more than one layer asks (the CLI's arguments, a folder's links)."""

from __future__ import annotations

import errno
import os


def symlink_loops(path: str | os.PathLike) -> bool:
    """Whether following `path` runs into a symlink loop (ELOOP), not into a missing file: said as what it is."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False
