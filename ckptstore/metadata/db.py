"""The metadata database: connections, transactions and the schema check on open.

SQLite is reached through the standard library's driver: every command a user runs opens the
database, and importing SQLAlchemy alone took longer than `ckpt log`'s whole work. SQLAlchemy and
Alembic are imported only when the schema has to be created or upgraded (metadata/migrate.py).
Statements are written with "?" placeholders (a driver of another style will need them translated).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ckptstore.errors import CkptError, CorruptDatabaseError, ReadOnlyRepoError, disk_full, explain

BUSY_TIMEOUT_MS = 120_000
HEAD_REVISION = "0007"  # the newest migration in migrations/versions; a test keeps the two in step
KNOWN_REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007")
LOW_SPACE = 1 << 20  # free bytes under which an I/O error writing the database means "disk full"
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
        self.rows_in(sql, ids)

    def insert_ignore(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Insert rows, skipping those whose primary key exists (content-addressed rows never change).

        Rows go in sorted by their leading columns (where every table's key starts), so a batch
        appends to B-tree pages in order instead of splitting pages at random.
        """
        names = ", ".join(f'"{c}"' for c in columns)
        self.executemany(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))}) "
                         "ON CONFLICT DO NOTHING", sorted(rows, key=lambda row: tuple(row[:2])))


