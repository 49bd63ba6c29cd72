"""Named queries on refs: branches, tags and HEAD (a branch name, or a commit when detached)."""

from __future__ import annotations

from typing import NamedTuple

from ckptstore.errors import CorruptRecordError, is_utf8
from ckptstore.hashing import CommitId
from ckptstore.metadata.db import Tx

HEAD = "HEAD"
BRANCH, TAG, HEAD_KIND = "branch", "tag", "head"
REMOTE = "remote"  # a remote-tracking ref, named remotes/REMOTE/BRANCH


class RefRow(NamedTuple):
    """One ref: a branch or tag points at a commit; HEAD at a branch (`target`) or a commit."""

    name: str
    kind: str
    commit_id: CommitId | None
    target: str | None


def ref_row(tx: Tx, name: str) -> RefRow | None:
    """The ref called `name`, or None: also for a name holding bytes that are not UTF-8, as every stored one is text.

    Sent to the database, such a name failed as a file's would ("rename the file"), not as an unknown ref.
    """
    if not name.isascii() and not is_utf8(name):
        return None
    row = tx.first("SELECT name, kind, commit_id, target FROM refs WHERE name = ?", (name,))
    return RefRow(*row) if row else None


def refs_of_kind(tx: Tx, kind: str, pointing_nowhere: list[str] | None = None) -> dict[str, CommitId]:
    """Branches or tags by name, sorted by code point (here, not by the server: its collation may be a language's).

    A row naming no commit is damage (fsck lists it), not a commit None: CorruptRecordError, or, where
    `pointing_nowhere` is given, its name goes there and the rest are returned (log's labels).
    """
    found: dict[str, CommitId] = {}
    for name, cid in sorted(tx.rows("SELECT name, commit_id FROM refs WHERE kind = ?", (kind,))):
        if cid:
            found[name] = CommitId(cid)
        elif pointing_nowhere is None:
            raise nowhere(name)
        else:
            pointing_nowhere.append(name)
    return found


def nowhere(name: str) -> CorruptRecordError:
    """The damage of ref `name`, whose row names no commit."""
    return CorruptRecordError(f"ref {name}", "it points at no commit",
                              outcome="Nothing was read from it; restore the metadata from a backup")


def names(tx: Tx, kinds: tuple[str, ...] = (BRANCH, TAG)) -> list[str]:
    """Every ref name of the given kinds (for "did you mean" hints)."""
    return tx.column(f"SELECT name FROM refs WHERE kind IN ({', '.join('?' * len(kinds))})", kinds)


def tip_commits(tx: Tx, but: str = "") -> list[CommitId]:
    """Every commit a ref (but the one named `but`) points at directly: branches, tags, a detached HEAD."""
    return [CommitId(c) for c in tx.column("SELECT commit_id FROM refs WHERE commit_id IS NOT NULL AND name <> ?",
                                           (but,))]


def insert_ref(tx: Tx, name: str, kind: str, commit_id: CommitId | None = None, target: str | None = None) -> None:
    tx.execute("INSERT INTO refs (name, kind, commit_id, target) VALUES (?, ?, ?, ?)", (name, kind, commit_id, target))


def delete_ref(tx: Tx, name: str) -> None:
    tx.execute("DELETE FROM refs WHERE name = ?", (name,))


def point_head(tx: Tx, branch: str | None, commit_id: CommitId | None) -> None:
    """HEAD onto `branch`, or detached at `commit_id`."""
    tx.execute("UPDATE refs SET target = ?, commit_id = ? WHERE name = ?", (branch, commit_id, HEAD))


def set_commit(tx: Tx, name: str, commit_id: CommitId) -> None:
    """Point ref `name` at `commit_id` unconditionally (remote-tracking refs mirror the remote)."""
    tx.execute("UPDATE refs SET commit_id = ? WHERE name = ?", (commit_id, name))


def swap(tx: Tx, name: str, kind: str, expected: CommitId, new: CommitId) -> bool:
    """Compare-and-swap: move ref `name` to `new` only if it still points at `expected`."""
    cursor = tx.execute("UPDATE refs SET commit_id = ? WHERE name = ? AND kind = ? AND commit_id = ?",
                        (new, name, kind, expected))
    return cursor.rowcount == 1
