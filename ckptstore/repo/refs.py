"""Ref names and resolution (branches, tags, HEAD, commit ids or prefixes, `REF~N`, `REF^N`), and the ref verbs."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ckptstore.errors import (
    AmbiguousRefError,
    CkptError,
    CorruptRecordError,
    InvalidRefNameError,
    PrunedCommitError,
    RefExistsError,
    RefNotFoundError,
    shown_name,
)
from ckptstore.hashing import CommitId
from ckptstore.metadata import Tx, liveness
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import refs as ref_rows
from ckptstore.metadata.refs import BRANCH, HEAD, HEAD_KIND, REMOTE, TAG
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

Listed = TypeVar("Listed")

__all__ = ["BRANCH", "DEFAULT_BRANCH", "HEAD", "HEAD_KIND", "TAG", "branch", "check_name", "delete_branch",
           "delete_tag", "ensure_head", "head", "head_branch", "head_commit", "resolve", "tag"]

_NAME = re.compile(r"[A-Za-z0-9._/-]+")  # used with fullmatch: `$` would let a trailing newline through
_HEX = re.compile(r"[0-9a-f]+")
MIN_PREFIX = 4
DEFAULT_BRANCH = "main"  # where HEAD of a new repository points
MAX_NAME = 200  # the metadata keeps 255 characters: room for a remote-tracking ref, remotes/REMOTE/NAME


def ensure_head(repo: Repository) -> None:
    """HEAD on the unborn default branch, where new metadata has none yet (init, a remote made by push)."""
    with repo.db.write() as tx:
        head_made(tx)


def head_made(tx: Tx) -> bool:
    """Put HEAD on the unborn default branch where the metadata has none; True where it had none."""
    if ref_rows.ref_row(tx, HEAD) is not None:
        return False
    ref_rows.insert_ref(tx, HEAD, HEAD_KIND, target=DEFAULT_BRANCH)
    return True


def check_name(name: str) -> None:
    """Reject names git would reject, and names that read as something else (HEAD, a commit id prefix).

    Git's rules on each `/`-separated part are check_parts', for names made here only.
    """
    if _HEX.fullmatch(name.lower()) and len(name) >= MIN_PREFIX:
        raise InvalidRefNameError(f"{name!r} reads as a commit id (hex digits) and would hide the commit it "
                                  "abbreviates; choose a name with a letter beyond a-f")
    check_form(name)


def check_made_name(name: str, remotes: Iterable[str], tx: Tx) -> None:
    """check_new_name, check_range_safe and check_parts, for a name made here (a branch, a tag, commit --branch)."""
    check_range_safe(name)
    check_parts(name)
    check_new_name(name, remotes, tx)


def check_range_safe(name: str) -> None:
    """No name ending in '.': `v1...main` would read as v1 ... main, not `v1.` .. main (git refuses them too).

    Only names made here: those an older ckptstore allowed still travel (clone, push, pull), as
    refusing them there would strand their commits.
    """
    if name.endswith("."):
        raise InvalidRefNameError(f"{name!r} ends with '.', which a range (A..B) would swallow; choose another name")


def check_parts(name: str) -> None:
    """No `/`-separated part starting with '.' or ending with '.lock' (`a/.b`, `a/./b`, `a.lock/b`): git refuses them.

    Only names made here, as check_range_safe: those an older ckptstore allowed are still read, fsck'd
    and sent as before (check_form, which applies these rules to the whole name only).
    """
    for part in name.split("/"):
        if part.startswith(".") or part.endswith(".lock"):
            raise InvalidRefNameError(f"{name!r} has a part {part!r} that starts with '.' or ends with '.lock', which "
                                      "git refuses in any part of a name; choose another name")


def check_form(name: str, longest: int = MAX_NAME) -> None:
    """Reject names no ref may have here (check_name less the commit-id rule, which is about local names)."""
    if len(name) > longest:
        raise InvalidRefNameError(f"{name[:40]!r}... has {len(name)} characters; branch and tag names have at "
                                  f"most {MAX_NAME}")
    if (not _NAME.fullmatch(name) or name == HEAD or name.startswith(("-", "/", ".")) or name.endswith(("/", ".lock"))
            or ".." in name or "//" in name):
        raise InvalidRefNameError(
            f"{name!r} is not a valid branch or tag name (ASCII letters, digits, . _ / -; not HEAD)"
        )
    if name.startswith("remotes/"):
        raise InvalidRefNameError(f"{name!r} starts with 'remotes/', which holds remote-tracking refs "
                                  "(NAME/BRANCH); choose another name")


def check_new_name(name: str, remotes: Iterable[str], tx: Tx) -> None:
    """check_name, and no REMOTE/...: that is how remote-tracking refs read, and a local one would hide them.

    A remote is this machine's (`remotes`), or any whose tracking refs the metadata holds: on a shared
    repository another machine's fetch put them there.
    """
    check_name(name)
    remote = name.split("/", 1)[0]
    tracked = "/" in name and any(ref.startswith(f"remotes/{remote}/") for ref in ref_rows.names(tx, (REMOTE,)))
    if "/" in name and (remote in remotes or tracked):
        raise InvalidRefNameError(f"{name!r} would hide remote {remote!r}'s tracking ref of that name; choose "
                                  "another name")


def _head_row(tx: Tx) -> ref_rows.RefRow | None:
    """HEAD's row, or None where it has none; one naming no branch and no commit is damage, not an unborn branch."""
    head_row = ref_rows.ref_row(tx, HEAD)
    if head_row is not None and not head_row.commit_id and not head_row.target:
        raise CorruptRecordError("ref HEAD", "it names no branch and no commit",
                                 outcome="Check out a branch (`ckpt checkout BRANCH`) to set it again")
    return head_row


