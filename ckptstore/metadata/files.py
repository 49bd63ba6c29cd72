"""Named queries on known files: digests of checkpoint files whose content a commit holds."""

from __future__ import annotations

from collections.abc import Iterable

from ckptstore.hashing import CommitId
from ckptstore.metadata.db import Tx
from ckptstore.metadata.tensors import insert_ignore


def known_digests(tx: Tx, digests: Iterable[str]) -> set[str]:
    """The `digests` some commit holds the content of."""
    return {row[0] for row in tx.rows_in("SELECT digest FROM known_files WHERE digest IN ({ids})", digests)}


def commit_of_digest(tx: Tx, digest: str) -> CommitId | None:
    """A commit whose checkpoint had a file with this content, or None."""
    found = tx.scalar("SELECT commit_id FROM known_files WHERE digest = ?", (digest,))
    return CommitId(found) if found else None


def remember(tx: Tx, rows: Iterable[tuple[str, CommitId, int]]) -> None:
    """Record (digest, commit, size) of files whose content `commit` holds; known digests stay."""
    insert_ignore(tx, "known_files", ("digest", "commit_id", "size"), rows)
