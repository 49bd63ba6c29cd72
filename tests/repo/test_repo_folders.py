"""repo_folders: what counts as another repository's own folder or object store."""

from pathlib import Path

import torch

from ckptstore import Repository, daemon
from ckptstore.repo import chaincost, journal, remote
from ckptstore.repo.config import RepoConfig
from ckptstore.repo.repo_folders import REPOSITORY_FOLDER_NAMES, is_object_store, is_repository_folder
from ckptstore.repo.worktree import FETCHED


def test_what_counts_as_another_repositorys_folder_or_store(tmp_path):
    """A store with its own tmp/ (on another disk than its repository) or an empty first folder after gc, and a
    config with no [core] beside its database, were missed; a run folder's config copy beside tmp/, or a user's own
    [core], were taken for a repository (reader)."""
    store = tmp_path / "store"
    for name in ("tmp", "00", "ab"):
        (store / name).mkdir(parents=True)
    (store / "ab" / ("c" * 62)).write_bytes(b"x")
    numbered = tmp_path / "numbered"
    (numbered / "00").mkdir(parents=True)
    (numbered / "00" / "m.pt").write_bytes(b"x")
    assert is_object_store(store) and not is_object_store(numbered)
    with Repository.init(tmp_path / "disk"):
        pass
    meta = (tmp_path / "disk" / ".ckpt").rename(tmp_path / "disk" / "meta")
    (meta / "config.toml").write_text("[retention]\nkeep_last = 5\n")
    run, user = tmp_path / "run", tmp_path / "user"
    for folder in (run, user):
        (folder / "tmp").mkdir(parents=True)
        (folder / "lock").write_text("")
    RepoConfig().save(run / "config.toml")
    (user / "config.toml").write_text("[core]\nseed = 1\n")
    (user / "ckpt.db").write_bytes((meta / "ckpt.db").read_bytes()[:100])  # a SQLite file beside the user's config
    unreadable = tmp_path / "unreadable"  # root reads any file: a folder under the name stands for one it may not
    (unreadable / "ckpt.db").mkdir(parents=True)
    (unreadable / "config.toml").write_text("[retention]\nkeep_last = 5\n")
    assert is_repository_folder(unreadable)  # never written over for want of reading it (reader)
    assert is_repository_folder(meta) and not is_repository_folder(run) and not is_repository_folder(user)
    shared = tmp_path / "shared"  # a joined shared repository's folder, and a run folder's copy of its config
    shared.mkdir()
    RepoConfig(metadata_url="postgresql://ml@db/runs", objects_url="s3://b/p").save(shared / "config.toml")
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.toml").write_bytes((shared / "config.toml").read_bytes())
    (copy / "model.pt").write_bytes(b"x")
    assert is_repository_folder(shared) and not is_repository_folder(copy)
    emptied = tmp_path / "emptied"  # numbered folders whose files were deleted: no store
    for name in ("00", "01"):
        (emptied / name).mkdir(parents=True)
    assert not is_object_store(emptied)


def test_a_used_shared_repositorys_folder_and_an_unreadable_config_mark_a_repository(tmp_path, monkeypatch):
    """A joined shared repository's folder after commits and a checkout (chaincost.json, journals/, its local
    objects) was taken for a run folder and deleted by an outer checkout; so were an unreadable config.toml
    beside ckpt.db and a ckpt.db linked to a disk not mounted (reader 8, of eb36008)."""
    work = tmp_path / "work"
    with Repository.init(work, metadata_url=f"sqlite:///{tmp_path / 'meta.db'}") as shared:
        for value in (1.0, 2.0):
            torch.save({"w": torch.full((64,), value)}, work / "m.pt")
            shared.commit(work / "m.pt", "m")
        shared.checkout_to("HEAD~1")
    folder = (work / ".ckpt").rename(tmp_path / "meta")
    assert {"journals", "objects", "objects.owner"} <= {p.name for p in folder.iterdir()}
    assert is_repository_folder(folder)
    (folder / "model.pt").write_bytes(b"x")  # a run folder's copy of its config, beside checkpoints
    assert not is_repository_folder(folder)
    daemon_files = [path(work).name for path in (daemon.log_path, daemon.lock_path, daemon.address_path)]
    assert {chaincost.FILE, journal.FOLDER, remote.PULLING, FETCHED, *daemon_files} <= REPOSITORY_FOLDER_NAMES

    closed = tmp_path / "closed"  # another user's repository: its config (a password in a URL) not to be read
    with Repository.init(tmp_path / "other"):
        pass
    (tmp_path / "other" / ".ckpt").rename(closed)
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if self.parent == closed else read_text(self, *a, **k))
    assert is_repository_folder(closed)
    monkeypatch.undo()
    (closed / "ckpt.db").unlink()
    (closed / "ckpt.db").symlink_to(tmp_path / "unmounted" / "ckpt.db")
    assert is_repository_folder(closed)