def head_commit(tx: Tx) -> CommitId | None:
    """The commit HEAD points at (through its branch), or None on an unborn branch."""
    head_row = _head_row(tx)
    if head_row is None:
        return None
    if head_row.commit_id:
        return CommitId(head_row.commit_id)
    branch_row = ref_rows.ref_row(tx, head_row.target)
    return CommitId(branch_row.commit_id) if branch_row and branch_row.kind == BRANCH else None


def head_branch(tx: Tx) -> str | None:
    """The branch HEAD is on, or None when HEAD is detached."""
    head_row = _head_row(tx)
    return head_row.target if head_row is not None and not head_row.commit_id else None


def _base(tx: Tx, spec: str) -> CommitId:
    if spec == HEAD:
        cid = head_commit(tx)
        if cid is None:
            raise RefNotFoundError(spec, detail=" (no commits yet)")
        return cid
    row = ref_rows.ref_row(tx, spec)
    if row is not None and row.kind not in (BRANCH, TAG) and not (row.kind == ref_rows.REMOTE
                                                                  and spec.startswith("remotes/")):
        row = None  # a remote-tracking ref is ORIGIN/BRANCH, or git's remotes/ORIGIN/BRANCH
    if row is None and "/" in spec:  # ORIGIN/BRANCH: a remote-tracking ref
        row = ref_rows.ref_row(tx, f"remotes/{spec}")
    if _HEX.fullmatch(spec.lower()) and len(spec) >= MIN_PREFIX:  # git reads A-F in an id as a-f
        matches = commit_rows.with_prefix(tx, spec.lower())
        if row is not None and matches and matches != [row.commit_id]:
            # a ref an older ckptstore accepted: neither reading may win silently
            raise AmbiguousRefError(f"{spec!r} names both the {row.kind} {spec!r} and commit {matches[0][:12]}; "
                                    f"give the full commit id, or rename the {row.kind}")
        if row is None and len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise AmbiguousRefError(f"commit prefix {spec!r} matches {len(matches)} commits; give more digits")
    if row is not None:
        if not row.commit_id:
            raise ref_rows.nowhere(row.name)
        return CommitId(row.commit_id)
    tracking = [name.removeprefix("remotes/") for name in ref_rows.names(tx, (ref_rows.REMOTE,))
                if name.endswith(f"/{spec}")]
    if tracking:  # git makes the branch from its remote's; here it is one command
        raise RefNotFoundError(spec, detail=f" as a branch here; {tracking[0]} is a remote's: `ckpt branch {spec} "
                                            f"{tracking[0]}`, then `ckpt checkout {spec}`")
    raise RefNotFoundError(spec, difflib.get_close_matches(spec, [*ref_rows.names(tx), HEAD], n=3, cutoff=0.5))


