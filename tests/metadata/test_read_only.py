"""A read-only repository: reading commands work and write nothing; writing ones fail in one clear line."""

# SQLite only: read-only file mounts and modes (PostgreSQL's read-only: test_postgres.py)
import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptstore import Repository
from ckptstore.cli import cli
from ckptstore.errors import ReadOnlyRepoError
from tests.test_cli_errors import one_error_line, run, strict_json

READS = [["log"], ["log", "--graph", "--all"], ["log", "--json"], ["show"], ["show", "--json", "HEAD~1"], ["status"],
         ["diff", "HEAD~1", "HEAD"], ["stats", "--json"], ["branch"], ["tag"], ["fsck"]]
WRITES = [["commit", "c.pt", "--allow-empty"], ["branch", "b2"], ["tag", "t2"], ["tag", "-d", "t1"],
          ["branch", "-d", "side"], ["checkout", "HEAD~1"], ["gc"]]


def snapshot(folder: Path) -> dict:
    """Every file below `folder`: size, mtime in ns and bytes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in files}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ro")
    with Repository.init(root) as repo:
        for step in (1, 2):
            torch.save({"w": torch.arange(8.0) * step, "step": step}, root / "c.pt")
            repo.commit(root / "c.pt", step=step, metrics={"loss": 1.0 / step})
        repo.branch("side", "HEAD~1")
        repo.tag("t1")
    return root


@contextlib.contextmanager
def unwritable(folder: Path):
    """`folder` made unwritable for this process: a read-only bind mount as root, chmod -R a-w otherwise."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        try:
            yield folder
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(folder)], check=True)
        return
    view = folder.parent / (folder.name + "-ro")
    view.mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(folder), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=True)


def exercise(root: Path, *flags: str, out: Path) -> None:
    """Every reading command succeeds; every writing one fails saying read-only (one line: a real process)."""
    def ckpt(*args):
        return CliRunner().invoke(cli, ["--repo", str(root), *flags, *args])

    for args in READS:
        result = ckpt(*args)
        assert result.exit_code == 0, (args, result.output, result.exception)
        if "--json" in args:
            strict_json(result.output)
    assert "t1" in ckpt("tag").output and "side" in ckpt("branch").output
    result = ckpt("checkout", "HEAD~1", "-o", str(out))
    assert result.exit_code == 0, result.exception
    assert torch.load(out, weights_only=True)["w"].equal(torch.arange(8.0))
    for args in WRITES:
        result = ckpt(*args)
        assert isinstance(result.exception, ReadOnlyRepoError) and "read-only" in str(result.exception), args
    one_error_line(run(root, *flags, "commit", "c.pt"), "read-only")


def test_a_read_only_repository_is_read_and_not_written(repo_dir, tmp_path):
    before = snapshot(repo_dir)
    with unwritable(repo_dir) as view:
        exercise(view, out=tmp_path / "out.pt")
        with Repository.open(view) as repo:
            assert repo.read_only and len(repo.log()) == 2
            with pytest.raises(ReadOnlyRepoError, match="read-only"):
                repo.branch("b3")
    assert snapshot(repo_dir) == before


def test_explicit_read_only_writes_nothing(repo_dir, tmp_path):
    """--read-only on a writable repository (and as root): files as they were, SQLite's shared files aside."""
    before = snapshot(repo_dir)
    exercise(repo_dir, "--read-only", out=tmp_path / "out.pt")
    after = snapshot(repo_dir)
    for path, was in before.items():
        assert after[path] == was, path
    for path in set(after) - set(before):  # SQLite's -shm and an empty -wal: a reader's, holding no data
        assert path.name in ("ckpt.db-shm", "ckpt.db-wal") and (path.name == "ckpt.db-shm" or not after[path][0])
    with Repository.open(repo_dir) as repo:
        assert not repo.read_only and len(repo.log()) == 2


