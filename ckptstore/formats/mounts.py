"""Which file system holds a path, from Linux's mount table: some keep no file modes, or no inode numbers.

FAT and exFAT have no permission bits (every file shows 0777) and, with FUSE file systems, make
inode numbers up per mount. Elsewhere (no /proc, another system) every file system counts as one
that keeps both.
"""

from __future__ import annotations

import os
import re

_NO_MODES = {"vfat", "msdos", "exfat", "fuseblk"}  # fuseblk: NTFS through ntfs-3g, which shows 0777 by default
_MADE_UP_INODES = {"vfat", "msdos", "exfat", "fuse", "fuseblk"}  # and any "fuse.NAME"
_types: dict[int, str] = {}  # by device number: a mounted device's type never changes


def file_system(real_path: str, mountinfo: str) -> str:
    """The type of the file system mounted nearest above `real_path`, from /proc/self/mountinfo's text."""
    found, kind = "", ""
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), fields[4])  # "\040": a space
        inside = real_path == point or real_path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(found):  # the later of two mounts on one point is the one seen
            found, kind = point, fields[fields.index("-", 6) + 1]
    return kind


def file_system_of(path: str | os.PathLike, device: int | None = None) -> str:
    """The type of the file system holding `path` (on `device`, its st_dev, where known), or "" where unknown."""
    device = os.stat(path).st_dev if device is None else device
    if device not in _types:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
                _types[device] = file_system(os.path.realpath(path), table.read())
        except OSError:
            _types[device] = ""
    return _types[device]


def keeps_modes(path: str | os.PathLike, device: int | None = None) -> bool:
    """Whether the file system holding `path` keeps permission bits (FAT and exFAT show 0777 for every file)."""
    return file_system_of(path, device) not in _NO_MODES


def keeps_inodes(path: str | os.PathLike, device: int | None = None) -> bool:
    """Whether the file system holding `path` keeps its inode numbers across remounts (not FAT, exFAT, FUSE)."""
    kind = file_system_of(path, device)
    return kind not in _MADE_UP_INODES and not kind.startswith("fuse.")