def split_range(spec: str) -> tuple[str, str, bool] | None:
    """A range as git writes one, `A..B` or `A...B`, as (A, B, whether three dots); None for a single ref.

    An empty side is HEAD. Names cannot hold `..` (check_name), and those made here not end with `.`.
    """
    for dots in ("...", ".."):
        if dots in spec:
            a, b = spec.split(dots, 1)
            return a.strip() or HEAD, b.strip() or HEAD, dots == "..."
    return None


def _split_ancestry(spec: str) -> tuple[str, str]:
    """`spec` as (name, its trailing ~N and ^N), e.g. ("main", "~2^2"); ancestry "" where there is none.

    A scan back from the end: a regex splitting it tried every split point, quadratic in the length (a 32 KB
    argument took 17 s).
    """
    start = len(spec)
    while start and spec[start - 1] in "0123456789~^":
        start -= 1
    while start < len(spec) and spec[start].isdigit():  # digits before the first ~ or ^ belong to the name (v1~2)
        start += 1
    return spec[:start], spec[start:]


def resolve(tx: Tx, spec: str) -> CommitId:
    """The commit a ref expression names; `~N` follows first parents, `^N` picks the Nth parent."""
    if not isinstance(spec, str):
        raise CkptError(f"a ref is a branch, tag or commit id as text, not {type(spec).__name__} {spec!r}")
    spec = spec.strip()
    name, ancestry = _split_ancestry(spec)
    if not name:
        return _base(tx, spec)
    cid = _base(tx, name)
    for op, count in re.findall(r"([~^])(\d*)", ancestry):
        n = int(count) if count else 1
        if op == "~":
            walked = {cid}
            for _ in range(n):
                parent = commit_rows.nth_parent(tx, cid, 0)
                if parent is None:
                    raise RefNotFoundError(spec, detail=f" (history of {name} is shorter)")
                if parent in walked:  # forged parent rows: walking on would go round the loop
                    for member in sorted(walked):  # the forged one's row does not hash to its id: that names it
                        commit_rows.commit_info(tx, member)
                    raise CorruptRecordError(f"the history of {name!r}", "its first parents lead in a loop, "
                                             "which only forged rows can", outcome="Nothing was resolved")
                cid = parent
                walked.add(cid)
        else:
            # a commit has a handful of parents; a huge N (past SQLite's integers) names none of them
            parent = cid if n == 0 else commit_rows.nth_parent(tx, cid, n - 1) if n <= 1 << 16 else None
            if parent is None:
                raise RefNotFoundError(spec, detail=f" ({cid[:12]} has no parent {n})")
            cid = parent
    return cid


def head(repo: Repository) -> tuple[str | None, CommitId | None]:
    """(branch HEAD is on or None when detached, commit or None when unborn)."""
    with repo.db.read() as tx:
        return head_branch(tx), head_commit(tx)


def create(repo: Repository, name: str, start: str, kind: str) -> CommitId:
    """Create a branch or tag `name` at the commit `start` names."""
    with repo.db.write() as tx:
        check_made_name(name, repo.config.remotes, tx)
        if ref_rows.ref_row(tx, name) is not None:
            raise RefExistsError(f"a branch or tag named {name!r} already exists")
        if kind == TAG and head_branch(tx) == name:
            raise RefExistsError(f"HEAD is on branch {name!r}, which has no commits yet; a tag of that name would "
                                 "stand in its way: choose another name")
        cid = resolve(tx, start)
        pruned = commit_rows.commit_info(tx, cid).pruned
        if kind == BRANCH and pruned:  # no commit could follow it: no parent state
            raise CkptError(f"commit {cid[:12]} was removed by `ckpt prune`: a branch there could take no commit; "
                            "branch from a kept commit (`ckpt log` marks the pruned ones)")
        ref_rows.insert_ref(tx, name, kind, cid)
    if pruned:  # a tag to keep it from retention (--keep-tagged) came too late: said, where it was silent
        warn_caller(f"commit {cid[:12]} was removed by `ckpt prune`: tag {name!r} marks its place in the history "
                    "only, its checkpoint is gone")
    return cid


def branch(repo: Repository, name: str, start: str = HEAD) -> CommitId:
    """Create branch `name` at `start`; HEAD does not move."""
    return create(repo, name, start, BRANCH)


