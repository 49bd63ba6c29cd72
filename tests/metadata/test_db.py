import threading

import pytest

from ckptstore.errors import CkptError
from ckptstore.metadata import Database
from ckptstore.metadata.db import HEAD_REVISION

pytestmark = pytest.mark.both_backends


def test_threads_share_pooled_connections(db):
    def read():
        with db.read() as tx:
            assert tx.scalar("SELECT count(*) FROM refs") == 0

    for _ in range(5):
        threads = [threading.Thread(target=read) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(db._idle) <= 20  # bounded by transactions at once, not by threads ever seen


def test_a_write_inside_a_write_of_the_same_thread_fails_at_once(db):
    with db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
        with pytest.raises(CkptError, match="inside another"), db.write():
            pass
    with db.read() as tx:
        assert tx.column("SELECT name FROM refs") == ["HEAD"]


def test_a_read_inside_a_write_gets_its_own_snapshot(db):
    with db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
        with db.read() as inner:
            assert inner.rows("SELECT * FROM refs") == []  # not committed yet
    with db.read() as tx:
        assert len(tx.rows("SELECT * FROM refs")) == 1


def test_a_closed_database_refuses_new_transactions(db):
    db.close()
    with pytest.raises(CkptError, match="closed"), db.read():
        pass


def _raw(url, tmp_path, statements):
    """Run SQL on the database as another program would, without ckptstore."""
    if url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as connection:
            for statement in statements:
                connection.execute(statement)
        return url
    import sqlite3

    connection = sqlite3.connect(tmp_path / "other.db")
    connection.executescript(";".join(statements))
    connection.close()
    return f"sqlite:///{tmp_path / 'other.db'}"


@pytest.mark.parametrize("statements, said", [
    (["CREATE TABLE users (id INTEGER)", "CREATE TABLE sessions (id INTEGER)"], "another program's tables"),
    (["CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)", "CREATE TABLE users (id INTEGER)",
      "INSERT INTO alembic_version VALUES ('3f2a1b9c8d7e')"], "another program's schema revision '3f2a1b9c8d7e'"),
    (["CREATE TABLE refs (id INTEGER, url TEXT)"], r"damaged \(or another program's\): it has tables \(refs\)"),
])
def test_another_programs_database_is_refused_as_such_and_left_as_it_was(tmp_path, metadata_url, statements, said):
    url = _raw(metadata_url, tmp_path, statements)
    before = None if metadata_url else (tmp_path / "other.db").read_bytes()
    for _ in range(2):  # nothing was written: the second open sees the same
        with pytest.raises(CkptError, match=said) as refused:
            Database(url)
        assert "newer ckptstore" not in str(refused.value)
        assert ("search_path" in str(refused.value)) == bool(metadata_url) or "damaged" in said
    assert before is None or (tmp_path / "other.db").read_bytes() == before  # not even switched to WAL


def test_an_empty_revision_table_alone_is_an_empty_database(tmp_path, metadata_url):
    url = _raw(metadata_url, tmp_path, ["CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)"])
    database = Database(url)  # the schema is created in it, as in an empty one
    assert database.revision() == HEAD_REVISION
    database.close()


def test_a_newer_schemas_database_is_refused_without_a_byte_changed(tmp_path):
    import sqlite3

    Database(f"sqlite:///{tmp_path / 'ckpt.db'}").close()
    connection = sqlite3.connect(tmp_path / "ckpt.db", isolation_level=None)
    connection.execute("PRAGMA journal_mode=DELETE")  # as a newer ckptstore might keep it
    connection.execute("UPDATE alembic_version SET version_num = '9999'")
    connection.close()
    before = (tmp_path / "ckpt.db").read_bytes()
    with pytest.raises(CkptError, match="newer ckptstore"):
        Database(f"sqlite:///{tmp_path / 'ckpt.db'}")
    assert (tmp_path / "ckpt.db").read_bytes() == before


def test_a_write_transaction_held_past_the_busy_timeout_is_one_clear_line(tmp_path, monkeypatch):
    """Another process (an sqlite3 shell left open, say) holding the write lock: the command says so, not a bug."""
    import sqlite3

    import torch

    from ckptstore import Repository
    from ckptstore.metadata import sqlite as sqlite_backend
    from tests.conftest import ckpt_here

    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.ones(3)})
    holder = sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    monkeypatch.setattr(sqlite_backend, "BUSY_TIMEOUT_MS", 300)
    try:
        said = ckpt_here(tmp_path, "tag", "t1")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert said.returncode == 1 and said.stderr.count("\n") == 1, said.stderr
    assert "another process has held a write transaction on" in said.stderr and "please report" not in said.stderr
    assert ckpt_here(tmp_path, "tag", "t1").returncode == 0  # the lock was the only problem