def test_an_older_schema_read_only_says_how_to_upgrade(tmp_path):
    Repository.init(tmp_path).close()
    with contextlib.closing(sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db")) as db, db:
        db.execute("UPDATE alembic_version SET version_num = '0005'")
    one_error_line(run(tmp_path, "--read-only", "log"), "older", "read-only", "upgrade")


def test_a_long_lived_reader_of_an_unwritable_repository_sees_later_commits(tmp_path):
    """An owner commits through a writable path while a reader holds the repository open read-only."""
    if os.geteuid() != 0:
        pytest.skip("needs a read-only bind mount (root): chmod would stop the owner's writes too")
    with Repository.init(tmp_path / "r") as owner:
        first = owner.commit({"w": torch.ones(4)}, step=1)
    with unwritable(tmp_path / "r") as view, Repository.open(view) as reader:
        assert reader.resolve("HEAD") == first
        with Repository.open(tmp_path / "r") as owner:
            second = owner.commit({"w": torch.zeros(4)}, step=2)
        assert reader.resolve("HEAD") == second
        assert torch.equal(reader.checkout("HEAD")["w"], torch.zeros(4))


@pytest.mark.parametrize("asked_read_only", [False, True])
def test_a_full_disk_makes_a_repository_read_only_only_while_it_lasts_and_never_lifts_read_only(tmp_path, monkeypatch,
                                                                                              asked_read_only):
    from ckptstore.metadata import sqlite as sqlite_backend

    connecting, full = sqlite_backend.connect_sqlite, [False]

    def as_on_a_full_disk(path, read_only=False, immutable=False):  # SQLite cannot map its -shm file
        if full[0] and not immutable:
            raise sqlite3.OperationalError("database or disk is full")
        return connecting(path, read_only, immutable)

    monkeypatch.setattr(sqlite_backend, "connect_sqlite", as_on_a_full_disk)
    with Repository.init(tmp_path) as repo:
        first = repo.commit({"w": torch.ones(3)})
    full[0] = True
    with Repository.open(tmp_path, read_only=asked_read_only) as repo:
        assert repo.read_only and [c.id for c in repo.log()] == [first]
        full[0] = False  # room again
        if asked_read_only:
            with pytest.raises(ReadOnlyRepoError, match="opened with --read-only"):
                repo.commit({"w": torch.zeros(3)})
        else:
            repo.commit({"w": torch.zeros(3)})
            assert not repo.read_only and len(repo.log()) == 2


def test_a_repository_read_only_for_want_of_inodes_says_so_not_that_the_disk_is_full(tmp_path, monkeypatch):
    """Out of inodes with bytes free, SQLite's -shm could not be made and writing commands said "the disk is full",
    whose remedy (free some space) may not help (auditor 383): the inodes now, as the other writes say them."""
    from ckptstore.metadata import sqlite as sqlite_backend

    connecting = sqlite_backend.connect_sqlite

    def as_out_of_inodes(path, read_only=False, immutable=False):  # SQLite cannot make its -shm file
        if not immutable:
            raise sqlite3.OperationalError("database or disk is full")
        return connecting(path, read_only, immutable)

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(3)})
    folder, statvfs = str(tmp_path / ".ckpt"), os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096,) * 5 + (64, 0, 0, 0, 255))
                        if os.fspath(path) == folder else statvfs(path))
    monkeypatch.setattr(sqlite_backend, "connect_sqlite", as_out_of_inodes)
    with Repository.open(tmp_path) as repo, pytest.raises(ReadOnlyRepoError) as refused:
        repo.commit({"w": torch.zeros(3)})
    said = str(refused.value)
    assert f"(the file system holding {folder} can make no more files (its inodes are used up: `df -i {folder}`)" \
        in said and "the disk is full" not in said, said


def test_an_unwritable_copy_whose_log_holds_commits_but_lost_its_shared_memory_file_says_what_to_do(tmp_path):
    """A writer killed after its commit leaves the commit in ckpt.db-wal; without -shm, SQLite cannot read it there."""
    import sys

    with Repository.init(tmp_path / "r") as owner:
        owner.commit({"w": torch.ones(4)}, step=1)
    late = "INSERT INTO refs SELECT 'late', kind, commit_id, target FROM refs WHERE name = 'main'"
    subprocess.run([sys.executable, "-c", "import os, sqlite3, sys\n"
                    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                    "c.execute('PRAGMA wal_autocheckpoint=0')\n"
                    "c.execute(sys.argv[2])\n"
                    "os._exit(0)", str(tmp_path / "r" / ".ckpt" / "ckpt.db"), late], check=True)
    assert (tmp_path / "r" / ".ckpt" / "ckpt.db-wal").stat().st_size
    (tmp_path / "r" / ".ckpt" / "ckpt.db-shm").unlink()
    with unwritable(tmp_path / "r") as view:
        one_error_line(run(view, "log"), "ckpt.db-shm is missing", "writable")
    assert "late" in run(tmp_path / "r", "branch").stdout  # where it can be written, the commit is there


def test_a_database_kept_outside_the_repository_in_an_unwritable_folder_is_read_and_that_folder_named(tmp_path):
    """metadata_url = sqlite:////ABS/PATH (the docs allow it): `.ckpt` writable, the database's folder not.

    Only `.ckpt` was checked: the open went on writable, and log failed blaming `.ckpt`.
    """
    (tmp_path / "meta").mkdir()
    with Repository.init(tmp_path / "r", metadata_url=f"sqlite:///{tmp_path / 'meta' / 'ckpt.db'}") as repo:
        repo.commit({"w": torch.ones(4)}, step=1, message="kept elsewhere")
    config = tmp_path / "r" / ".ckpt" / "config.toml"
    with unwritable(tmp_path / "meta") as view:
        config.write_text(config.read_text().replace(str(tmp_path / "meta"), str(view)))
        assert "kept elsewhere" in run(tmp_path / "r", "log", "--oneline").stdout
        torch.save({"w": torch.zeros(4)}, tmp_path / "r" / "c.pt")
        one_error_line(run(tmp_path / "r", "commit", "c.pt"),
                       f"write to the metadata at {view / 'ckpt.db'}, which is read-only", f"({view} is not writable)")
        with Repository.open(tmp_path / "r") as repo:
            assert repo.read_only and [c.message for c in repo.log()] == ["kept elsewhere"]
