"""Engine set-up and schema upgrades: SQLite in WAL mode by default, any SQLAlchemy URL allowed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, inspect

BUSY_TIMEOUT_MS = 120_000


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # Writers take the write lock up front, so two committers queue instead of failing midway.
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("write") else "BEGIN")


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and immediate write transactions."""
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
    return engine


@contextlib.contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """One serialized read-write transaction; commits on success, rolls back on any error."""
    with engine.connect().execution_options(write=True) as conn, conn.begin():
        yield conn


def migrations_dir() -> Path:
    """The Alembic scripts: packaged as ckptstore.migrations, or the source tree's migrations/."""
    try:
        return Path(str(resources.files("ckptstore.migrations")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(conn: Connection):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["connection"] = conn
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (default: the newest), inside one write transaction."""
    from alembic import command

    with write_transaction(engine) as conn:
        command.upgrade(alembic_config(conn), revision)


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database is at, or None for an empty database."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return MigrationContext.configure(conn).get_current_revision()
