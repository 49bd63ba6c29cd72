"""gc and prune delete only in an object store their repository owns (repo/owner.py)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.repo import fsck, gc
from ckptstore.repo.config import RepoConfig, RetentionPolicy
from ckptstore.repo.pruning import prune
from tests.conftest import assert_same, ckpt_env


def _state(seed: int) -> dict:
    return {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(seed))}


def test_a_copy_of_a_repository_whose_objects_live_outside_it_cannot_collect_the_originals(tmp_path):
    """`cp -a` of a repository made with --objects elsewhere shared that folder: the copy's gc deleted the
    objects of the original's later commits (auditor)."""
    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as original:
        original.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    with Repository.open(tmp_path / "a") as original:
        later = original.commit(_state(1))
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match=r"the object store .*objects belongs to the repository at .*/a, not this"):
            gc(copy)
        with pytest.raises(CkptError, match="belongs to the repository at"):
            prune(copy, RetentionPolicy(keep_last=1))
    shutil.move(tmp_path / "a", tmp_path / "moved")  # the named path is gone: the copy is still not the owner
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match="belongs to the repository at .*/a, not this"):
            gc(copy)  # it took the store over, then deleted the moved original's objects (fourth reader)
    with Repository.open(tmp_path / "moved") as original:  # the same .ckpt, moved: the name follows it
        gc(original)
        assert fsck(original).ok
        assert_same(_state(1), original.checkout(later))
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match="belongs to the repository at .*/moved"):
            gc(copy)


@pytest.mark.parametrize("named, linked", [(True, False), (False, False), (False, True)])
def test_a_config_naming_another_repositorys_objects_cannot_collect_them(tmp_path, named, linked):
    """An objects_url edited to another repository's .ckpt/objects: gc there deleted all of them (auditor), also
    where that store names no owner (made before owners were written: third reader), and from a repository
    whose .ckpt is a link to a folder of another name (my read: it looked for parents of that name)."""
    with Repository.init(tmp_path / "a") as first:
        cid = first.commit(_state(0))
    if not named:
        (tmp_path / "a" / ".ckpt" / "objects.owner").unlink()
    Repository.init(tmp_path / "b").close()
    if linked:
        shutil.move(tmp_path / "b" / ".ckpt", tmp_path / "store")
        (tmp_path / "b" / ".ckpt").symlink_to(tmp_path / "store")
    config = RepoConfig.load(tmp_path / "b" / ".ckpt" / "config.toml")
    config.objects_url = str(tmp_path / "a" / ".ckpt" / "objects")
    config.save(tmp_path / "b" / ".ckpt" / "config.toml")
    with Repository.open(tmp_path / "b") as other, pytest.raises(CkptError, match="nothing was deleted"):
        gc(other)
    with Repository.open(tmp_path / "a") as first:
        assert fsck(first).ok
        assert_same(_state(0), first.checkout(cid))


