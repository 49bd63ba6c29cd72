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


def without_credentials(url: str) -> str:
    """`url` as messages show it: a `SCHEME://USER:SECRET@host` form's credentials left out.

    A secret may hold "/" (AWS's often do): where the part before the first "/" holds ":" or "@", all up to the
    last "@" is hidden (a key's own "@" later in the path hides more, never less).
    """
    scheme, sep, rest = url.partition("://")
    first = rest.partition("/")[0]
    if not sep or not any(c in first for c in "@:") or "@" not in rest:
        return url
    return f"{scheme}://…@{rest.rpartition('@')[2]}"

