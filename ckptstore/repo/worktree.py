"""The work tree: checkpoint files on disk that commits came from and checkouts write to.

A file's content is known when some commit holds it (its blake3 digest is recorded), so a
checkout can refuse to overwrite a file whose content would be lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import DirtyWorktreeError
from ckptstore.hashing import CommitId, file_digest
from ckptstore.metadata import files as file_rows

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


def refuse_unsaved(repo: Repository, targets: list[Path]) -> None:
    """Raise DirtyWorktreeError when any existing file in `targets` holds content no commit has."""
    digests = {t: file_digest(str(t)) for t in targets if t.is_file()}
    with repo.db.read() as tx:
        known = file_rows.known_digests(tx, digests.values())
    unsaved = [str(t) for t, d in digests.items() if d not in known]
    if unsaved:
        raise DirtyWorktreeError(
            f"checkout would overwrite {', '.join(unsaved)}, whose content is not in the store; "
            "commit it first, write elsewhere with -o PATH, or pass --force"
        )


def remember_files(repo: Repository, cid: CommitId, paths: list[Path]) -> None:
    """Record that the files at `paths` hold content of commit `cid`."""
    rows = [(file_digest(str(p)), cid, p.stat().st_size) for p in paths]
    with repo.db.write() as tx:
        file_rows.remember(tx, rows)


def status(repo: Repository) -> dict[str, Any]:
    """HEAD, and whether the files HEAD was committed from still hold its content."""
    from ckptstore import formats

    branch, head = repo.head()
    report: dict[str, Any] = {"branch": branch, "head": head, "files": []}
    if head is None:
        return report
    info = repo.commit_info(head)
    if info.source_path is None:
        return report
    manifest = repo.read_manifest(info.manifest_object)
    base = repo.root / info.source_path
    for record in manifest.files:
        path = formats.destination(manifest.kind, record, base)
        shown = str(path.relative_to(repo.root)) if path.is_relative_to(repo.root) else str(path)
        report["files"].append({"path": shown, "state": _file_state(repo, path, manifest.digests.get(record.name),
                                                                    head)})
    return report


def _file_state(repo: Repository, path: Path, committed: str | None, head: CommitId) -> str:
    if not path.is_file():
        return "missing"
    digest = file_digest(str(path))
    if digest == committed:
        return "unchanged"
    with repo.db.read() as tx:
        known = file_rows.commits_of_digest(tx, digest)
    if head in known:
        return "unchanged"
    return f"modified (content of {known[0][:12]})" if known else "modified"