def test_an_init_that_failed_leaves_no_owner_in_the_way_of_the_next(tmp_path):
    """A failed init left the store naming its staging folder: the retried repository's gc was refused as
    another's, and every commit under a policy failed (third reader)."""
    objects = tmp_path / "objects"
    failed = subprocess.run([sys.executable, "-m", "ckptstore", "init", "r", "--objects", str(objects)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=ckpt_env(CKPT_FAIL_AT="init:metadata-made"))
    assert failed.returncode != 0 and not (tmp_path / "r" / ".ckpt").exists()
    with Repository.init(tmp_path / "r", objects_url=str(objects)) as repo:
        repo.commit(_state(0))
        gc(repo)
        assert fsck(repo).ok
    assert json.loads((tmp_path / "objects.owner").read_text())["repository"] == str(tmp_path / "r")


def test_a_second_init_over_a_store_another_repository_owns_is_refused(tmp_path):
    """The second init renamed the store's owner to itself (fourth reader); kept as the first's, the first's gc
    then deleted the second's commits (fifth reader). A store owned by a repository still there is its alone."""
    from ckptstore.errors import RepoExistsError

    store = tmp_path / "objects"
    Repository.init(tmp_path / "a", objects_url=str(store)).close()
    with pytest.raises(RepoExistsError, match=r"the object store .*objects belongs to the repository at .*/a: join"):
        Repository.init(tmp_path / "b", objects_url=str(store))
    assert not (tmp_path / "b" / ".ckpt").exists()
    with Repository.open(tmp_path / "a") as first:
        cid = first.commit(_state(0))
        gc(first)
        assert fsck(first).ok
        assert_same(_state(0), first.checkout(cid))


def test_repositories_joined_over_one_sqlite_database_collect_as_one(tmp_path):
    """An absolute SQLite metadata URL shared by two repositories holds both's records, as PostgreSQL would: the
    second's init named itself the owner and the first's gc was refused (fourth reader)."""
    database, store = f"sqlite:///{tmp_path / 'shared.db'}", str(tmp_path / "objects")
    with Repository.init(tmp_path / "a", metadata_url=database, objects_url=store) as first:
        cid = first.commit(_state(0))
    Repository.init(tmp_path / "b", metadata_url=database, objects_url=store).close()
    for name in ("a", "b"):
        with Repository.open(tmp_path / name) as repo:
            gc(repo)
            assert_same(_state(0), repo.checkout(cid))


def test_a_copy_made_at_the_moved_originals_old_path_is_not_the_owner(tmp_path):
    """mv A A2, then cp -a A2 A: the copy matched the owner file by path and its gc deleted A2's objects (fifth
    reader). The owner is the .ckpt folder the file names by inode: A2's, moved."""
    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as repo:
        repo.commit(_state(0))
    shutil.move(tmp_path / "a", tmp_path / "a2")
    shutil.copytree(tmp_path / "a2", tmp_path / "a", symlinks=True)
    with Repository.open(tmp_path / "a2") as moved:
        later = moved.commit(_state(1))
    with Repository.open(tmp_path / "a") as copy, pytest.raises(CkptError, match="belongs to the repository at"):
        gc(copy)
    with Repository.open(tmp_path / "a2") as moved:
        gc(moved)
        assert_same(_state(1), moved.checkout(later))


def test_a_new_repository_at_a_moved_owners_old_path_leaves_the_store_to_the_moved_one(tmp_path):
    """After `mv runs runs-2024` and a new `ckpt init runs/exp`, the moved repository's gc was refused for good
    (fifth reader)."""
    with Repository.init(tmp_path / "runs" / "exp", objects_url=str(tmp_path / "objects")) as repo:
        cid = repo.commit(_state(0))
    shutil.move(tmp_path / "runs", tmp_path / "runs-2024")
    Repository.init(tmp_path / "runs" / "exp").close()  # its own objects, in its .ckpt
    with Repository.open(tmp_path / "runs-2024" / "exp") as moved:
        gc(moved)
        prune(moved, RetentionPolicy(keep_last=1))
        assert_same(_state(0), moved.checkout(cid))


def test_a_configured_sqlite_database_of_its_own_does_not_make_another_store_collectable(tmp_path):
    """Any --metadata sqlite URL (made absolute by init) counted as shared and skipped the check: an objects_url
    edited to another repository's store was collected (fifth reader)."""
    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as first:
        cid = first.commit(_state(0))
    Repository.init(tmp_path / "b", metadata_url=f"sqlite:///{tmp_path / 'b-meta.db'}").close()
    config = RepoConfig.load(tmp_path / "b" / ".ckpt" / "config.toml")
    config.objects_url = str(tmp_path / "objects")
    config.save(tmp_path / "b" / ".ckpt" / "config.toml")
    with Repository.open(tmp_path / "b") as other, pytest.raises(CkptError, match="belongs to the repository at"):
        gc(other)
    with Repository.open(tmp_path / "a") as first:
        assert_same(_state(0), first.checkout(cid))


def test_a_copy_holding_its_store_in_its_own_folder_collects_it(tmp_path):
    """With objects_url = "../objects" a copy of the folder copied the store too, yet its gc was refused as
    another's (fifth reader): a store inside the repository's folder is its own by place."""
    with Repository.init(tmp_path / "a", objects_url="../objects") as repo:
        repo.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    with Repository.open(tmp_path / "b") as copy:
        gc(copy)
        assert fsck(copy).ok


def test_a_read_only_gc_writes_no_owner_file(tmp_path):
    """`ckpt --read-only gc` after a move rewrote the owner file before refusing as read-only (fifth reader)."""
    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as repo:
        repo.commit(_state(0))
    before = (tmp_path / "objects.owner").read_bytes()
    shutil.move(tmp_path / "a", tmp_path / "a2")
    with Repository.open(tmp_path / "a2", read_only=True) as moved, pytest.raises(CkptError):
        gc(moved)
    assert (tmp_path / "objects.owner").read_bytes() == before


def test_an_init_over_a_store_whose_owner_it_cannot_look_at_or_read_is_refused(tmp_path, monkeypatch):
    """Another user's 0700 project hid the owner: the stat's PermissionError counted as "gone", the second init
    claimed the store and its gc deleted the first's objects (auditor, high). An unreadable owner file likewise."""
    import os

    from ckptstore.errors import RepoExistsError
    from ckptstore.repo import owner

    store = tmp_path / "objects"
    Repository.init(tmp_path / "a", objects_url=str(store)).close()
    hidden = str(tmp_path / "a")
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(hidden):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(owner.os, "stat", stat)
        with pytest.raises(RepoExistsError, match=r"belongs to the repository at .*/a: join"):
            Repository.init(tmp_path / "b", objects_url=str(store))
    assert json.loads(owner.marker(store).read_text())["repository"].endswith("/a")
    owner.marker(store).write_text("{not json")
    with pytest.raises(CkptError, match=r"objects.owner cannot be read \(or is damaged\): .*; no repository was "
                                        r"made\. Ask whoever "):
        Repository.init(tmp_path / "c", objects_url=str(store))
    assert owner.marker(store).read_text() == "{not json" and not (tmp_path / "c" / ".ckpt").exists()


def test_where_inode_numbers_are_made_up_per_mount_the_path_names_the_owner(tmp_path, monkeypatch):
    """On exFAT a remount gave the repository's .ckpt another inode number (its own gc refused), and a `cp -a` copy
    looked up first got the original's (its gc deleted the original's objects) (filesystems auditor)."""
    from ckptstore.formats import mounts

    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as original:
        original.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    with Repository.open(tmp_path / "a") as original:
        later = original.commit(_state(1))
    marker = tmp_path / "objects.owner"
    record = json.loads(marker.read_text())
    monkeypatch.setattr(mounts, "keeps_inodes", lambda path, device=None: False)  # as on exFAT
    marker.write_text(json.dumps({**record, "inode": (tmp_path / "b" / ".ckpt").stat().st_ino}))  # the copy's now
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match="belongs to the repository at .*/a, not this"):
            gc(copy)
    marker.write_text(json.dumps({**record, "inode": record["inode"] + 1}))  # the original, remounted
    with Repository.open(tmp_path / "a") as original:
        gc(original)
        assert fsck(original).ok
        assert_same(_state(1), original.checkout(later))



