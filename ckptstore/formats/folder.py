"""Which files a checkpoint folder holds: the walk that commits use, and its policy for links.

A symlink whose target stays inside the folder is followed: a link to a file is stored as that
file's content, a link to a folder as the files under it (checkout writes plain files and folders).
A link leading out of the folder, a dangling link, a link loop, and a FIFO, socket or device are
refused with a CheckpointFormatError naming the path: none of them can be stored faithfully, and
skipping them would make a commit that silently lacks part of the checkpoint. Folders holding no
file are listed too (a trainer's `runs/`, an `optimizer/` placeholder): a checkout makes them again.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ckptstore.errors import CheckpointFormatError
from ckptstore.formats.atomic import TEMP_SUFFIX
from ckptstore.formats.mounts import keeps_modes
from ckptstore.paths import symlink_loops
from ckptstore.warn import warn_caller

# the temporary files of formats.atomic: a writer's leftovers after a crash, never checkpoint content
_TEMP_NAME = re.compile(r"^\..+\.[0-9a-z-]*[0-9a-f]{16}" + re.escape(TEMP_SUFFIX) + "$")
MODE_BITS = 0o777  # what is recorded and restored: read, write, execute for user, group and others
_NO_MODES = {errno.ENOSYS, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP}  # FAT, some FUSE and CIFS mounts


def file_mode(path: str | os.PathLike, info: os.stat_result) -> int | None:
    """The permission bits to record for a file (`info`: its stat), None on a file system that keeps none."""
    return stat.S_IMODE(info.st_mode) & MODE_BITS if keeps_modes(path, info.st_dev) else None


def set_mode(path: str | os.PathLike, mode: int) -> None:
    """Give a restored file its committed permission bits (never setuid, setgid or sticky: commits record none).

    A file system that keeps no modes (chmod refused) is warned of and the file kept as written.
    """
    try:
        os.chmod(path, mode & MODE_BITS)
    except OSError as exc:
        if exc.errno not in _NO_MODES:
            raise
        warn_caller("this file system keeps no file modes (chmod refused): files were written with its own")


@dataclass(frozen=True)
class FolderFile:
    """A file of a checkpoint folder: its name inside it, where it is, its permission bits."""

    name: str
    path: Path
    mode: int | None  # None: its file system keeps none (FAT, exFAT)


def is_git_name(name: str) -> bool:
    """True for `.git` (a folder, or a worktree's pointer file) in any case: git runs what its config and hooks say."""
    return name.lower() == ".git"


LEADS_OUT = "it leads outside the folder"


def unwritable_name(name: str) -> str | None:
    """Why no checkout writes a folder commit's file or folder `name`, or None; fsck names a commit holding one.

    A manifest received from elsewhere could name a place outside the folder (LEADS_OUT: absolute, `..`, a
    NUL) or git's own files, whose config and hooks run commands.
    """
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts or "\0" in name:
        return LEADS_OUT
    if any(is_git_name(part) for part in parts):
        return "it is one of git's own files, whose config and hooks run commands"
    return None


def is_temp_name(name: str) -> bool:
    """True for the name of an atomic writer's temporary file."""
    return _TEMP_NAME.match(name) is not None


MAX_LINKED_FOLDERS = 1_000


@dataclass
class FolderListing:
    """What a checkpoint folder holds: its files, and its folders that hold no file (names inside it, sorted)."""

    files: list[FolderFile] = field(default_factory=list)
    # only the innermost: `a/b` stands for `a` too; one holding nothing but what commits leave out (.git) counts
    empty_folders: list[str] = field(default_factory=list)
    git_left_out: list[Path] = field(default_factory=list)  # the `.git` folders and files met (paths as walked)


def folder_files(root: str | os.PathLike, exclude: Iterable[str | os.PathLike] = ()) -> list[FolderFile]:
    """The files under `root`, sorted by name, links followed per the module's policy (see `folder_listing`)."""
    return folder_listing(root, exclude).files


def folder_listing(root: str | os.PathLike, exclude: Iterable[str | os.PathLike] = (),
                   quiet: bool = False) -> FolderListing:
    """The files under `root` and its folders that hold none, sorted by name, links followed per the module's policy.

    Folders in `exclude` (a repository's own `.ckpt/`) are left out, and a link into one is refused. Git's
    files are left out with a warning (`quiet`: without, for a listing that commits nothing).
    """
    root = Path(root)
    real_root = Path(os.path.realpath(root))
    skipped = {Path(os.path.realpath(p)) for p in exclude}
    found = FolderListing()
    _walk(root, "", real_root, [real_root], real_root, skipped, found, [0])
    for path in [] if quiet else found.git_left_out:
        warn_caller(f"left {path} out of the commit: git's own files are no checkpoint, and a checkout never "
                    "writes them (their config and hooks run commands)")
    return FolderListing(sorted(found.files, key=lambda f: f.name), sorted(found.empty_folders), found.git_left_out)


def _walk(folder: Path, prefix: str, real: Path, stack: list[Path], real_root: Path, skipped: set[Path],
          found: FolderListing, linked: list[int]) -> bool:
    """Add the files under `folder` (whose resolved path is `real`; `stack`: resolved folders walked into).

    `linked` holds how many folders the walk has entered through a link so far. True where something under
    `folder` was left out as excluded: a folder holding only a repository is no empty folder of the commit.
    """
    excluded_here = False
    if folder.is_symlink():
        linked[0] += 1
        if linked[0] > MAX_LINKED_FOLDERS:  # links fanning out (a/{x,y} -> b ...) list 2**n paths
            raise CheckpointFormatError(f"links inside {real_root} lead into folders more than {MAX_LINKED_FOLDERS} "
                                        "times over (links to links fanning out?): remove them, or copy what they "
                                        "point at")
    with os.scandir(folder) as entries:
        listed = sorted(entries, key=lambda e: e.name)
    for entry in listed:
        path, name = Path(entry.path), prefix + entry.name
        if is_git_name(entry.name):
            found.git_left_out.append(path)
            continue
        if entry.is_symlink():
            if Path(os.path.realpath(path)) in skipped:
                excluded_here = True
                continue  # the repository's own folder linked in (a .ckpt moved to another disk) is no content
            target = _link_target(path, real_root, skipped)
            info = os.stat(target)
        else:
            target, info = real / entry.name, entry.stat(follow_symlinks=False)
            if target in skipped:
                excluded_here = True
                continue
        if stat.S_ISDIR(info.st_mode):
            if target in stack:
                raise CheckpointFormatError(f"{path} is a symlink to {target}, a folder that holds the link: "
                                            "following it would never end; remove the link")
            before = len(found.files) + len(found.empty_folders)
            held_excluded = _walk(path, name + "/", target, [*stack, target], real_root, skipped, found, linked)
            excluded_here |= held_excluded
            if len(found.files) + len(found.empty_folders) == before and not held_excluded:  # kept as a folder
                found.empty_folders.append(name)
        elif stat.S_ISREG(info.st_mode):
            if not is_temp_name(entry.name):
                found.files.append(FolderFile(name, path, file_mode(target, info)))
        else:
            raise CheckpointFormatError(f"{path} is a {_kind(info.st_mode)}, not a regular file: a checkpoint "
                                        "folder holds files and folders only; move it out of the folder")
    return excluded_here


def _link_target(path: Path, real_root: Path, skipped: set[Path]) -> Path:
    """Where the symlink at `path` leads, when that is an existing place inside the folder."""
    target = Path(os.path.realpath(path))
    if not target.exists():
        if symlink_loops(path):  # realpath stops at a loop, which was said as a missing file
            raise CheckpointFormatError(f"{path} is a symlink that leads back to itself (a loop): remove or "
                                        "repoint it")
        raise CheckpointFormatError(f"{path} is a symlink to {os.readlink(path)}, which does not exist: "
                                    "remove the dangling link or point it at a file inside the folder")
    if not target.is_relative_to(real_root) or any(target.is_relative_to(s) for s in skipped):
        raise CheckpointFormatError(f"{path} is a symlink to {target}, outside the checkpoint folder {real_root}: "
                                    "ckptstore follows only links that stay inside; copy the file in instead")
    return target


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "special file"