def tag(repo: Repository, name: str, ref: str = HEAD) -> CommitId:
    """Create tag `name` at `ref`; tags never move."""
    return create(repo, name, ref, TAG)


RESTORE_METADATA = "restore the metadata from a backup (`ckpt fsck` lists all damage)"


def damage_of(name: str, kind: str, cid: str | None) -> str:
    """What is wrong with ref `name` (of `kind`), which names commit `cid` that has no record (None: no commit).

    As a listing that went past it warns of it: the problem, and the command that deletes it.
    """
    problem = ("it names no branch and no commit" if kind == HEAD_KIND  # on a branch, that branch's row is read
               else "it points at no commit") if cid is None else f"it points at commit {cid}, which has no record"
    fix = {BRANCH: f"delete it with `ckpt branch -d {name}`", TAG: f"delete it with `ckpt tag -d {name}`",
           HEAD_KIND: "check out a branch (`ckpt checkout BRANCH`)"}.get(kind, "fetch its remote again")
    return f"{problem}; it was left out: {fix}, or {RESTORE_METADATA}"


def listed_refs(repo: Repository, kind: str, damage: dict[str, str]) -> dict[str, CommitId]:
    """The branches or tags (`kind`) by name; a damaged one is noted in `damage` and left out, as `log --all` does.

    Damaged: its row names no commit, or a commit with no record (`ckpt branch` listed nothing for one).
    """
    nowhere: list[str] = []
    with repo.db.read() as tx:
        found = ref_rows.refs_of_kind(tx, kind, nowhere)
        recorded = liveness.commit_ids(tx) if found else set()
    damage.update({f"ref {name}": damage_of(name, kind, None) for name in nowhere})
    lost = {name: cid for name, cid in found.items() if cid not in recorded}
    damage.update({f"ref {name}": damage_of(name, kind, cid) for name, cid in lost.items()})
    return {name: cid for name, cid in found.items() if name not in lost}


def stored_refs(repo: Repository, kind: str) -> dict[str, CommitId]:
    """The branches or tags (`kind`) by name as their rows hold them; a row naming no commit raises.

    Not `listed_refs`: the integrations ask whether a name is taken and mend a tag naming a lost commit
    by deleting and making it again, which a listing that leaves it out turned into "already exists".
    """
    with repo.db.read() as tx:
        return ref_rows.refs_of_kind(tx, kind)


def sound_part(listing: Callable[..., Listed], *args: Any) -> Listed:
    """What `listing(*args, damage=...)` (log, stats) finds sound, warning once of the damage it went past.

    The Python calls behind `ckpt log` and `stats` go past damaged rows as those do: a notebook listing
    a repository with one damaged ref or commit row got an error and nothing. Where nothing sound is
    left to return, the first damage is raised.
    """
    damage: dict[str, str] = {}
    found = listing(*args, damage=damage)
    if damage and not found:
        what, problem = next(iter(damage.items()))
        raise CorruptRecordError(what, problem, outcome="Nothing sound was left to list")
    if damage:
        warn_caller("; ".join(f"the metadata of {shown_name(what)} is damaged: {problem}"
                              for what, problem in damage.items()) + "; the rest was listed")
    return found


def _existing(tx: Tx, name: str, kind: str) -> ref_rows.RefRow:
    row = ref_rows.ref_row(tx, name)
    if row is not None and row.kind in (BRANCH, TAG) and row.kind != kind:
        raise CkptError(f"{name!r} is a {row.kind}, not a {kind}: delete it with `ckpt {row.kind} -d {name}`")
    if row is None or row.kind != kind:
        suggestions = difflib.get_close_matches(name, ref_rows.names(tx, (kind,)), n=3)
        raise RefNotFoundError(name, suggestions, detail=f" (no such {kind})")
    return row


class Deleted(NamedTuple):
    """A ref `remove_ref` deleted: the commit its row named (None: none), and whether the metadata holds it."""

    commit_id: CommitId | None
    recorded: bool