@pytest.mark.parametrize("kind", ["dangling link", "looping link", "fifo", "endless"])
def test_an_owner_file_that_is_no_readable_file_refuses_gc_without_hanging(tmp_path, kind):
    """A dangling or looping link counted as no owner file at all, and a copy's gc deleted the original's objects
    (high); a FIFO there hung gc and prune (hostile-input auditor)."""
    import os

    from ckptstore.repo import owner

    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as original:
        original.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    with Repository.open(tmp_path / "a") as original:
        later = original.commit(_state(1))
    place = owner.marker(tmp_path / "objects")
    place.unlink()
    {"dangling link": lambda: place.symlink_to(tmp_path / "nowhere" / "x.owner"),
     "looping link": lambda: place.symlink_to(place),
     "fifo": lambda: os.mkfifo(place),
     "endless": lambda: place.symlink_to("/dev/zero")}[kind]()
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match=r"objects.owner cannot be read \(or is damaged\): .*nothing was deleted"):
            gc(copy)
        with pytest.raises(CkptError, match="cannot be read"):
            prune(copy, RetentionPolicy(keep_last=1))
    with Repository.open(tmp_path / "a") as original:
        assert fsck(original).ok
        assert_same(_state(1), original.checkout(later))


def test_a_copy_of_a_repository_whose_objects_live_outside_it_cannot_commit_into_the_originals(tmp_path):
    """`cp -a`'s copy committed into the original's store, recorded in its own database only; the original's gc
    (its own store) then deleted that commit's objects (mixed-versions auditor, stop 55)."""
    with Repository.init(tmp_path / "a", objects_url=str(tmp_path / "objects")) as original:
        first = original.commit(_state(0))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    stored = sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file())
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match=r"belongs to the repository at .*/a, not this one: objects written here "
                                            r"would be recorded only in this repository.*nothing was written"):
            copy.commit(_state(1))
        assert copy.log() and copy.log()[0].id == first
        assert_same(_state(0), copy.checkout(first))  # reading stays open to it
    assert sorted(p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()) == stored
    torch.save(_state(1), tmp_path / "x.pt")
    result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", str(tmp_path / "x.pt")], cwd=tmp_path / "b",
                            env=ckpt_env(), capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr and "nothing was written" in result.stderr
    with Repository.open(tmp_path / "a") as original:
        original.commit(_state(2))
        gc(original)
        assert fsck(original).ok


