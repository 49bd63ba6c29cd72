"""Opening a repository's metadata beside an objects URL that may already hold objects.

New metadata over a prefix that holds objects would call them all garbage, and metadata joined
with another repository's prefix would too: `gc` would delete them. Both are refused before
anything is written, so the same command can run again once the URLs are right.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Set
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError, MissingDatabaseError, RepoExistsError, RepoLockedError
from ckptstore.metadata import refs as ref_rows
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore import ObjectStore, local_folder, open_store
from ckptstore.repo import owner
from ckptstore.repo.config import RepoConfig
from ckptstore.repo.location import REPO_DIR
from ckptstore.repo.refs import ensure_head, head_made

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

SAMPLE = 8  # objects the metadata names that are looked for in the prefix: one found is enough


def open_over_objects(root: Path, config: RepoConfig, create: bool, folder: Path | None = None,
                      joining: bool = False, killed_inits: Set[str] = frozenset()) -> Repository:
    """The repository at `root` whose objects are at `config.objects_url`; `create`: start empty metadata.

    Also an init's with metadata on a server (or a SQLite file elsewhere) and objects in its own `.ckpt/`: that
    metadata, another folder's, names objects this one lacks, and was joined unchecked.

    `folder`: its `.ckpt` folder where that is not (yet) `root/.ckpt` (init builds it under another name).
    An S3 prefix must name the metadata's repository in its owner.json, or name none (then it is
    claimed: repo/owner.py). Metadata that holds a repository is joined only where some of its
    objects are in the prefix; an empty one gets a schema only over a prefix that holds no objects.
    `joining` (a machine's init): metadata that names no object yet is joined over a prefix that holds some only while a
    commit is in flight there (its first commit's objects); a remote's own interrupted first push
    left objects there that its next push finishes. `killed_inits`: repo/owner.py's bind_prefix.
    """
    from ckptstore.repo.repository import Repository

    folder = folder or root / REPO_DIR
    _refuse_objects_in_the_repository_folder(root, config, folder)
    store = open_store(config.objects_url or "objects", folder / "tmp", folder)  # the default: .ckpt/objects
    url = config.objects_url or store.url
    try:
        repo = Repository(root, config, store=store, folder=folder)
    except MissingDatabaseError:
        if not create:
            raise
        _refuse_objects_of_another(store, url)
        owner.refuse_claimed_prefix(store, killed_inits)
        created = Repository(root, config, store=store, create=True, folder=folder)
        try:
            _note_made(created, folder)  # first: a kill after it finds the note; before it, no HEAD and no claim
            ensure_head(created)
            owner.bind_prefix(created, killed_inits)
        except BaseException:
            created.close()
            raise
        return created
    try:
        if joining and not config.objects_url:
            _refuse_a_join_without_objects(repo, killed_inits, folder)
        with repo.db.read() as tx:
            named = tensor_rows.some_objects(tx, SAMPLE)
        if joining and not named:
            _refuse_objects_of_another(store, url, unless=lambda: _commit_in_flight(repo))
        if named and not any(store.has(o) for o in named):
            if not config.objects_url:  # this folder's own objects: none yet, the metadata is another folder's
                raise RepoExistsError(f"the metadata {repo.db.where} holds a repository whose objects are elsewhere "
                                      "(this new folder's .ckpt/objects has none of them): join it with --objects "
                                      "naming those objects (a shared folder or bucket), or give this repository "
                                      "metadata of its own; nothing was made")
            next(iter(store.iter_ids()), None)  # a bucket that does not exist says so, rather than "none of them"
            raise RepoExistsError(f"{url} holds none of the objects that the metadata {repo.db.where} names "
                                  f"({len(named)} looked for): that metadata belongs with another objects URL "
                                  "(give the --objects URL its repository was made with), or the bucket lost them "
                                  "(emptied or made anew: restore its objects from a backup or a full clone)")
        owner.bind_prefix(repo)  # the sample's objects may be there in another's prefix too (a shared base model)
    except BaseException:
        repo.close()
        raise
    return repo


def _refuse_objects_in_the_repository_folder(root: Path, config: RepoConfig, folder: Path) -> None:
    """Refuse, before it is made, an init's objects folder inside the `.ckpt` it is making (`folder` is a staging one).

    Made there, it stood in the way of the rename that finishes the init: "already exists", a half-made
    `.ckpt` left behind, and no command worked in the folder after.
    """
    path = local_folder(config.objects_url, folder) if config.objects_url else None
    final = Path(os.path.realpath(root / REPO_DIR))
    if path is not None and folder != root / REPO_DIR and Path(os.path.realpath(path)).is_relative_to(final):
        raise CkptError(f"objects_url {config.objects_url!r} names a folder inside {final}, which this init makes: "
                        "leave --objects out to keep the objects in .ckpt/objects")


MADE_ID = "made-id"  # in an init's half-made folder: the id of the metadata it made (a server's keeps no file there)


def _note_made(repo: Repository, folder: Path) -> None:
    """Write the id of the metadata this init made into its half-made folder.

    Killed (or failed, where the metadata outlives the folder), the next init of the same folder finds its
    own; repo/creation.py removes the file before the folder becomes `.ckpt`.
    """
    from ckptstore.metadata.identity import repository_id

    with repo.db.read() as tx:
        (folder / MADE_ID).write_text(repository_id(tx))


def _refuse_a_join_without_objects(repo: Repository, killed_inits: Set[str], folder: Path) -> None:
    """Refuse to join existing metadata with objects in this new folder's own `.ckpt/`, even before its first commit.

    Each folder would keep its objects where no other can read them, over one set of records: the first commit
    from either broke the other's fsck and gc. Every machine joins with both URLs. Only this folder's own init,
    killed after it made the metadata, may take it up again; and a schema that no init made a repository in
    (made by its migrations alone, a database administrator's) is the first init's: it notes the id, then puts
    HEAD there, in one transaction, so a second init at once is refused and a killed one is taken up here.
    """
    from ckptstore.metadata.identity import repository_id

    with repo.db.read() as tx:
        made, alone = repository_id(tx), ref_rows.ref_row(tx, ref_rows.HEAD) is None
    if alone:  # a schema alone, no one's yet: taken under the write lock, where a second init at once waits
        with repo.db.write() as tx:
            if ref_rows.ref_row(tx, ref_rows.HEAD) is None:
                (folder / MADE_ID).write_text(made)  # first, as _note_made: a kill after HEAD finds it
                head_made(tx)
                return
    if made not in killed_inits:
        raise RepoExistsError(f"the metadata {repo.db.where} already holds a repository, whose objects are not in "
                              "this new folder's .ckpt/objects: join it with --objects too, naming the objects "
                              "folder or bucket it was made with (every machine joins with both URLs), or give "
                              "this repository metadata of its own; nothing was made")


def _refuse_objects_of_another(store: ObjectStore, url: str, unless: Callable[[], bool] = lambda: False) -> None:
    """Refuse metadata naming no object over a prefix that holds some: gc there would delete them all.

    `unless`: asked last, whether they may be the metadata's own after all.
    """
    if next(iter(store.iter_ids()), None) is not None and not unless():
        raise RepoExistsError(f"{url} already holds objects that no commit in this metadata names: join their "
                              "repository with the --metadata URL it was made with, or choose another prefix "
                              "(objects of an interrupted first commit of this repository: `ckpt gc` on the "
                              "machine that made it removes them)") from None


def _commit_in_flight(repo: Repository) -> bool:
    """Whether a commit (or gc) holds the metadata's repository lock now: the prefix's objects may be its own."""
    try:
        with repo.db.repository_lock(exclusive=True, wait=False):
            return False
    except RepoLockedError:
        return True
