"""Ref names and resolution: branches, tags, HEAD, full or unique-prefix commit ids, `REF~N`."""

from __future__ import annotations

import difflib
import re

from sqlalchemy import Connection, select

from ckptstore.errors import AmbiguousRefError, InvalidRefNameError, RefNotFoundError
from ckptstore.hashing import CommitId
from ckptstore.metadata.schema import commit_parents, refs
from ckptstore.repo.catalog import driver_sql

HEAD = "HEAD"
BRANCH, TAG, HEAD_KIND = "branch", "tag", "head"
_NAME = re.compile(r"^[A-Za-z0-9._/-]+$")
_ANCESTRY = re.compile(r"^(.*?)((?:[~^]\d*)+)$")
MIN_PREFIX = 4


def check_name(name: str) -> None:
    """Reject names git would reject, and names that read as something else."""
    if (not _NAME.match(name) or name == HEAD or name.startswith(("-", "/", ".")) or name.endswith(("/", ".lock"))
            or ".." in name or "//" in name):
        raise InvalidRefNameError(
            f"{name!r} is not a valid branch or tag name (letters, digits, . _ / -; not HEAD)"
        )


def ref_row(conn: Connection, name: str):
    """The row (name, kind, commit_id, target) of ref `name`, or None; read on every checkout."""
    return driver_sql(conn, "SELECT name, kind, commit_id, target FROM refs WHERE name = ?", (name,)).first()


def first_parent(conn: Connection, cid: CommitId) -> CommitId | None:
    row = conn.execute(
        select(commit_parents.c.parent_id).where(commit_parents.c.commit_id == cid, commit_parents.c.position == 0)
    ).first()
    return CommitId(row[0]) if row else None


def nth_parent(conn: Connection, cid: CommitId, n: int) -> CommitId | None:
    row = conn.execute(
        select(commit_parents.c.parent_id).where(commit_parents.c.commit_id == cid, commit_parents.c.position == n)
    ).first()
    return CommitId(row[0]) if row else None


def head_commit(conn: Connection) -> CommitId | None:
    """The commit HEAD points at (through its branch), or None on an unborn branch."""
    head = ref_row(conn, HEAD)
    if head is None:
        return None
    if head.commit_id:
        return CommitId(head.commit_id)
    branch = ref_row(conn, head.target)
    return CommitId(branch.commit_id) if branch else None


def head_branch(conn: Connection) -> str | None:
    """The branch HEAD is on, or None when HEAD is detached."""
    head = ref_row(conn, HEAD)
    return head.target if head is not None and not head.commit_id else None


def _base(conn: Connection, spec: str) -> CommitId:
    if spec == HEAD:
        cid = head_commit(conn)
        if cid is None:
            raise RefNotFoundError(spec, detail=" (no commits yet)")
        return cid
    row = ref_row(conn, spec)
    if row is not None and row.kind in (BRANCH, TAG):
        return CommitId(row.commit_id)
    if re.fullmatch(r"[0-9a-f]+", spec) and len(spec) >= MIN_PREFIX:
        matches = driver_sql(conn, "SELECT id FROM commits WHERE id LIKE ? LIMIT 10", (spec + "%",)).scalars().all()
        if len(matches) == 1:
            return CommitId(matches[0])
        if len(matches) > 1:
            raise AmbiguousRefError(f"commit prefix {spec!r} matches {len(matches)} commits; give more digits")
    names = conn.execute(select(refs.c.name).where(refs.c.kind.in_([BRANCH, TAG]))).scalars().all()
    raise RefNotFoundError(spec, difflib.get_close_matches(spec, [*names, HEAD], n=3, cutoff=0.5))


def resolve(conn: Connection, spec: str) -> CommitId:
    """The commit a ref expression names; `~N` follows first parents, `^N` picks the Nth parent."""
    spec = spec.strip()
    match = _ANCESTRY.match(spec)
    if not match or not match.group(1):
        return _base(conn, spec)
    cid = _base(conn, match.group(1))
    for op, count in re.findall(r"([~^])(\d*)", match.group(2)):
        n = int(count) if count else 1
        if op == "~":
            for _ in range(n):
                parent = first_parent(conn, cid)
                if parent is None:
                    raise RefNotFoundError(spec, detail=f" (history of {match.group(1)} is shorter)")
                cid = parent
        else:
            parent = nth_parent(conn, cid, n - 1) if n else cid
            if parent is None:
                raise RefNotFoundError(spec, detail=f" ({cid[:12]} has no parent {n})")
            cid = parent
    return cid
