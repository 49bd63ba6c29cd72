"""Named queries on known files: digests of checkpoint files whose content a commit holds."""

from __future__ import annotations

from collections.abc import Iterable

from ckptstore.hashing import CommitId
from ckptstore.metadata.db import Tx


def known_digests(tx: Tx, digests: Iterable[str]) -> set[str]:
    """The `digests` some commit holds the content of."""
    return {row[0] for row in tx.rows_in("SELECT digest FROM known_files WHERE digest IN ({ids})", digests)}


def commits_of_digest(tx: Tx, digest: str) -> list[CommitId]:
    """The commits whose checkpoint had a file with this content, sorted."""
    return [CommitId(c) for c in tx.column("SELECT commit_id FROM known_files WHERE digest = ? ORDER BY commit_id",
                                           (digest,))]


def remember(tx: Tx, rows: Iterable[tuple[str, CommitId, int]]) -> None:
    """Record (digest, commit, size) of files whose content `commit` holds (each pair once)."""
    tx.insert_ignore("known_files", ("digest", "commit_id", "size"), rows)


def known_sizes(tx: Tx) -> set[int]:
    """The sizes of all known files: a file of any other size cannot be one (no need to hash it)."""
    return {int(s) for s in tx.column("SELECT DISTINCT size FROM known_files")}