def test_a_join_spelling_the_database_url_otherwise_is_one_database_and_no_password_lies_beside_the_store(
        tmp_path, postgres_server, monkeypatch):
    """The store's owner record named the URL's text, password and all (mode 0644, beside shared objects), and a
    machine with its password in PGPASSWORD (as teams.md advises) was refused the join (docs audit helper 293)."""
    from ckptstore.testing.postgres_server import PASSWORD, PASSWORD_USER

    name = postgres_server.new_database().rsplit("/", 1)[1]
    postgres_server.execute(f"ALTER DATABASE {name} OWNER TO {PASSWORD_USER}", database=name)
    store = str(tmp_path / "objects")
    with Repository.init(tmp_path / "a", objects_url=store,
                         metadata_url=postgres_server.url(name, user=PASSWORD_USER, password=PASSWORD)) as first:
        cid = first.commit(_state(0))
    record = (tmp_path / "objects.owner").read_text()
    assert PASSWORD not in record and json.loads(record)["id"]
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    with Repository.init(tmp_path / "b", objects_url=store, metadata_url=postgres_server.url(name, user=PASSWORD_USER)
                         ) as second:
        assert second.joined and gc(second).objects_removed == 0
        assert_same(_state(0), second.checkout(cid))


def test_a_copy_of_a_project_holding_its_sqlite_file_cannot_collect_or_write_the_shared_store(tmp_path):
    """The copy's database is a copy (the same id), so the owner record's id let its gc into the original's store,
    which deleted the original's later commits (reviewer helper 295, of 828b5e3)."""
    project = tmp_path / "a"
    project.mkdir()
    with Repository.init(project, objects_url=str(tmp_path / "objects"),
                         metadata_url=f"sqlite:///{project / 'meta.db'}") as original:
        original.commit(_state(0))
    shutil.copytree(project, tmp_path / "b", symlinks=True)
    with Repository.open(project) as original:
        later = original.commit(_state(1))
    with Repository.open(tmp_path / "b") as copy:
        with pytest.raises(CkptError, match=r"belongs to the repository at .*/a, not this one"):
            gc(copy)
        with pytest.raises(CkptError, match="nothing was written"):
            copy.commit(_state(2))
    with Repository.open(project) as original:
        assert fsck(original).ok
        assert_same(_state(1), original.checkout(later))
