"""Schema creation and upgrades through Alembic: the only place SQLAlchemy is imported at run time.

A repository's database is upgraded when it is opened by a newer ckptstore; the upgrade runs in
one write transaction, so a crash leaves the old schema whole. On PostgreSQL that transaction
first takes the writers' advisory lock: processes opening an empty database at once queue, and
each after the first finds the schema made (DDL is transactional there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from sqlalchemy import URL, Connection, Engine, create_engine, event
from sqlalchemy.pool import NullPool

from ckptstore.metadata.db import BUSY_TIMEOUT_MS, POSTGRES_SCHEMES
from ckptstore.metadata.sqlite import PREFIX as SQLITE_PREFIX
from ckptstore.metadata.sqlite import sqlite_path


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def _postgres_begin(conn: Connection) -> None:
    from ckptstore.metadata.postgres import LOCK_WAIT, WRITE_LOCK, schema_key

    # bounded as a writer's wait is: an upgrade behind a teammate's stalled transaction waited forever, silent
    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({schema_key(WRITE_LOCK)})")  # the schema's, as writers


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine for `url`.

    SQLite gets WAL, a busy timeout and immediate transactions; PostgreSQL (driven by psycopg 3,
    whatever driver the URL names) takes the writers' advisory lock first in every transaction.
    """
    if url.startswith(POSTGRES_SCHEMES):
        from ckptstore.metadata.postgres import sqlalchemy_url

        engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
        event.listen(engine, "begin", _postgres_begin)
        return engine
    if url.startswith(SQLITE_PREFIX):  # the path as it is: SQLAlchemy's parser takes "?" for a query, decodes %XX
        url = URL.create("sqlite", database=str(sqlite_path(url)))
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
    return engine


@contextlib.contextmanager
def _engine(url: str) -> Iterator[Engine]:
    engine = make_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def migrations_dir() -> Path:
    """The Alembic scripts: the source tree's migrations/ beside this package, else the packaged copy.

    The source tree comes first: an editable install maps ckptstore.migrations to the checkout it
    was made from, which another checkout of the code must not migrate with.
    """
    tree = Path(__file__).resolve().parents[2] / "migrations"
    if (tree / "env.py").is_file():
        return tree
    return Path(str(resources.files("ckptstore.migrations")))


def _alembic_config(conn: Connection):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["connection"] = conn
    return config


def upgrade(url: str, revision: str = "head") -> str | None:
    """Bring the schema at `url` to `revision` (default: the newest), inside one write transaction.

    Returns the revision it found under the writers' lock (None: empty), which another process's upgrade
    may have changed since the caller looked.
    """
    from alembic import command
    from sqlalchemy import inspect

    with _engine(url) as engine, engine.connect() as conn, conn.begin():
        found = (conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
                 if inspect(conn).has_table("alembic_version") else None)
        command.upgrade(_alembic_config(conn), revision)
    return found


def downgrade(url: str, revision: str) -> None:
    """Take the schema at `url` back to `revision`, inside one write transaction (tests, and undoing an upgrade)."""
    from alembic import command

    with _engine(url) as engine, engine.connect() as conn, conn.begin():
        command.downgrade(_alembic_config(conn), revision)


def head_revision() -> str:
    """The newest revision among the migration scripts."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(migrations_dir())).get_current_head()
