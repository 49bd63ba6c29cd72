import sqlite3

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.metadata import Database
from ckptstore.metadata.db import HEAD_REVISION, KNOWN_REVISIONS
from ckptstore.metadata.migrate import head_revision, upgrade
from ckptstore.repo.config import RepoConfig

pytestmark = pytest.mark.both_backends


def _columns(path, table):
    with sqlite3.connect(path) as conn:
        return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def test_repository_made_by_an_older_schema_opens_and_upgrades(tmp_path):  # SQLite; PostgreSQL: test_postgres.py
    (tmp_path / ".ckpt").mkdir()
    RepoConfig().save(tmp_path / ".ckpt" / "config.toml")
    db_path = tmp_path / ".ckpt" / "ckpt.db"
    upgrade(f"sqlite:///{db_path}", "0001")
    assert not _columns(db_path, "known_files")
    with Repository.open(tmp_path) as repo:
        assert repo.db.revision() == HEAD_REVISION
    assert _columns(db_path, "known_files") == {"digest", "commit_id", "size"}
    assert "checksum" in _columns(db_path, "tensor_chunks")


def test_the_schema_check_knows_the_newest_migration():
    assert HEAD_REVISION == head_revision()
    assert KNOWN_REVISIONS[-1] == HEAD_REVISION


def test_a_database_from_a_newer_ckptstore_is_refused(tmp_path, metadata_url):
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo, repo.db.write() as tx:
        tx.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(CkptError, match="newer ckptstore"):
        Repository.open(tmp_path)


def test_a_newer_ckptstore_upgrading_between_our_check_and_our_upgrade_is_the_same_refusal(tmp_path, monkeypatch):
    from ckptstore.metadata import migrate

    url = f"sqlite:///{tmp_path / 'ckpt.db'}"
    upgrade(url, "0007")

    def raced(target, revision="head"):  # another process, with a newer ckptstore, upgraded it meanwhile
        with sqlite3.connect(tmp_path / "ckpt.db") as other:
            other.execute("UPDATE alembic_version SET version_num = '9999'")
        return upgrade(target, revision)

    monkeypatch.setattr(migrate, "upgrade", raced)
    with pytest.raises(CkptError, match="'9999', written by a newer ckptstore"):
        Database(url)


def test_a_backup_restored_from_vacuum_into_is_put_back_in_wal_when_opened_to_write(tmp_path):
    Database(f"sqlite:///{tmp_path / 'ckpt.db'}").close()
    with sqlite3.connect(tmp_path / "ckpt.db") as original:
        original.execute(f"VACUUM INTO '{tmp_path / 'restored.db'}'")
    mode = lambda: sqlite3.connect(tmp_path / "restored.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode() == "delete"  # what a backup made so holds
    Database(f"sqlite:///{tmp_path / 'restored.db'}", read_only=True).close()
    assert mode() == "delete"  # a reader changes nothing
    Database(f"sqlite:///{tmp_path / 'restored.db'}").close()
    assert mode() == "wal"


def test_database_uses_wal(tmp_path):  # SQLite only: the file's journal
    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        assert tx.scalar("PRAGMA journal_mode") == "wal"
        assert tx.scalar("PRAGMA synchronous") == 2  # FULL


def test_a_write_that_fails_leaves_nothing(tmp_path, metadata_url):
    db = Database(metadata_url or f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(RuntimeError), db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
        raise RuntimeError("boom")
    with db.read() as tx:
        assert tx.rows("SELECT * FROM refs") == []
    db.close()


def test_migrations_build_the_schema_that_schema_py_mirrors(tmp_path, metadata_url):
    from sqlalchemy import inspect

    from ckptstore.metadata.migrate import make_engine
    from ckptstore.metadata.schema import metadata

    with Repository.init(tmp_path, metadata_url=metadata_url):
        pass
    engine = make_engine(metadata_url or f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}")
    try:
        found = inspect(engine)
        for table in metadata.sorted_tables:
            assert {c["name"] for c in found.get_columns(table.name)} == {c.name for c in table.columns}, table.name
            assert set(found.get_pk_constraint(table.name)["constrained_columns"]) == {
                c.name for c in table.primary_key.columns}, table.name
    finally:
        engine.dispose()


def test_files_known_to_a_pruned_commit_stay_known_through_later_commits(tmp_path, metadata_url):
    import torch

    from ckptstore.repo import gc

    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
        repo.branch("side", repo.commit({"w": torch.zeros(3)}))
        repo.commit(tmp_path / "a.pt", branch="side")  # the first commit of this file's content
        repo.commit(tmp_path / "a.pt", message="the same file on main", allow_empty=True)
        repo.delete_branch("side")
        assert gc(repo, prune_unreachable=True).commits_removed == 1
        assert [f["state"] for f in repo.status()["files"]] == ["unchanged"]
        repo.checkout_to("HEAD")  # would refuse to overwrite a file whose content no commit holds


def test_an_upgrade_says_older_ckptstores_are_shut_out_and_a_new_repository_says_nothing(tmp_path):
    """Any command of a newer ckptstore upgraded a team's repository without a word: the older machines' next
    command was refused (auditor). 0010 itself changes no table: it shuts out a ckptstore that knows no owner file."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Repository.init(tmp_path).close()
    db_path = tmp_path / ".ckpt" / "ckpt.db"
    with sqlite3.connect(db_path) as conn:
        tables = conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
        conn.execute("UPDATE alembic_version SET version_num = '0009'")
    with pytest.warns(RuntimeWarning, match=r"upgraded the metadata schema of .* from 0009 to 0010: a ckptstore "
                                            r"older than this one can no longer open it"):
        Repository.open(tmp_path).close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == tables


def test_a_0009_repository_is_read_as_it_is_where_it_cannot_be_written(tmp_path):
    """0010 changed no table, yet a read-only open of every 0009 repository was refused (reader)."""
    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.ones(4)})
    with sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0009'")
    with Repository.open(tmp_path, read_only=True) as repo:
        assert [c.id for c in repo.log()] == [cid] and torch.equal(repo.checkout(cid)["w"], torch.ones(4))
        assert repo.db.revision() == "0009"
