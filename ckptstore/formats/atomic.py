"""Atomic file replacement: write beside the target under a name of its own, fsync, rename over it.

Every writer gets a fresh temporary name, so concurrent writers of one path never share a
half-written file: the path always holds one writer's complete bytes (the last rename wins).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ckptstore.errors import CheckpointFormatError, naming_file

TEMP_SUFFIX = ".ckpt-tmp"


def temp_beside(path: str | os.PathLike, tag: str = "") -> tuple[Path, BinaryIO]:
    """A new file beside `path` that no other writer can be using, opened for writing.

    Created with O_EXCL and mode 0o666 so the umask applies as to any new file.
    """
    path = Path(path)
    while True:
        # cut to 100 bytes (not characters: "é" takes two) so that a long name, and a temporary name made
        # from this one, still fit NAME_MAX's 255 bytes
        short = os.fsdecode(os.fsencode(path.name)[:100])
        temp = path.with_name(f".{short}.{tag}{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:  # 64 random bits: practically never, but never share a file
            continue
        return temp, os.fdopen(fd, "wb")


def atomic_write(path: str | os.PathLike, fill: Callable[[BinaryIO], None], mode: int | None = None) -> None:
    """Call `fill(handle)` on a temporary file, then atomically move it to `path`.

    A crash or error leaves `path` as it was, never half-written; `mode` sets its permission bits, which are
    otherwise those of the file it replaces (an owner-only weights file stays owner-only), or the umask's.
    """
    path = Path(path)
    kept = None if mode is not None else _mode_of(path)
    temp, handle = temp_beside(path)
    try:
        with naming_file(temp), handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        elif kept is not None:
            with contextlib.suppress(OSError):  # a file system that keeps no modes: the new file has its own
                os.chmod(temp, kept)
        os.replace(temp, path)
        sync_dir(path.parent)
    finally:
        temp.unlink(missing_ok=True)


def _mode_of(path: Path) -> int | None:
    """The read, write and execute bits of the file at `path` (never setuid, setgid or sticky), None if none is."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode) & 0o777
    except OSError:
        return None


def missing_parent(dest: Path) -> str | None:
    """Why `dest` cannot be written into its folder: that folder missing, or a file standing on its path; else None."""
    if dest.parent.is_dir():
        return None
    return _why_missing(dest)


def missing_folder(dest: Path) -> str | None:
    """Why a folder output at `dest` cannot be made or written into (see missing_parent), a dangling link there too."""
    if dest.is_symlink() and not dest.exists():
        return _dangling(dest)
    return missing_parent(dest)


def _dangling(link: Path) -> str:
    return f"{link} is a symlink to {os.readlink(link)}, which does not exist; create it first or pass another -o path"


def _why_missing(dest: Path) -> str:
    standing = next((p for p in dest.parents if p.exists() or p.is_symlink()), None)
    if standing is not None and standing.is_symlink() and not standing.exists():
        return _dangling(standing)
    if standing is not None and not standing.is_dir():
        return f"{standing} is a file, not a folder; pass another -o path"
    return f"directory {dest.parent} does not exist; create it first or pass another -o path"


def sync_dir(folder: str | os.PathLike) -> None:
    """Fsync a directory so that a rename in it survives a crash (where the platform allows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_parts(path: str | os.PathLike, parts) -> None:
    """Atomically write the concatenation of byte buffers."""

    def fill(handle: BinaryIO) -> None:
        for part in parts:
            handle.write(part)

    atomic_write(path, fill)


def file_stamp(path: str | os.PathLike) -> tuple[int, ...] | None:
    """What changes when a file is rewritten in place or replaced (inode, size, times); None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def changed_while_read(path: str | os.PathLike, committing: bool = True) -> CheckpointFormatError:
    """The refusal of a file that changed while a commit (or another command) read it.

    What was read may be half old, half new.
    """
    if not committing:
        return CheckpointFormatError(f"{path} changed while it was being read (is a save still writing it?); run "
                                     "the command again once the save has finished")
    return CheckpointFormatError(f"{path} changed while it was being committed (is a save still writing it?); "
                                 "nothing was recorded: commit it again once the save has finished")
