"""Tensor records received from another repository and not yet checked here: `.ckpt/received`.

A record says "tensor ID is these chunks", and fetch, pull, clone and a push into this repository
copy records as they are (each object is verified against its id, but a record's claim only by
decoding it). A commit here whose tensor has that id would reuse the record without a look, so a
crafted remote could make a later commit of your own bytes restore its bytes. So before a commit
reuses a listed record, it decodes it and hashes the result against its id, once: a record that
holds is reused and taken off the list, one that does not is encoded again from the commit's
bytes (taking the id's row). A lossy record's `source` (the content it was made from) cannot be
checked by decoding: a lossy record stays listed, and a commit never reuses a listed one for it. A local file, like
`fetched`: a shared database cannot tell which machine received what.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable, Iterator, Mapping, Set
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError
from ckptstore.formats.atomic import atomic_write
from ckptstore.hashing import TensorId
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

RECEIVED = "received"


@contextlib.contextmanager
def _locked(repo_dir: Path) -> Iterator[None]:
    """The list's own lock: a fetch appending while a commit rewrites it must not lose its ids."""
    with open(repo_dir / f"{RECEIVED}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def remember(repo_dir: Path, ids: Iterable[str]) -> None:
    """Add `ids` (tensor records just received from another repository) to the list."""
    listed = "".join(f"{tid}\n" for tid in ids)
    if not listed:
        return
    with _locked(repo_dir), open(repo_dir / RECEIVED, "a") as handle:
        handle.write(listed)
        handle.flush()
        os.fsync(handle.fileno())


def unchecked(repo_dir: Path, ids: Set[TensorId]) -> set[TensorId]:
    """Those of `ids` that were received and not yet checked here."""
    try:
        return ids & set((repo_dir / RECEIVED).read_text().split())
    except (FileNotFoundError, NotADirectoryError):
        return set()


def checked(repo_dir: Path, ids: Set[TensorId]) -> None:
    """Take `ids` (checked, or encoded here) off the list."""
    if not ids or not (repo_dir / RECEIVED).exists():
        return
    with _locked(repo_dir):
        kept = [tid for tid in (repo_dir / RECEIVED).read_text().split() if tid not in ids]
        atomic_write(repo_dir / RECEIVED, lambda handle: handle.write("".join(f"{t}\n" for t in kept).encode()))


def off_the_list(records: Mapping[TensorId, TensorRecord], true: Set[TensorId]) -> set[TensorId]:
    """Of the records found `true`, those that may leave the list: not lossy ones, whose `source` stays unchecked."""
    return {tid for tid in true if "source" not in records[tid].params}


def false_claims(repo: Repository, records: Mapping[TensorId, TensorRecord], ids: Set[TensorId]) -> set[TensorId]:
    """Those of `ids` (received, recorded: `records` holds them with their chains) that do not decode to their id.

    Decoded one at a time, so a commit's memory grows by its largest tensor, not by all of them; a
    record that cannot be decoded at all (an object gone) is as good as false: it is encoded again.
    """
    false = set()
    source = ChainSource(repo.store, records)
    for tid in sorted(ids):
        try:
            replay(source, [records[tid]], repo.pool, by_id=True)
        except (CkptError, KeyError, ValueError):
            false.add(tid)
    return false
