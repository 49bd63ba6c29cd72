"""Remotes, as in git: `remote add`, `push`, `fetch`, `pull` and `clone`.

A remote is another repository: a folder holding `.ckpt/` (on this disk or a shared mount), or a
shared repository named by its objects URL (`s3://BUCKET/PREFIX`) and its metadata URL (a
PostgreSQL database). Whatever moves, moves in the same order as a commit: objects first (only
those the other side lacks, each verified against its id as it is read), then the records in
one transaction, then the ref with a compare-and-swap. An interruption at any point leaves the
other side's refs where they were and only unreferenced objects behind; running the command
again sends only what is still missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore import faults
from ckptstore.errors import (
    CkptError,
    ConflictError,
    CorruptObjectError,
    CorruptRecordError,
    InvalidRefNameError,
    LostLockError,
    MissingDatabaseError,
    ReadOnlyRepoError,
    RefNotFoundError,
    RepoLockedError,
    SentObjectError,
    StoreUnavailableError,
    causes,
    explain,
)
from ckptstore.formats.atomic import atomic_write
from ckptstore.hashing import CommitId, ObjectId, TensorId
from ckptstore.metadata import absolute_url, shown_url, transfer
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import refs as ref_rows
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.objectstore.base import lacking, tells_lacking
from ckptstore.objectstore.fallback import FallbackStore, held_here
from ckptstore.paths import without_credentials
from ckptstore.repo import integrity, refs
from ckptstore.repo.config import RemoteConfig, RepoConfig, edit_config, user_cache
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore.metadata.db import Tx
    from ckptstore.repo.maintenance import FsckReport
    from ckptstore.repo.repository import Repository

REMOTE_KIND = ref_rows.REMOTE
PULLING = "pulling.json"  # [branch, old, new] of a pull writing HEAD's files: an interrupted one is ended next time
MAX_REMOTE_NAME = 40  # remotes/REMOTE/BRANCH fits the metadata's 255 characters with refs.MAX_NAME


@dataclass
class TransferReport:
    """What a push or fetch moved."""

    commits: int = 0
    tensors: int = 0
    objects: int = 0
    object_bytes: int = 0
    refs_moved: list[tuple[str, CommitId | None, CommitId | None]] | None = None  # (ref, from, to: None deleted)


# ----------------------------------------------------------------- naming and opening remotes
def add(repo: Repository, name: str, url: str, metadata_url: str = "", typed_in: Path | None = None) -> RemoteConfig:
    """Record remote `name` at `url` (a repository folder, or s3://... with `metadata_url`) in the config.

    A relative folder is kept relative to the repository's root (a copy of the repository with its
    remote inside still finds it); `typed_in` (the CLI's current folder) is where it was relative to.
    """
    repo.db.refuse_writes("remote add (it writes .ckpt/config.toml)")
    if "/" in name or len(name) > MAX_REMOTE_NAME:
        raise InvalidRefNameError(f"remote name {name!r} may not contain '/' or be longer than {MAX_REMOTE_NAME} "
                                  "characters")
    try:  # the commit-id rule is not asked: a remote's name only stands in NAME/BRANCH, never alone as a ref
        refs.check_form(name)
    except CkptError:
        raise InvalidRefNameError(f"{name!r} is not a valid remote name (letters, digits, . _ -)") from None
    if name in repo.config.remotes:
        raise _taken(name, repo.config.remotes[name].url)
    with repo.db.read() as tx:  # names only: a damaged branch or tag row elsewhere is no reason to refuse
        taken = ref_rows.names(tx, (ref_rows.BRANCH, ref_rows.TAG))
    hidden = sorted(ref for ref in taken if ref.startswith(f"{name}/"))
    if hidden:
        raise CkptError(f"{hidden[0]!r} would hide remote {name!r}'s tracking ref of that name; rename it, or "
                        "choose another remote name")
    remote = _located(repo, name, url, metadata_url, typed_in)

    def record(config: RepoConfig) -> None:
        if name in config.remotes:  # added since this repository was opened
            raise _taken(name, config.remotes[name].url)
        config.remotes[name] = remote

    repo.config = edit_config(repo.dir / "config.toml", record)
    return remote


def _taken(name: str, url: str) -> CkptError:
    return CkptError(f"remote {name!r} already exists ({without_credentials(url)}); remove it first, or point it "
                     f"elsewhere: `ckpt remote set-url {name} URL`")


def set_url(repo: Repository, name: str, url: str, metadata_url: str = "", typed_in: Path | None = None
            ) -> RemoteConfig:
    """Point remote `name` at `url` (its repository moved), keeping its tracking refs and whether it is lazy."""
    repo.db.refuse_writes("remote set-url (it writes .ckpt/config.toml)")
    lazy = named(repo, name).lazy
    remote = dataclasses.replace(_located(repo, name, url, metadata_url, typed_in), lazy=lazy)
    if lazy and "://" not in remote.url:  # as `clone --lazy` refuses one: else its next read did (round 12b)
        from ckptstore.repo.repository import REPO_DIR

        _refuse_lazy_origin(RepoConfig.load(Path(repo.root, remote.url, REPO_DIR, "config.toml")), url,
                            f"point {name} at the repository {url} was cloned from")

    def record(config: RepoConfig) -> None:
        if name not in config.remotes:  # removed since this repository was opened
            raise CkptError(f"no remote named {name!r}")
        config.remotes[name] = remote

    repo.config = edit_config(repo.dir / "config.toml", record)
    return remote


def _located(repo: Repository, name: str, url: str, metadata_url: str, typed_in: Path | None) -> RemoteConfig:
    """Remote `name` at `url`, checked to be a repository (or a bucket and database) that opens.

    A relative folder is kept relative to the repository's root; `typed_in` is where it was typed.
    """
    if not url.strip():
        raise CkptError("a remote needs a URL: a repository folder, or s3://BUCKET/PREFIX with --metadata")
    folder = url if "://" in url else os.path.expanduser(url)
    if "://" not in url and typed_in is not None and not os.path.isabs(folder):
        folder = os.path.relpath(os.path.abspath(os.path.join(typed_in, folder)), repo.root)
    # a relative SQLite path is taken from the current folder, as init takes it, and kept absolute
    remote = RemoteConfig(folder, absolute_url(metadata_url, Path.cwd()))
    if "://" not in url and os.path.realpath(remote.resolved(repo.root).url) == os.path.realpath(repo.root):
        raise CkptError(f"{url} is this repository itself: a remote is another repository")
    with open_remote(remote.resolved(repo.root), name, create=True) as there:  # a folder that is no repository: refused
        if there.db.url == repo.db.url and there.store.url == repo.store.url:  # joined over the same database and store
            raise CkptError(f"{url} is this repository itself (the same database and objects): a remote is another "
                            "repository")
    return remote


def remove(repo: Repository, name: str) -> None:
    """Forget remote `name` and its remote-tracking refs (not the remote a lazy clone reads its objects from)."""
    if named(repo, name).lazy:
        raise CkptError(f"remote {name!r} is where this lazy clone reads the objects it does not hold yet: removing "
                        "it would leave commits unreadable. `ckpt fsck` reads (so fetches) every object; "
                        f"then set lazy = false under [remotes.{name}] in .ckpt/config.toml to remove it")
    with repo.db.write() as tx:
        for ref in ref_rows.names(tx, (REMOTE_KIND,)):
            if ref.startswith(f"remotes/{name}/"):
                ref_rows.delete_ref(tx, ref)
    repo.config = edit_config(repo.dir / "config.toml", lambda config: config.remotes.pop(name, None))


def named(repo: Repository, name: str) -> RemoteConfig:
    """The remote called `name`, or a clear error listing those there are."""
    try:
        return repo.config.remotes[name].resolved(repo.root)
    except KeyError:
        known = ", ".join(sorted(repo.config.remotes)) or "none"
        raise CkptError(f"no remote named {name!r} (remotes: {known}); `ckpt remote add NAME URL` adds "
                        "one") from None


def _normal_url(url: str) -> str:
    return url if "://" in url else str(Path(url).expanduser().resolve())


def open_remote(remote: RemoteConfig, name: str = "", create: bool = False) -> Repository:
    """The remote as a Repository: a folder's own config, or a shared one made from its two URLs.

    `create` (remote add, push) starts the schema in a bucket remote's empty database, as init would;
    otherwise a database that holds no repository is refused: a mistyped URL names no remote.
    """
    from ckptstore.repo.joining import open_over_objects
    from ckptstore.repo.repository import REPO_DIR, Repository

    where = f"remote {name!r} ({without_credentials(remote.url)})" if name else without_credentials(remote.url)
    if "://" not in remote.url:
        if not (Path(remote.url) / REPO_DIR).is_dir():
            raise CkptError(f"{where} is not a ckptstore repository (no {REPO_DIR}/ folder there)")
        with _naming(where):
            return Repository.open(remote.url)
    if not remote.metadata_url:
        raise CkptError(f"{where} names objects but no metadata: give --metadata postgresql://... (a bucket's "
                        "commit records and refs live in its database)")
    # Its lock file and scratch folder live in a per-user cache: nothing of the repository is kept there.
    key = hashlib.sha256(f"{remote.url}\n{remote.metadata_url}".encode()).hexdigest()[:16]
    root = user_cache() / "remotes" / key
    (root / REPO_DIR).mkdir(parents=True, exist_ok=True)
    try:
        with _naming(where):
            return open_over_objects(root, RepoConfig(objects_url=remote.url, metadata_url=remote.metadata_url),
                                     create)
    except MissingDatabaseError:
        raise CkptError(f"{where}: its metadata {shown_url(remote.metadata_url)} holds no repository; check the URL "
                        "(`ckpt push` to a new remote starts one there)") from None


@contextlib.contextmanager
def _naming(where: str) -> Iterator[None]:
    """A remote's database or bucket that cannot be reached: the error says which remote, not only which server."""
    try:
        yield
    except CkptError as exc:
        if type(exc) not in (CkptError, StoreUnavailableError):
            raise
        raise type(exc)(f"{where}: {exc}") from None


def _named(repo: Repository) -> str:
    """How a message names a repository: a bucket's by its URLs (its folder is only a local cache), else its folder."""
    objects = repo.config.objects_url or ""
    return f"{objects} (metadata {repo.db.where})" if "://" in objects else str(repo.root)


def remote_store(remote: RemoteConfig) -> ObjectStore:
    """Only the object store of a remote (what a lazy clone reads from)."""
    from ckptstore.repo.repository import REPO_DIR

    if "://" in remote.url:
        return open_store(remote.url, Path(remote.url), Path(remote.url))  # a bucket: no local folders used
    folder = Path(remote.url) / REPO_DIR
    if not folder.is_dir():
        raise CkptError(f"{remote.url} holds no repository any more (no {REPO_DIR}/ folder there)")
    config = RepoConfig.load(folder / "config.toml")
    _refuse_lazy_origin(config, remote.url)
    # a configured folder that is gone is said so, never made anew empty in the origin's place; read only: the
    # damage it finds is not listed in another repository's store
    return open_store(config.objects_url or "objects", folder / "tmp", folder, create=not config.objects_url,
                      read_only=True)


def _refuse_lazy_origin(config: RepoConfig, url: str,
                        advice: str = "clone it without --lazy, or clone its origin lazily") -> None:
    """A lazy clone holds only what its checkouts read, so it can be no lazy clone's origin."""
    if any(r.lazy for r in config.remotes.values()):
        raise CkptError(f"{url} is itself a lazy clone: {advice}")


def fsck_remote(repo: Repository, name: str, full: bool = False) -> FsckReport:
    """`fsck` of remote `name`, read from here (every object it holds is fetched and verified)."""
    from ckptstore.repo.maintenance import fsck

    with open_remote(named(repo, name), name) as remote:
        return fsck(remote, full)


# ----------------------------------------------------------------- moving commits
def _copy(source: Repository, target: Repository, tips: dict[str, CommitId] | None, lazy: bool = False,
          pushing: bool = False, keep: Callable[[dict[str, CommitId]], dict[str, CommitId]] | None = None,
          ) -> tuple[TransferReport, dict[str, CommitId]]:
    """Make every commit reachable from `tips` present in `target`: objects, then records. Refs are not touched.

    `tips` None: every branch of `source` that `keep` keeps, read in the same snapshot as the records,
    so a branch moved and collected there meanwhile is never half-copied. Returns the report and the tips.
    `lazy` copies the records and manifests only: the chunk objects come when a checkout reads them.
    `pushing`: `source` is the user's repository (damage it holds is named as theirs).
    """
    report = TransferReport()
    with source.db.read() as tx, target.db.read() as ttx:
        if tips is None:
            tips = ref_rows.refs_of_kind(tx, ref_rows.BRANCH)
            tips = keep(tips) if keep else tips
        candidates = transfer.ancestors(tx, list(tips.values()))
        have = transfer.present_commits(ttx, candidates)
        # a tip pruned there but whole here travels again, and is whole there after (not "present": the ref
        # moved onto it would name a commit that cannot be checked out); older commits pruned there stay
        # pruned, or every push undid the other side's retention
        revived = (transfer.pruned(ttx, have) - transfer.pruned(tx, have)) & set(tips.values())
        missing = [c for c in candidates if c not in have or c in revived]
        if not missing:
            return report, tips
        _refuse_damaged(tx, missing, source, pushing)
        tensors = transfer.tensors_of(tx, missing, _present_whole(tx, ttx, target))
        found = transfer.records(tx, missing, tensors)
        read = _refuse_damaged_records(found, tensors, missing, source, pushing)
        stale = transfer.present_tensors(ttx, tensors)  # recorded there, in objects gone everywhere: replaced
        anew = list(tensor_rows.load_records(tx, stale, with_bases=False).values()) if stale else []
    wanted = [oid for oid in found.objects if not lazy or oid in found.manifests]
    report.objects, report.object_bytes = _send_objects(source, target, wanted, pushing, read)
    faults.point("transfer:objects-sent")
    outside = transfer.outside_work_tree(found)
    if outside and target.dir.is_dir():  # before the records: a kill between leaves them unlisted never
        from ckptstore.repo.worktree import remember_fetched

        remember_fetched(target.dir, outside)
    with target.db.write() as ttx:
        if anew:
            tensor_rows.replace_records(ttx, anew, found.objects)
        transfer.insert(ttx, found)
        # their claims are the sender's (a push's too): repo/received.py. The records a received commit names and
        # this side holds already are listed too: its manifest's inputs would decide a lossy commit's reuse of them
        tensor_rows.list_unchecked(ttx, set(tensors) | set(found.column("commit_tensors", "tensor_id")))
        transfer.unprune(ttx, revived)
    faults.point("transfer:records-sent")
    report.commits, report.tensors = len(missing), len(tensors)
    return report, tips


def _present_whole(tx: Tx, ttx: Tx, target: Repository) -> Callable[[set[TensorId]], set[TensorId]]:
    """Which tensors `target` records in objects it holds, or in the same objects as the source (`tx`).

    A lazy clone keeps records whose objects it never read: where the origin re-encoded such a tensor
    (its prune) or collected it and committed it anew, the clone's record names objects gone
    everywhere, and a commit fetched later that names the tensor could not be restored there. Such a
    record is not "present": the source's is sent and takes its place. Objects its origin still
    holds are not gone: another remote's record of the same id (a false one would break the clone's
    own commits) never replaces one the origin can fill in.
    """
    local = held_here(target.store)

    def stale(tids: set[TensorId]) -> set[TensorId]:
        mine, theirs = transfer.chunk_objects(ttx, tids), transfer.chunk_objects(tx, tids)
        differ = {t for t in tids if mine.get(t, frozenset()) != theirs.get(t, frozenset())}
        gone = lacking(local, {oid for t in differ for oid in mine.get(t, ())}) if differ else set()
        if gone and isinstance(target.store, FallbackStore):
            gone = _lacking_at_origin(target.store, gone)
        return {t for t in differ if mine.get(t, frozenset()) & gone}

    def present(tids: set[TensorId]) -> set[TensorId]:
        """Those recorded there whole: a stale record down one's chain there breaks it too (auditor 403).

        A tensor the origin's prune left alone stood on a base it re-encoded: the fetch stopped at the first,
        and no commit pulled since, the new tip included, could be restored in the clone.
        """
        here = transfer.present_tensors(ttx, tids)
        base_of = transfer.bases_below(ttx, here)
        broken = stale(here | set(base_of.values()))

        def whole(tid: TensorId | None) -> bool:
            for _ in range(len(base_of) + 1):  # chains end; a damaged one that loops is no whole one
                if tid is None or tid in broken:
                    return tid is None
                tid = base_of.get(tid)
            return tid is None

        return {t for t in here if whole(t)}

    return present


def _lacking_at_origin(store: FallbackStore, oids: set[ObjectId]) -> set[ObjectId]:
    """Which of `oids` (not held here) a lazy clone's origin lacks too; an origin that cannot be asked lacks none.

    Only a record whose objects are gone everywhere may be replaced: one the origin cannot be asked
    about is kept (nothing the clone could read is overwritten on another repository's word).
    """
    try:
        origin = store.source(min(oids))
        if tells_lacking(origin):
            return origin.lacking(oids)
        return {oid for oid in oids if not origin.has(oid)}  # a bucket, asked per object: only records that differ
    except (CorruptObjectError, StoreUnavailableError):
        return set()


def _where(sender: Repository, pushing: bool) -> str:
    """How a refusal names the repository whose damage stays where it is."""
    return f"this repository ({_named(sender)})" if pushing else f"the repository at {_named(sender)}"


def _fsck_advice(pushing: bool) -> str:
    """Where the user runs fsck on the sender's damage (a bucket's too, through a repository that names it)."""
    return "Run `ckpt fsck` here" if pushing else ("Check that repository: `ckpt fsck` in it, or `ckpt fsck --remote "
                                                   "NAME` from a repository that has it as a remote")


def _refuse_damaged(tx: Tx, cids: list[CommitId], sender: Repository, pushing: bool) -> None:
    """Every commit record that would move must be there and hash to its id, as every object must.

    Damage stays where it is, and the message names the repository that holds it: a missing record
    read "metadata has no commit", which sent a user to a `ckpt fsck` here that found nothing.
    """
    where, fsck = _where(sender, pushing), _fsck_advice(pushing)
    unrecorded = sorted(set(cids) - transfer.present_commits(tx, cids))
    if unrecorded:
        raise CkptError(f"{where} has no record of commit {unrecorded[0][:12]}, which its refs reach; nothing was "
                        f"sent. {fsck}")
    for cid in cids:
        try:
            commit_rows.commit_info(tx, cid)
        except CorruptRecordError as exc:
            raise CkptError(f"{where} holds a damaged record of commit {cid[:12]} ({exc.problem}); nothing was "
                            f"sent. {fsck}") from None


def _refuse_damaged_records(found: transfer.RecordSet, tensors: set[TensorId], cids: list[CommitId],
                            sender: Repository, pushing: bool) -> dict[ObjectId, bytes]:
    """Every tensor record that would move must restore its commits there, checked from the rows loaded to send.

    A lost or damaged record moved, and broke the other side's commits, fsck and gc (exit 0 here); so did
    a commit whose rows lost some of the tensors its manifest names. Returns manifests' bytes read to check.
    """
    named, kept = integrity.manifests_read(sender, found.manifests)
    damage = integrity.sent_damage(found, tensors, cids, named)
    if damage is not None:
        cid, problem = damage
        needed = f" that commit {cid[:12]} needs" if cid else ""
        raise CkptError(f"{_where(sender, pushing)} holds damaged records{needed} ({problem}); nothing was sent. "
                        f"{_fsck_advice(pushing)}")
    return kept


def _whole_on(store: ObjectStore, oid: ObjectId, data: Callable[[], bytes]) -> bool:
    """Whether `store` holds exactly `oid`'s bytes (`data()` gives them where it needs them).

    A name is no proof: a crash can leave an object cut short under it, another writer other bytes
    of the same size, and a gateway can answer for keys it does not hold. A folder hashes its own
    copy; a bucket compares the object's ETag (`ObjectStore.holds`).
    """
    try:
        return store.holds(oid, data)
    except CorruptObjectError:  # the sender's own copy is damaged: sending it says so
        return False


def _send_objects(source: Repository, target: Repository, wanted: list[ObjectId], pushing: bool,
                  read: dict[ObjectId, bytes]) -> tuple[int, int]:
    """Copy the `wanted` objects `target` lacks whole, each verified on reading; returns (objects, bytes).

    `read`: objects' bytes read (and verified) already, which are not read again.
    """
    def data_of(oid: ObjectId) -> bytes:
        return read[oid] if oid in read else source.read_object(oid)

    oids = sorted(wanted)
    here = held_here(target.store)  # a lazy clone: what it holds, not what its origin could fill in
    held = source.pool.map(lambda oid: _whole_on(here, oid, lambda: data_of(oid)), oids)
    absent = [oid for oid, whole in zip(oids, held) if not whole]

    def send(oid: ObjectId) -> int:
        try:
            data = data_of(oid)  # verified against its id
        except CorruptObjectError as exc:  # the damage is the sender's: say where, not "run fsck" here
            raise SentObjectError(oid, exc.problem, _named(source), pushing) from None
        target.store.put(data)
        faults.point("transfer:object-sent")
        return len(data)

    with target.store.batch():
        sent = sum(source.pool.map(send, absent))
    return len(absent), sent


def _is_ancestor(repo: Repository, old: CommitId, new: CommitId) -> bool:
    with repo.db.read() as tx:
        return old in transfer.ancestors(tx, [new])


def push(repo: Repository, name: str, branch: str | None = None, force: bool = False) -> TransferReport:
    """Send `branch` (default: HEAD's) and what it needs to remote `name`, then move the remote's branch.

    A push that would drop the remote's commits (not a fast-forward) is refused unless `force`.
    """
    repo.db.refuse_writes("push (it records the remote's branch here)")  # up front: before the remote changes
    remote_config = named(repo, name)
    branch = refs.head(repo)[0] if branch in (None, "HEAD") else branch  # `push origin HEAD`, as git takes it
    if branch is None:
        raise CkptError("HEAD is detached: say which branch to push (`ckpt push REMOTE BRANCH`)")
    with repo.db.read() as tx:
        row = ref_rows.ref_row(tx, branch)
    if row is not None and row.kind == ref_rows.TAG:
        raise CkptError(f"{branch!r} is a tag here: push sends branches (make a branch at it to send its commits)")
    if row is None or row.kind != ref_rows.BRANCH or row.commit_id is None:
        raise RefNotFoundError(branch, detail=" (no such branch with commits here)")
    tip = CommitId(row.commit_id)
    try:
        report, old = _push_to(repo, remote_config, name, branch, tip, force)
    except Exception as exc:
        said = explain(exc)
        if isinstance(said, ReadOnlyRepoError) and not said.args[0].startswith(f"push to {name} refused"):
            # this repository's writes were checked up front: the remote's, found once sending
            raise ReadOnlyRepoError(f"push to {name} stopped: the remote ({remote_config.url}) cannot be written "
                                    f"from here ({_os_words(exc)}); {branch!r} was not moved there, and what was "
                                    "sent waits there for its gc") from None
        raise
    _track(repo, name, {branch: tip})
    report.refs_moved = [(branch, old, tip)] if old != tip else []
    return report


def _os_words(exc: BaseException) -> BaseException:
    """The operating system's or database's own error beneath `exc` (followed through its causes), else `exc`."""
    return next((current for current in causes(exc) if not isinstance(current, CkptError)), exc)


def _push_to(repo: Repository, remote_config: RemoteConfig, name: str, branch: str, tip: CommitId, force: bool
             ) -> tuple[TransferReport, CommitId | None]:
    """Send `tip` and what it needs, then move the remote's `branch` there: the report and where it was."""
    # both locks shared: a gc or prune on either side waits until the push has read and sent what it needs
    with open_remote(remote_config, name, create=True) as remote, repo.lock(), _held_there(remote, name):
        with remote.db.read() as rtx:
            old = _tip(_branch_row(rtx, branch, f"remote {name!r}"))
            if old is None:  # a branch made there: by the remote's rules (its own remotes' tracking refs)
                _check_name_there(rtx, remote, name, branch)
        if remote.db.read_only and old != tip:  # before anything is sent: objects there would wait for its gc
            raise ReadOnlyRepoError(f"push to {name} refused: the remote ({remote_config.url}) cannot be written from "
                                    f"here ({remote.db.why}); nothing was sent")
        if old is not None and old != tip and not force and not _is_ancestor(repo, old, tip):
            raise _refused(remote, name, branch, old, tip)
        if old is not None and old != tip and refs.head(remote)[0] == branch and (
                files := _files_of(remote, old)) is not None and files.exists():
            raise ConflictError(f"push to {name} refused: {branch!r} is checked out there, with its files at {files}; "
                                "moved, it would leave them stale, and the next commit of them there would undo "
                                f"your push. Check out another branch there first, or push to a new branch (`ckpt "
                                f"branch NEW {branch}`, then `ckpt push {name} NEW`) and check it out there (`ckpt "
                                "checkout NEW`)")
        try:
            report = _copy(repo, remote, {branch: tip}, pushing=True)[0]
            _move_remote_ref(remote, name, branch, old, tip)
        except LostLockError as exc:  # what was sent stays there, unreferenced, until the push runs again
            raise LostLockError(f"push to {name} stopped: a repository lock it held was lost ({exc.ended}); "
                                f"{branch!r} was not moved there. Run the push again: what was sent is not sent "
                                "twice", exc.ended) from None
    return report, old


def _refused(remote: Repository, name: str, branch: str, old: CommitId, tip: CommitId) -> ConflictError:
    """Why a push that is no fast-forward is refused, and what works: pull only when ours is behind theirs.

    Ancestry is the remote's to tell: it holds `old`'s history, and `tip` too when ours is behind.
    """
    if _is_ancestor(remote, tip, old):  # theirs only adds to ours: a pull fast-forwards
        return ConflictError(f"push to {name} refused: its branch {branch!r} is ahead of yours (at {old[:12]}), "
                             f"so yours has nothing it lacks; `ckpt pull {name} {branch}` brings its commits here")
    # diverged: a pull would refuse too (it only fast-forwards); send ours under a name of its own
    return ConflictError(f"push to {name} refused: its branch {branch!r} and yours have diverged (it is at "
                         f"{old[:12]}, with commits yours lacks); send yours as a branch of its own (`ckpt branch "
                         f"NEW {branch}`, then `ckpt push {name} NEW`; `ckpt fetch {name}` shows theirs as "
                         f"{name}/{branch}), or push with --force to drop their commits")


def _check_name_there(rtx: Tx, remote: Repository, name: str, branch: str) -> None:
    """Refuse a branch the push would make on remote `name` that the rules there refuse (it would hide a ref)."""
    try:
        refs.check_new_name(branch, remote.config.remotes, rtx)
    except InvalidRefNameError as exc:
        raise InvalidRefNameError(f"push to {name} refused: on {name}, {exc} (`ckpt branch NEW {branch}`, then "
                                  f"`ckpt push {name} NEW`)") from None


def _branch_row(tx: Tx, name: str, where: str) -> ref_rows.RefRow | None:
    """Branch `name`'s row, None where there is none; a clear error where the name is another kind of ref."""
    row = ref_rows.ref_row(tx, name)
    if row is not None and row.kind != ref_rows.BRANCH:
        raise CkptError(f"{where} has a {row.kind} named {name!r}, not a branch: nothing was moved")
    return row


def _move_remote_ref(remote: Repository, name: str, branch: str, old: CommitId | None, new: CommitId) -> None:
    """Move the remote's `branch` from `old` to `new` with a compare-and-swap (create it when `old` is None)."""
    if old == new:
        return
    with remote.db.write() as rtx:
        row = ref_rows.ref_row(rtx, branch)
        if old is None and row is None:
            ref_rows.insert_ref(rtx, branch, ref_rows.BRANCH, new)  # a HEAD waiting on it now sees it
            return
        if old is not None and ref_rows.swap(rtx, branch, ref_rows.BRANCH, old, new):
            return
        if row is not None and row.kind == ref_rows.BRANCH and row.commit_id == new:
            return  # another push of this very commit won the race: the branch is where this one moves it
    happened = _what_happened_to(branch, old, row)
    raise ConflictError(f"push to {name} lost a race: while the commits were sent, {happened} (what was sent is not "
                        "sent twice)")


def _what_happened_to(branch: str, old: CommitId | None, row: ref_rows.RefRow | None) -> str:
    """What another writer did to the remote's `branch` while a push sent its commits, and what to do now."""
    if row is not None and row.kind != ref_rows.BRANCH:
        return (f"a {row.kind} named {branch!r} was made there, so no branch of that name can be; branch your "
                "commit under another name here (`ckpt branch NAME`) and push that")
    if row is None:
        return (f"its branch {branch!r} was deleted there; run the push again to make it anew at your commit, if "
                "its owner wants it back")
    happened = "was made" if old is None else "moved"
    return (f"its branch {branch!r} {happened} there and was not moved again; run the push again, which moves "
            f"{branch!r} where yours still follows it, else says how to send yours")


def _track(repo: Repository, name: str, tips: dict[str, CommitId], every: bool = False
           ) -> list[tuple[str, CommitId | None, CommitId | None]]:
    """Set the remote-tracking refs `remotes/NAME/BRANCH` (shown and resolved as NAME/BRANCH); returns what moved.

    `every`: `tips` are all of the remote's branches, so tracking refs of branches gone there are deleted.
    """
    moved = []
    prefix = f"remotes/{name}/"
    with repo.db.write() as tx:
        tracked = {ref[len(prefix):]: cid for ref, cid in ref_rows.refs_of_kind(tx, REMOTE_KIND).items()
                   if ref.startswith(prefix)}
        for branch, cid in tips.items():
            ref = prefix + branch
            if branch not in tracked:
                if ref_rows.ref_row(tx, ref) is not None:  # a branch or tag here took the name: never move it
                    raise CkptError(f"{ref!r} is a branch or tag here, so the remote-tracking ref of {name}/"
                                    f"{branch} cannot be set; branch or tag its commit under another name and "
                                    f"delete it (`ckpt branch -d {ref}` or `ckpt tag -d {ref}`), then fetch again")
                ref_rows.insert_ref(tx, ref, REMOTE_KIND, cid)
            elif tracked[branch] != cid:
                ref_rows.set_commit(tx, ref, cid)
            if tracked.get(branch) != cid:
                moved.append((f"{name}/{branch}", tracked.get(branch), cid))
        for branch in sorted(set(tracked) - set(tips)) if every else []:
            ref_rows.delete_ref(tx, prefix + branch)
            moved.append((f"{name}/{branch}", tracked[branch], None))
    return moved


def fetch(repo: Repository, name: str, lazy: bool | None = None) -> TransferReport:
    """Bring every branch of remote `name` here as `NAME/BRANCH`, with what the commits need.

    Tracking refs of branches deleted there go. The refs are set under the repository's lock, with
    the copy, so a gc here never collects what was just fetched; the remote's is held too. `lazy`
    (default: as the repository was cloned) brings records and manifests only; only from the lazy
    origin, the one remote whose objects a lazy clone reads in on first use.
    """
    remote_config = named(repo, name)
    lazy = remote_config.lazy if lazy is None else lazy
    if lazy and not remote_config.lazy:
        raise CkptError(f"remote {name!r} is not this repository's lazy origin: a lazy fetch from it would record "
                        "commits whose objects nothing here reads in; fetch it without lazy=True")
    with open_remote(remote_config, name) as remote, repo.lock(), _held_there(remote, name):
        try:
            report, branches = _copy(remote, repo, None, lazy=lazy, keep=lambda tips: _well_named(name, tips))
            faults.point("fetch:tracking")  # tests run a gc here: it must wait for the lock
            report.refs_moved = _track(repo, name, branches, every=True)
        except LostLockError as exc:  # records that arrived stay, unreferenced, until the fetch runs again
            raise LostLockError(f"fetch from {name} stopped: a repository lock it held was lost ({exc.ended}); "
                                f"no {name}/BRANCH ref was moved. Run it again: it fetches only what is still "
                                "missing", exc.ended) from None
    return report


@contextlib.contextmanager
def _held_there(remote: Repository, name: str) -> Iterator[None]:
    """The remote's lock, shared: a gc or prune there waits until what push or fetch reads is copied.

    One running there when this starts is waited for, and said: no silent hang. A remote this
    process may not write (another user's folder) cannot be locked; it is read as it is.
    """
    if remote.read_only:
        yield
        return
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(remote.lock(wait=False))
        except RepoLockedError:
            warn_caller(f"waiting for remote {name}'s repository lock: a gc or prune runs there", RuntimeWarning)
            held.enter_context(remote.lock())
        yield


def _well_named(name: str, branches: dict[str, CommitId]) -> dict[str, CommitId]:
    """The remote's branches whose names a ref may have here; the rest are named in a warning and left there.

    A damaged or crafted remote's names (a newline in one, "a..b") would otherwise become tracking refs (and, by a
    clone, branches) that no command here could name, and that break log's lines.
    """
    kept, refused = {}, []
    for branch, cid in branches.items():
        try:
            refs.check_form(branch)
        except InvalidRefNameError:
            refused.append(branch)
        else:
            kept[branch] = cid
    if refused:
        warn_caller(f"remote {name!r} has branches whose names no ref may have ({', '.join(map(repr, refused))}); "
                    "they were not fetched", RuntimeWarning)
    return kept


def _tip(row: ref_rows.RefRow | None) -> CommitId | None:
    """The commit a ref row points at; None for no row (or an unborn branch)."""
    return CommitId(row.commit_id) if row is not None and row.commit_id else None


def pull(repo: Repository, name: str, branch: str | None = None) -> tuple[TransferReport, CommitId | None]:
    """Fetch, then fast-forward `branch` (default: HEAD's) to `NAME/BRANCH`; refuses anything but a fast-forward."""
    branch = branch or refs.head(repo)[0]
    if branch is None:
        raise CkptError("HEAD is detached: say which branch to pull into (`ckpt pull REMOTE BRANCH`)")
    report = fetch(repo, name)
    _end_interrupted_pull(repo)
    with repo.db.read() as tx:
        theirs = ref_rows.ref_row(tx, f"remotes/{name}/{branch}")
        ours = _branch_row(tx, branch, "this repository")
    if theirs is None or theirs.kind != REMOTE_KIND:
        raise RefNotFoundError(f"{name}/{branch}", detail=f" (remote {name!r} has no branch {branch!r})")
    new = CommitId(theirs.commit_id)
    old = _tip(ours)
    if old is None:  # a branch made here: named as `ckpt branch` names one (origin/x would hide a tracking ref)
        with repo.db.read() as tx:
            refs.check_new_name(branch, repo.config.remotes, tx)
    if old == new or (old is not None and _is_ancestor(repo, new, old)):
        return report, None  # up to date, or ours is ahead
    if old is not None and not _is_ancestor(repo, old, new):
        raise ConflictError(f"{branch!r} and {name}/{branch} have diverged; pull only fast-forwards: go on from "
                            f"theirs on a branch of its own (`ckpt branch theirs {name}/{branch}`, then `ckpt checkout "
                            f"theirs`), or send yours to a new branch there (`ckpt push {name} NEW`, after `ckpt "
                            f"branch NEW {branch}`)")
    at_head = branch == refs.head(repo)[0]
    # read before the branch moves: a database lost once the files are written must not fail the pull
    unwritten_dcp = _unwritten_dcp(repo, branch, old, new) if at_head else None
    if at_head:  # until its files are written, the next pull knows this one is not over
        atomic_write(repo.dir / PULLING, lambda out: out.write(json.dumps([branch, old, new]).encode()))
    with repo.db.write() as tx:
        if old is None:
            ref_rows.insert_ref(tx, branch, ref_rows.BRANCH, new)
        elif not ref_rows.swap(tx, branch, ref_rows.BRANCH, old, new):
            raise ConflictError(f"{branch!r} moved while pulling; run the pull again")
    if at_head:
        _update_worktree(repo, branch, old, new)
        if unwritten_dcp:
            warn_caller(unwritten_dcp, RuntimeWarning)
    return report, new


def _unwritten_dcp(repo: Repository, branch: str, old: CommitId | None, new: CommitId) -> str | None:
    """The warning for a pull that writes nothing in place because a sharded commit has no files here; or None.

    A DCP directory committed with `ckpt commit DIR` still holds the old checkpoint: training on from
    it, the next commit would undo the pull without a word.
    """
    if repo.commit_info(new).sharded:
        return (f"{branch} now points at {new[:12]}, a sharded (DCP) commit, which is never written in place: "
                f"a DCP directory committed here still holds the checkpoint it held; before training on from "
                f"it, write {new[:12]} with `ckpt checkout {new[:12]} -o NEWDIR` or load it with CkptStorageReader")
    if old is not None and repo.commit_info(old).sharded:
        return (f"{branch} now points at {new[:12]}, whose files were not written: HEAD was on a sharded (DCP) "
                f"commit, which has no files here; write them with `ckpt checkout {branch}`")
    return None


def _end_interrupted_pull(repo: Repository) -> None:
    """Write the files of a pull that moved HEAD's branch and was killed before they were written.

    Left as they were, the rerun found the branch up to date and wrote nothing, and a commit of the
    old files undid the pull. Files changed since (the user's) refuse it as a pull's own write does:
    the branch goes back and the pull stops, saying so (closed out unsaid, the next commit undid it).
    """
    try:
        branch, old, new = json.loads((repo.dir / PULLING).read_bytes())
    except FileNotFoundError:
        return
    except (OSError, ValueError, TypeError):  # cut short as it was written: the branch had not moved yet
        branch = old = new = None
    with repo.db.read() as tx:
        row = ref_rows.ref_row(tx, branch) if isinstance(branch, str) else None
    if row is not None and row.commit_id == new and refs.head(repo)[0] == branch:
        _update_worktree(repo, branch, old, new)
    (repo.dir / PULLING).unlink(missing_ok=True)


def pull_written(repo: Repository, branch: str, cid: CommitId) -> None:
    """End an interrupted pull into `branch` whose files a checkout in place of `cid` (its new commit) just wrote.

    The user finished it by hand: the files changed after that are theirs, on the pulled commit.
    """
    try:
        pulled_branch, _, new = json.loads((repo.dir / PULLING).read_bytes())
    except (OSError, ValueError, TypeError):
        return
    if (pulled_branch, new) == (branch, cid):
        (repo.dir / PULLING).unlink(missing_ok=True)


def _files_here(repo: Repository, old: CommitId | None, new: CommitId) -> bool:
    """Whether a pull from `old` to `new` writes files: both commits' lie in this work tree, the old ones written."""
    old_files = _files_of(repo, old)
    return old_files is not None and _files_of(repo, new) is not None and old_files.exists()


def _files_of(repo: Repository, cid: CommitId | None) -> Path | None:
    """Where commit `cid`'s files lie in `repo`'s work tree; None for none (in memory, absolute, forged)."""
    from ckptstore.repo.worktree import committed_from

    where = repo.commit_info(cid).source_path if cid is not None else None
    if where is None or Path(where).is_absolute():
        return None
    try:
        return committed_from(repo, cid, where)
    except CkptError:  # a forged path out of the work tree: written nowhere, as an absolute one
        return None


def _update_worktree(repo: Repository, branch: str, old: CommitId | None, new: CommitId) -> None:
    """Write HEAD's pulled commit in place, as git does; unsaved files refuse it and the branch moves back.

    Left as they were, the old files read as changes, and the next commit of them undid the pull.
    The pull's marker goes once the files are written or the branch is back, never before.
    """
    from ckptstore.errors import DirtyWorktreeError
    from ckptstore.repo.checkout import checkout_to

    try:
        if _files_here(repo, old, new):
            checkout_to(repo, branch)
    except BaseException as exc:  # files not written (Ctrl-C too): the branch goes back, so the next pull writes them
        with repo.db.write() as tx:
            if old is None:
                ref_rows.delete_ref(tx, branch)
            else:
                ref_rows.swap(tx, branch, ref_rows.BRANCH, new, old)
        (repo.dir / PULLING).unlink(missing_ok=True)
        if not isinstance(exc, Exception):
            raise
        back = f"pull stopped, {branch!r} back at {old[:12]}" if old else f"pull stopped, {branch!r} not made"
        if isinstance(exc, DirtyWorktreeError):  # its advice (-o, --force) is checkout's: pull takes neither
            raise DirtyWorktreeError(f"{back}: {exc.problem}", f"move it away, or keep it on a branch of its own "
                                     f"(`ckpt commit PATH --branch NAME`: a commit on {branch!r} would diverge from "
                                     f"{new[:12]}), then pull again; or drop it first (`ckpt checkout --force "
                                     f"{branch}`)") from None
        raise CkptError(f"{back}: its files could not be written ({explain(exc) or exc})") from exc
    (repo.dir / PULLING).unlink(missing_ok=True)


def clone(url: str, path: str | os.PathLike, metadata_url: str = "", lazy: bool = False) -> Repository:
    """A new repository at `path` with remote `origin` at `url`, its branches fetched and HEAD's checked out as refs.

    `lazy` fetches commit records and manifests only; each object comes from origin when a checkout first reads it.
    """
    from ckptstore.repo.repository import Repository

    if Path(path).exists() and not Path(path).is_dir():
        raise CkptError(f"{path} is a file, not a folder to clone into")
    remote = RemoteConfig(_normal_url(url), absolute_url(metadata_url, Path.cwd()), lazy)
    with open_remote(remote, "origin") as source:
        head_branch = refs.head(source)[0] or "main"
        if lazy:
            _refuse_lazy_origin(source.config, url)
    if not _interrupted_clone_of(path, remote):  # origin is in the config from the start: a killed clone resumes
        from ckptstore.repo.creation import create

        create(Path(path).resolve(), RepoConfig(remotes={"origin": remote})).close()
    repo = Repository.open(path)
    try:
        fetch(repo, "origin")
        with repo.db.write() as tx:
            made = []
            for ref in ref_rows.names(tx, (REMOTE_KIND,)):
                branch = ref[len("remotes/origin/"):]
                # origin's branch "origin/x" made local would hide the tracking ref of its branch "x"
                if ref_rows.ref_row(tx, branch) is None and not branch.startswith("origin/") and _nameable(branch):
                    ref_rows.insert_ref(tx, branch, ref_rows.BRANCH, ref_rows.ref_row(tx, ref).commit_id)
                    made.append(branch)
            if not _nameable(head_branch) or head_branch.startswith("origin/"):  # origin's HEAD row is damaged
                head_branch = "main" if "main" in made or not made else sorted(made)[0]
            ref_rows.point_head(tx, head_branch, None)
    except BaseException:
        repo.close()
        raise
    return repo


def _nameable(branch: str) -> bool:
    """Whether `branch` may be a local branch's name here (refs.check_name)."""
    try:
        refs.check_name(branch)
    except InvalidRefNameError:
        return False
    return True


def _interrupted_clone_of(path: str | os.PathLike, remote: RemoteConfig) -> bool:
    """True when an interrupted clone of `remote` left a repository at `path` (the clone resumes it)."""
    from ckptstore.errors import RepoExistsError
    from ckptstore.repo.repository import REPO_DIR, Repository

    if not (Path(path) / REPO_DIR).exists():
        return False
    with Repository.open(path) as existing:
        origin = existing.config.remotes.get("origin")
        with existing.db.read() as tx:  # any branch, damaged too: a clone makes its branches last
            branched = bool(ref_rows.names(tx, (ref_rows.BRANCH,)))
        if origin is None or (origin.url, origin.metadata_url) != (remote.url, remote.metadata_url) or branched:
            raise RepoExistsError(f"{Path(path).resolve() / REPO_DIR} already exists; clone into a new folder")
        if origin.lazy != remote.lazy:  # resuming it the other way would silently keep its first kind
            kind, flag = ("a lazy", "with") if origin.lazy else ("a full", "without")
            raise RepoExistsError(f"{Path(path).resolve()} holds {kind} clone of {remote.url} that was interrupted: "
                                  f"rerun the clone {flag} --lazy to finish it, or clone into a new folder")
    return True
