"""Which repository owns a local object store: gc and prune delete, and writers write, only in their own.

An object store is named by its path alone. A copy of a repository whose objects live outside its
folder (`cp -a`), or a config edited to name another repository's objects folder, reached that
store too, and its gc deleted what the other repository needed. Beside each local store that init
makes, `<store>.owner` names the repository that made it: its path (for messages), its metadata
URL where one is configured, and the inode of its `.ckpt/` folder, which a move on one disk or a
remount keeps and a copy does not. FAT, exFAT and FUSE file systems make inode numbers up per mount,
in the order names are looked up (a copy may get the original's): there the path names the owner.
gc and prune delete, and commits and pushes write, in a store outside their own folder only when it
names them so, or the same configured database (repositories joined over one hold the
same records); init refuses a store whose owner is still there, unless joining its database;
never in a store inside another repository's `.ckpt/`. A store inside the repository's own folder
is its own by place: a copy of the folder copied it. The file lies beside the store, not inside:
the store's folder holds objects only.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Set
from pathlib import Path
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError, RepoExistsError
from ckptstore.objectstore.fallback import held_here
from ckptstore.objectstore.s3 import OWNER_KEY, S3ObjectStore
from ckptstore.repo.location import REPO_DIR

if TYPE_CHECKING:
    from ckptstore.objectstore.base import ObjectStore
    from ckptstore.repo.repository import Repository

SUFFIX = ".owner"  # `.ckpt/objects.owner` for the default store
MAX_RECORD = 64 << 10  # a record is ~200 bytes; more is no record (a link to /dev/zero)


def claim(repo: Repository) -> None:
    """Name this repository as the owner of its local store (init), unless an owner still there is named."""
    folder = _local_store(repo)
    if folder is not None and not _owner_there(_record(folder)):
        _write(repo, folder)


def refuse_init(repo: Repository) -> None:
    """Refuse to make a repository over a store another repository that is still there owns.

    Joining the other's database (the same metadata URL) is no new owner: that is allowed.
    """
    folder = _local_store(repo)
    record = _record(folder) if folder is not None else None
    if record is None and folder is not None and os.path.lexists(marker(folder)):
        raise _unreadable(folder, "no repository was made. Ask whoever owns it to make it readable (or, if it is "
                                  "damaged, to write it again), or give this repository an object folder of its own")
    if _owner_there(record) and not _same_database(record, repo):
        raise RepoExistsError(f"the object store {folder} belongs to the repository at {record['repository']}: "
                              "join that repository with its --metadata URL, or give this one a folder of its own")


def refuse_anothers(repo: Repository, writing: bool = False) -> None:
    """Raise unless this repository may delete (gc, prune) or, `writing`, write (any writer) in its local store.

    A copy's commit wrote objects that only the copy's records name: the owner's gc deleted them.
    See the module docstring.
    """
    bind_prefix(repo, again=not writing)  # on S3: writes and deletions only in a prefix that names this database
    folder = _local_store(repo)
    if folder is None or any(folder.is_relative_to(os.path.realpath(own)) for own in (repo.root, repo.dir)):
        return  # its own by place (a .ckpt linked from elsewhere too)
    holder = next((p for p in folder.parents if p.name == REPO_DIR and (p / "config.toml").is_file()), None)
    if holder is not None:  # another repository's own folder, named or not
        raise _refusal(folder, holder.parent, writing)
    record = _record(folder)
    if record is None:
        if os.path.lexists(marker(folder)):  # a link to nowhere too: it named someone
            raise _unreadable(folder, f"nothing was {'written' if writing else 'deleted'}. Delete it if this "
                                      "repository is the one the store belongs to")
        return  # made before owners were written: nothing names another
    if _same_database(record, repo):
        return
    if not _names_this_one(record, repo):
        raise _refusal(folder, Path(str(record.get("repository"))), writing)
    if record.get("repository") != os.path.realpath(repo.root) and not repo.read_only:
        _write(repo, folder)  # the same .ckpt, moved on its disk: the name follows it


def bind_prefix(repo: Repository, killed_inits: Set[str] = frozenset(), again: bool = False) -> None:
    """Raise unless the repository's S3 prefix belongs to its database; a prefix naming none is claimed for it.

    An S3 prefix is named by its URL alone, and metadata joined with another repository's prefix (where the
    objects it sampled were there: both held a pretrained model's) called that one's objects garbage, which
    gc deleted. `owner.json` beside the prefix's objects names the database's random id (migration 0011)
    and, for metadata inside `.ckpt/`, that folder's inode, which a `cp -a` copy (the same id) does not keep:
    init, a join and the first write of each process (commit, push; gc and prune `again`, each time) check
    it, and claim a prefix that names none (one made before 0011) with a create-only PUT, so two claims
    cannot both win. `killed_inits`: ids of this folder's own inits killed before they finished, whose claim
    is this one's. Local stores have `.owner` files (above).
    """
    store = held_here(repo.store)
    if not hasattr(store, "owner_record") or (getattr(repo, "_prefix_bound", False) and not again):
        return
    mine = _database_id(repo)
    ours = {"repository": mine, "metadata": repo.db.where if repo.config.metadata_url else str(repo.root / REPO_DIR)}
    inode = _own_inode(repo)
    if inode is not None:
        ours["inode"] = inode
    record = store.owner_record()
    if record is None and not repo.read_only and not store.claim_owner(ours):
        record = store.owner_record()  # another claimed it first: its claim decides
    elif isinstance(record, dict) and record.get("repository") in killed_inits:
        store.write_owner(ours)  # an init of this very folder, killed before it finished, wrote it
        record = None
    if record is not None:
        _refuse_anothers_prefix(store, record, ours, repo.read_only)
    repo._prefix_bound = True  # once per process: the record only ever names one database


def refuse_claimed_prefix(store: ObjectStore, killed_inits: Set[str]) -> None:
    """Before an init makes new metadata over an S3 prefix: refuse one that another repository claimed.

    New metadata has a new id, which no claim names: a schema made first was left behind in the
    database (a server's) when the claim refused it afterwards.
    """
    store = held_here(store)
    record = store.owner_record() if hasattr(store, "owner_record") else None
    if record is None or isinstance(record, dict) and record.get("repository") in killed_inits:
        return
    named = _claimant(record) if isinstance(record, dict) else f"something this ckptstore cannot read ({record!r})"
    raise RepoExistsError(f"{store.url} belongs to another repository: its {OWNER_KEY} names {named}; nothing was "
                          "made. Join that repository (its --metadata URL), or give this one another prefix")


def withdraw_claim(store: ObjectStore, ids: Set[str]) -> None:
    """Delete the prefix's owner.json where it names one of `ids`, the ids of metadata a failed init made.

    No repository was made, but its claim stayed, for a database it removed: every later init was refused.
    """
    store = held_here(store)
    if ids and hasattr(store, "owner_record"):
        record = store.owner_record()
        if isinstance(record, dict) and record.get("repository") in ids:
            store.delete_owner()


def _refuse_anothers_prefix(store: S3ObjectStore, record: dict | str, ours: dict, read_only: bool) -> None:
    """Raise unless `record` (the prefix's owner.json) names `ours`; a record of ours lacking its inode gets it."""
    url, key = store.url, OWNER_KEY
    if not isinstance(record, dict):
        raise RepoExistsError(f"{url}/{key}, which names the repository this prefix belongs to, is damaged "
                              f"({record!r}): nothing was changed. If the prefix is this repository's (its metadata is "
                              f"{ours['metadata']}), delete {url}/{key}: the next write claims it again")
    if record.get("repository") != ours["repository"]:
        raise RepoExistsError(f"{url} belongs to another repository: its {key} names {_claimant(record)}, not this "
                              f"metadata's ({ours['metadata']}, repository {ours['repository'][:12]}); nothing was "
                              "changed. Give the --metadata URL the prefix was made with, or another prefix (if this "
                              f"metadata is that repository's after a schema downgrade, delete {url}/{key})")
    if "inode" in ours and record.get("inode", ours["inode"]) != ours["inode"]:
        raise RepoExistsError(f"{url} belongs to the repository whose .ckpt folder was {record.get('metadata')} "
                              f"(inode {record.get('inode')}); this one ({ours['metadata']}) is a copy of it or was "
                              "moved: a copy's objects, recorded only in the copy, would be garbage to the other's gc "
                              "(and the other's to the copy's), so nothing was changed. `ckpt clone` makes a copy "
                              "with a prefix of its own. If this repository is that one, moved, and no copy uses "
                              f"the prefix, delete {url}/{key}: the next write claims it again")
    if "inode" in ours and "inode" not in record and not read_only:
        store.write_owner(ours)  # written before inodes were: the first writer names its folder


def _claimant(record: dict) -> str:
    """The repository an owner.json names, for a refusal: its id's start and where its metadata is."""
    return f"repository {str(record.get('repository'))[:12]} (metadata {record.get('metadata')})"


def _own_inode(repo: Repository) -> int | None:
    """The inode of the `.ckpt/` folder holding the metadata (a SQLite file there), where inodes are kept."""
    if repo.config.metadata_url:
        return None  # a configured database: machines joined over it share the prefix
    from ckptstore.formats.mounts import keeps_inodes

    return os.stat(repo.dir).st_ino if keeps_inodes(repo.dir) else None


def marker(folder: Path) -> Path:
    """Where the owner of the store in `folder` is named: beside it."""
    return folder.with_name(folder.name + SUFFIX)


def _refusal(folder: Path, owner: Path, writing: bool = False) -> CkptError:
    harm = ("objects written here would be recorded only in this repository, and that one's gc would delete them, "
            "so nothing was written" if writing else
            "a gc here would delete the objects that one needs, so nothing was deleted")
    return CkptError(f"the object store {folder} belongs to the repository at {owner}, not this one: {harm}. A copy "
                     "of a repository needs objects of its own (`ckpt clone` makes one). If this repository is that "
                     f"one, moved to another disk or restored, and no copy uses the store, delete {marker(folder)}")


def _unreadable(folder: Path, outcome: str) -> CkptError:
    return CkptError(f"{marker(folder)} cannot be read (or is damaged): it names the repository that owns the object "
                     f"store {folder}; {outcome}")


def _record(folder: Path) -> dict | None:
    """The owner record beside `folder`, or None where there is none or it cannot be read as one.

    Only a regular file is read (a FIFO there hung gc), and only its first MAX_RECORD bytes.
    """
    try:
        with open(os.open(marker(folder), os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            data = handle.read(MAX_RECORD + 1)
        record = json.loads(data) if len(data) <= MAX_RECORD else None
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _names_this_one(record: dict, repo: Repository) -> bool:
    """Whether the record names this repository's `.ckpt/`: by its inode, or by its path where inodes are made up."""
    from ckptstore.formats.mounts import keeps_inodes  # the formats package loads numpy: only for gc and prune

    if keeps_inodes(repo.dir):
        return record.get("inode") == os.stat(repo.dir).st_ino
    return record.get("repository") == os.path.realpath(repo.root)


def _owner_there(record: dict | None) -> bool:
    """Whether the repository a record names is still where it was, the same .ckpt folder (not made anew).

    A folder this user may not look into (another user's 0700 project) may hold it: that counts as there.
    """
    try:
        if record is None:
            return False
        folder = Path(str(record["repository"])) / REPO_DIR
        info = os.stat(folder)  # gone: FileNotFoundError, no owner there
        from ckptstore.formats.mounts import keeps_inodes

        return info.st_ino == record["inode"] if keeps_inodes(folder, info.st_dev) else stat.S_ISDIR(info.st_mode)
    except PermissionError:
        return True
    except (OSError, KeyError):
        return False


def _same_database(record: dict, repo: Repository) -> bool:
    """Both repositories keep their records in one configured database (joined): what one needs, the other sees.

    By the database's id (schema 0011) and its place: the URL's text differs between machines that reach one
    database (a password in PGPASSWORD, `localhost` for `127.0.0.1`), so a server's database counts by its name
    and schema, a SQLite file by its path. A copy keeps the id (`cp -a` of a project holding its SQLite file,
    a restored dump), not the place. A record written before names the URL only.
    """
    if not repo.config.metadata_url:
        return False
    if "id" in record:
        return record["id"] == _database_id(repo) and _place(str(record.get("metadata"))) == _place(repo.db.where)
    return record.get("metadata") == repo.db.url


def _place(where: str) -> str:
    """What names a database whichever way a machine reaches it: a server's database and schema, or a file's path."""
    if where.startswith("postgresql://"):
        return where.split("/", 3)[-1]  # "DB (search_path NAME)", after the user, host and port
    return os.path.realpath(where)


def _database_id(repo: Repository) -> str:
    from ckptstore.metadata.identity import repository_id

    with repo.db.read() as tx:
        return repository_id(tx)


def _write(repo: Repository, folder: Path) -> None:
    """Name this repository beside its store: its folder and inode, and a configured database's id and place.

    The place without a password: the file lies beside objects others may read.
    """
    where = repo.db.where if repo.config.metadata_url else ""
    record = {"repository": os.path.realpath(repo.root), "metadata": where, "inode": os.stat(repo.dir).st_ino}
    if repo.config.metadata_url:
        record["id"] = _database_id(repo)
    temp = folder.with_name(f".{folder.name}{SUFFIX}.{os.getpid()}.tmp")  # not formats.atomic: numpy
    try:
        temp.write_text(json.dumps(record))
        os.replace(temp, marker(folder))
    except OSError:  # a store this process may not write beside: left unnamed
        temp.unlink(missing_ok=True)


def _local_store(repo: Repository) -> Path | None:
    """The resolved folder of the repository's local object store, if it has one."""
    root = getattr(held_here(repo.store), "root", None)
    return None if root is None else Path(os.path.realpath(root))
