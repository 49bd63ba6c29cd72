"""Atomic file replacement: write beside the target, fsync, rename over it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike, fill: Callable[[BinaryIO], None]) -> None:
    """Call `fill(handle)` on a temporary file, then atomically move it to `path`.

    A crash or error leaves `path` as it was, never half-written.
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}.ckpt-tmp")
    try:
        with open(temp, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        if temp.exists():
            temp.unlink()


def write_parts(path: str | os.PathLike, parts) -> None:
    """Atomically write the concatenation of byte buffers."""

    def fill(handle: BinaryIO) -> None:
        for part in parts:
            handle.write(part)

    atomic_write(path, fill)
