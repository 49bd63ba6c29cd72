"""The metadata database: connections, transactions and the schema check on open.

SQLite is reached through the standard library's driver: every command a user runs opens the
database, and importing SQLAlchemy alone took longer than `ckpt log`'s whole work. SQLAlchemy and
Alembic are imported only when the schema has to be created or upgraded (metadata/migrate.py).
Statements are written with "?" placeholders; `Tx` translates them for drivers of another style.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptstore.errors import CkptError

BUSY_TIMEOUT_MS = 120_000
HEAD_REVISION = "0006"  # the newest migration in migrations/versions; a test keeps the two in step
KNOWN_REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006")
BATCH = 500  # ids per IN (...) list: SQLite allows 32766 parameters, PostgreSQL 65535


class Tx:
    """One open transaction: run statements, read rows."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._connection.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._connection.executemany(sql, rows)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._connection.execute(sql, params).fetchall()

    def first(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        return self._connection.execute(sql, params).fetchone()

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        row = self.first(sql, params)
        return row[0] if row else None

    def column(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return [row[0] for row in self._connection.execute(sql, params)]

    def rows_in(self, sql: str, ids: Iterable[str], params: Sequence[Any] = ()) -> list[tuple]:
        """`sql` with `{ids}` standing for a list of placeholders, run over `ids` in batches."""
        ids = list(ids)
        found: list[tuple] = []
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            found += self.rows(sql.format(ids=", ".join("?" * len(batch))), [*params, *batch])
        return found

    def execute_in(self, sql: str, ids: Iterable[str]) -> None:
        """Run a statement with `{ids}` in it over `ids` in batches (deletes by id)."""
        ids = list(ids)
        for start in range(0, len(ids), BATCH):
            batch = ids[start : start + BATCH]
            self.execute(sql.format(ids=", ".join("?" * len(batch))), batch)


class Database:
    """The metadata of one repository, at a SQLite path; connections are kept per thread.

    `read()` gives a consistent snapshot; `write()` takes the write lock up front, so two
    committers queue instead of failing halfway.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = sqlite_path(url)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._guard = threading.Lock()
        self.check_schema()

    def _connection(self) -> sqlite3.Connection:
        """An idle connection of this thread's: a transaction opened inside another gets one of its own."""
        mine = getattr(self._local, "connections", None)
        if mine is None:
            mine = self._local.connections = []
        for connection in mine:
            if not connection.in_transaction:
                return connection
        connection = connect_sqlite(self.path)
        mine.append(connection)
        with self._guard:
            self._connections.append(connection)
        return connection

    @contextlib.contextmanager
    def _transaction(self, begin: str) -> Iterator[Tx]:
        connection = self._connection()
        connection.execute(begin)
        try:
            yield Tx(connection)
        except BaseException:
            connection.rollback()
            raise
        connection.commit()

    def read(self) -> contextlib.AbstractContextManager[Tx]:
        """A read-only snapshot of the metadata, for the length of the block."""
        return self._transaction("BEGIN")

    def write(self) -> contextlib.AbstractContextManager[Tx]:
        """One serialized read-write transaction; commits on success, rolls back on any error."""
        return self._transaction("BEGIN IMMEDIATE")

    def revision(self) -> str | None:
        """The schema revision the database is at, or None for an empty database."""
        with self.read() as tx:
            if not tx.first("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"):
                return None
            return tx.scalar("SELECT version_num FROM alembic_version")

    def check_schema(self) -> None:
        """Bring an empty or older database to HEAD_REVISION; refuse one a newer ckptstore wrote."""
        current = self.revision()
        if current == HEAD_REVISION:
            return
        if current is not None and current not in KNOWN_REVISIONS:
            raise CkptError(f"{self.url} has metadata schema {current!r}, written by a newer ckptstore; "
                            "upgrade ckptstore to open it")
        from ckptstore.metadata.migrate import upgrade

        upgrade(self.url)

    def close(self) -> None:
        with self._guard:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()
        self._local = threading.local()


def sqlite_path(url: str) -> Path:
    """The file a `sqlite:///PATH` URL names; other databases are refused with a clear error."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise CkptError(f"metadata URL {url!r} is not supported yet; use sqlite:///PATH (PostgreSQL comes next)")
    return Path(url[len(prefix) :])


def connect_sqlite(path: Path) -> sqlite3.Connection:
    """A connection in WAL mode with full sync, a long busy timeout and explicit transactions."""
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                 check_same_thread=False)
    connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    return connection
