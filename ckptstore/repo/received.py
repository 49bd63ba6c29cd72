"""Tensor records received from another repository and not yet checked here: `.ckpt/received`.

A record says "tensor ID is these chunks", and fetch, pull and clone copy records as they are (the
objects are verified against their ids, but a record's claim is only checked by decoding it). A
commit here whose tensor has that id would reuse the record without a look, so a crafted remote
could make a later commit of your own bytes restore its bytes. A commit therefore encodes such a
tensor itself once (it has the bytes, so its record is right by construction), takes the id's row,
and drops the id from the list. A local file, like `fetched`: a shared database cannot tell which
machine received what.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Set
from pathlib import Path

from ckptstore.formats.atomic import atomic_write
from ckptstore.hashing import TensorId

RECEIVED = "received"


def remember(repo_dir: Path, ids: Iterable[str]) -> None:
    """Add `ids` (tensor records just received from another repository) to the list."""
    listed = "".join(f"{tid}\n" for tid in ids)
    if not listed:
        return
    with open(repo_dir / RECEIVED, "a") as handle:
        handle.write(listed)
        handle.flush()
        os.fsync(handle.fileno())


def unchecked(repo_dir: Path, ids: Set[TensorId]) -> set[TensorId]:
    """Those of `ids` that were received and not yet encoded here."""
    try:
        return ids & set((repo_dir / RECEIVED).read_text().split())
    except (FileNotFoundError, NotADirectoryError):
        return set()


def checked(repo_dir: Path, ids: Set[TensorId]) -> None:
    """Take `ids` (now encoded here) off the list."""
    if not ids:
        return
    try:
        kept = [tid for tid in (repo_dir / RECEIVED).read_text().split() if tid not in ids]
    except (FileNotFoundError, NotADirectoryError):
        return
    atomic_write(repo_dir / RECEIVED, lambda handle: handle.write("".join(f"{tid}\n" for tid in kept).encode()))