def remove_ref(repo: Repository, name: str, kind: str) -> Deleted:
    """Remove branch or tag `name` (`kind`): not the branch HEAD is on; its commits stay until `gc --prune`.

    Those nothing else reaches are warned of. A damaged ref, naming no commit or one with no record, is
    deleted too (the way out `ckpt log --all` names), with no warning of commits it cannot leave behind.
    """
    with repo.db.write() as tx:
        row = _existing(tx, name, kind)
        if kind == BRANCH and head_branch(tx) == name:
            raise CkptError(f"cannot delete branch {name!r}: HEAD is on it; check out another ref first")
        ref_rows.delete_ref(tx, name)
        cid = CommitId(row.commit_id) if row.commit_id else None
        recorded = cid is not None and commit_rows.removed(tx, cid) != "deleted"
        if recorded:
            _warn_unreached(tx, cid, ref_rows.tip_commits(tx), f"deleting {kind} {name}")
        return Deleted(cid, recorded)


def delete_tag(repo: Repository, name: str) -> CommitId | None:
    """Remove tag `name` (its commit stays until `gc --prune` if nothing else reaches it, which is warned of)."""
    return remove_ref(repo, name, TAG).commit_id


def delete_branch(repo: Repository, name: str) -> CommitId | None:
    """Remove branch `name` (its commits stay until `gc --prune`; those nothing else reaches are warned of).

    Not the branch HEAD is on. None: its row named no commit (damage), deleted all the same.
    """
    return remove_ref(repo, name, BRANCH).commit_id


def move_head(repo: Repository, cid: CommitId, branch_name: str | None) -> None:
    """HEAD onto `branch_name`, or detached at `cid` when it is None.

    A branch that moved (or went) since the checkout read `cid` would put HEAD on a commit whose
    files are not the ones written: HEAD is then detached at `cid`, with a warning. A commit that
    prune or `gc --prune` removed meanwhile (checkouts take no lock) is refused: HEAD stays.
    """
    with repo.db.write() as tx:
        how = commit_rows.removed(tx, cid)
        if how:
            by = "`ckpt prune`" if how == "pruned" else "`ckpt gc --prune`"
            raise PrunedCommitError(f"commit {cid[:12]} was removed by {by} while this checkout wrote its files: "
                                    "HEAD stays where it was (the files written are that commit's); check out a "
                                    "kept commit (`ckpt log`)")
        _warn_left_behind(tx, cid)
        row = ref_rows.ref_row(tx, branch_name) if branch_name else None
        if branch_name and (row is None or row.commit_id != cid):
            now = f"moved to {row.commit_id[:12]}" if row and row.commit_id else "was deleted"
            warn_caller(f"{branch_name} {now} while this checkout wrote {cid[:12]}'s files: HEAD is detached at "
                        f"{cid[:12]} (check out {branch_name} again to go to its tip)", RuntimeWarning)
            branch_name = None
        ref_rows.point_head(tx, branch_name, None if branch_name else cid)


def finish_head_move(repo: Repository, cid: CommitId, branch_name: str | None) -> None:
    """`move_head` for the journal of a checkout that died: a commit removed since is warned of, not raised.

    journal.finish_interrupted would catch it too, but say only that the journal could not be finished.
    """
    try:
        move_head(repo, cid, branch_name)
    except PrunedCommitError as exc:
        warn_caller(f"finishing an interrupted checkout: {exc}", RuntimeWarning)


def _warn_left_behind(tx: Tx, going_to: CommitId) -> None:
    """Warn, as git does, when a detached HEAD moves off commits nothing else reaches: gc --prune deletes them."""
    now = ref_rows.ref_row(tx, HEAD)
    if now is None or now.target is not None or now.commit_id in (None, going_to):
        return
    _warn_unreached(tx, CommitId(now.commit_id), [*ref_rows.tip_commits(tx, but=HEAD), going_to], "HEAD")


def _warn_unreached(tx: Tx, tip: CommitId, others: list[CommitId], what: str) -> None:
    """Warn where commits up to `tip` are reached from none of `others` any more: gc --prune would delete them."""
    parents = commit_rows.all_parents(tx)  # read once for both walks
    behind = liveness.reached_from(tx, [tip], parents) - liveness.reached_from(tx, others, parents)
    if behind:
        warn_caller(f"{what} leaves {len(behind)} commit{'s' * (len(behind) > 1)} behind that no branch or tag "
                    f"reaches, up to {tip[:12]}: `ckpt gc --prune` would delete them. To keep them: "
                    f"ckpt branch NAME {tip[:12]}", RuntimeWarning)