class Database:
    """The metadata of one repository, at a SQLite path.

    `read()` gives a consistent snapshot; `write()` takes the write lock up front, so two
    committers queue instead of failing halfway. Connections are pooled: a transaction takes an
    idle one (or opens one) and gives it back when it ends, so any number of threads share as
    many connections as run transactions at once. `read_only` (`why` says for what reason)
    opens without writing anything, not even the WAL setting or a schema upgrade; `write()` then
    refuses.
    """

    def __init__(self, url: str, read_only: bool = False, why: str = "") -> None:
        self.url = url
        self.path = sqlite_path(url)
        self.read_only = read_only
        self.why = why or "opened read-only"
        self._idle: list[sqlite3.Connection] = []
        self._guard = threading.Lock()
        self._writing = threading.local()
        self._closed = False
        self.check_schema()

    def _acquire(self) -> sqlite3.Connection:
        with self._guard:
            if self._closed:
                raise CkptError(f"the metadata database {self.url} was closed")
            if self._idle:
                return self._idle.pop()
        return connect_sqlite(self.path, self.read_only)

    def _release(self, connection: sqlite3.Connection) -> None:
        # an immutable connection never sees a writer's later commits: read-only, open anew each time
        reusable = not (self.read_only and "immutable=1" in read_only_uri(self.path))
        with self._guard:
            if not self._closed and reusable:
                self._idle.append(connection)
                return
        connection.close()

    def _explained(self, exc: sqlite3.Error) -> CkptError | None:
        """SQLite's error as the user's problem (a full disk, a read-only file), or None.

        SQLite reports a full disk as "disk I/O error" when the WAL's shared memory cannot grow.
        """
        if isinstance(exc, sqlite3.OperationalError) and "disk i/o error" in str(exc).lower():
            import shutil  # only here: it imports the compression modules

            with contextlib.suppress(OSError):
                if shutil.disk_usage(self.path.parent).free < LOW_SPACE:
                    return disk_full(f"SQLite: {exc} writing {self.path}")
        return explain(exc)

    @contextlib.contextmanager
    def _transaction(self, begin: str) -> Iterator[Tx]:
        try:
            with self._raw_transaction(begin) as tx:
                yield tx
        except sqlite3.Error as exc:
            known = self._explained(exc)
            if known is None:
                raise
            raise known from exc

    @contextlib.contextmanager
    def _raw_transaction(self, begin: str) -> Iterator[Tx]:
        connection = self._acquire()
        try:
            connection.execute(begin)
            try:
                yield Tx(connection)
            except BaseException:
                connection.rollback()
                raise
            connection.commit()
        finally:
            if connection.in_transaction:  # the commit itself failed (disk full, I/O error)
                connection.rollback()
            self._release(connection)

    def refuse_writes(self, what: str = "this command") -> None:
        """Raise ReadOnlyRepoError when the database was opened read-only."""
        if self.read_only:
            raise ReadOnlyRepoError(
                f"{what} would write to the repository at {self.path.parent.parent}, which is read-only here "
                f"({self.why}); reading commands (log, show, status, diff, stats, fsck, checkout -o) still work"
            )

    @contextlib.contextmanager
    def _write(self) -> Iterator[Tx]:
        self.refuse_writes()
        if getattr(self._writing, "active", False):
            raise CkptError("a metadata write transaction was opened inside another in the same thread; "
                            "it would wait for itself (a bug in ckptstore: please report it)")
        self._writing.active = True
        try:
            with self._transaction("BEGIN IMMEDIATE") as tx:
                yield tx
        finally:
            self._writing.active = False

    def read(self) -> contextlib.AbstractContextManager[Tx]:
        """A read-only snapshot of the metadata, for the length of the block."""
        return self._damage_named(self._transaction("BEGIN"))

    def write(self) -> contextlib.AbstractContextManager[Tx]:
        """One serialized read-write transaction; commits on success, rolls back on any error."""
        return self._damage_named(self._write())

    @contextlib.contextmanager
    def _damage_named(self, transaction: contextlib.AbstractContextManager[Tx]) -> Iterator[Tx]:
        """`transaction`, with SQLite's reports of a damaged file raised as CorruptDatabaseError."""
        try:
            with transaction as tx:
                yield tx
        except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
            if not is_damage(exc):
                raise
            if "disk i/o error" in str(exc).lower():  # a failing disk or file system, or a damaged file: not known
                raise CorruptDatabaseError(
                    f"the metadata database {self.path} could not be read or written (SQLite: {exc}); nothing was "
                    "changed. Check the disk and file system (space, mount, permissions) and run it again; if it "
                    "persists, `ckpt fsck` says whether the file is damaged") from None
            raise CorruptDatabaseError(f"the metadata database {self.path} is damaged (SQLite: {exc}); nothing was "
                                       "changed. Restore .ckpt/ckpt.db from a backup; `ckpt fsck` lists what the "
                                       "objects still hold once it opens") from None

    def revision(self) -> str | None:
        """The schema revision the database is at, or None for an empty database."""
        with self.read() as tx:
            found = None
            if tx.first("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"):
                found = tx.scalar("SELECT version_num FROM alembic_version")
            if found is None and tx.first("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'commits'"):
                # tables without a revision: damage, not an empty database to create the schema in
                raise CorruptDatabaseError(f"the metadata database {self.path} is damaged: it has tables but no "
                                           "schema revision. Restore .ckpt/ckpt.db from a backup")
            return found

    def check_schema(self) -> None:
        """Bring an empty or older database to HEAD_REVISION; refuse one a newer ckptstore wrote."""
        current = self.revision()
        if current == HEAD_REVISION:
            return
        if current is not None and current not in KNOWN_REVISIONS:
            raise CkptError(f"{self.url} has metadata schema {current!r}, written by a newer ckptstore; "
                            "upgrade ckptstore to open it")
        if self.read_only:
            raise ReadOnlyRepoError(f"{self.url} has metadata schema {current!r}, older than this ckptstore's "
                                    f"{HEAD_REVISION!r}, and is read-only here ({self.why}); open it once where it "
                                    "can be written to upgrade it, or use the ckptstore that wrote it")
        from ckptstore.metadata.migrate import upgrade

        upgrade(self.url)

    def size_on_disk(self) -> int:
        """Bytes the database takes on disk: its file and the write-ahead log beside it."""
        files = (self.path, self.path.with_name(self.path.name + "-wal"))
        return sum(f.stat().st_size for f in files if f.exists())

    def close(self) -> None:
        """Close the idle connections; one still in a transaction closes when it ends."""
        with self._guard:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def sqlite_path(url: str) -> Path:
    """The file a `sqlite:///PATH` URL names; other databases are refused with a clear error."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise CkptError(f"metadata URL {url!r} is not supported yet; use sqlite:///PATH (PostgreSQL comes next)")
    return Path(url[len(prefix) :])


def read_only_uri(path: Path) -> str:
    """The URI that opens `path` without writing to it.

    `mode=ro` where SQLite can share the WAL with writers (its -wal file exists, or the folder
    is writable, where SQLite creates the -wal and -shm files it reads through); otherwise no
    writer can be connected (it would have created the -wal file), so the file is read as
    immutable: SQLite cannot open a WAL database read-only in a folder it cannot write.
    """
    wal = path.with_name(path.name + "-wal")
    shared = wal.exists() or os.access(path.parent, os.W_OK)
    return f"{path.resolve().as_uri()}?{'mode=ro' if shared else 'immutable=1'}"


def connect_sqlite(path: Path, read_only: bool = False) -> sqlite3.Connection:
    """A connection in WAL mode with full sync, a long busy timeout and explicit transactions.

    Read-only, it sets nothing that writes: the database is in WAL mode since it was created.
    """
    target = read_only_uri(path) if read_only else path
    connection = sqlite3.connect(target, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                 check_same_thread=False, uri=read_only)
    connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    if read_only:
        return connection
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    return connection


# "no such column/table": the schema was checked on open, so a table or column it lacks now is damage
_DAMAGE_WORDS = ("malformed", "not a database", "could not decode", "disk i/o error", "corrupt", "no such column",
                 "no such table")


def is_damage(exc: BaseException) -> bool:
    """True for SQLite's (or its text decoding's) report of a damaged database file."""
    if isinstance(exc, UnicodeDecodeError):
        return True
    return not isinstance(exc, sqlite3.IntegrityError) and any(w in str(exc).lower() for w in _DAMAGE_WORDS)
