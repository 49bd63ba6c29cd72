"""The metadata database: connections, transactions and the schema check on open.

`Database` is the same for every engine; a backend (metadata/sqlite.py, metadata/postgres.py)
says how to connect, begin, and read the engine's errors. SQLite is reached through the standard
library's driver: every command a user runs opens the database, and importing SQLAlchemy alone
took longer than `ckpt log`'s whole work. PostgreSQL goes through psycopg, imported only when a
`postgresql://` URL is opened. SQLAlchemy and Alembic are imported only when the schema has to be
created or upgraded (metadata/migrate.py). Statements are written with "?" placeholders; the
PostgreSQL backend translates them.
"""

from __future__ import annotations

import _thread
import contextlib
import math
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ckptstore import faults
from ckptstore.errors import (
    CkptError,
    CorruptDatabaseError,
    LostLockError,
    MissingDatabaseError,
    ReadOnlyRepoError,
    RepoLockedError,
    listing,
    no_inodes_left,
    no_more_files,
)
from ckptstore.metadata.sqlite import (
    BUSY_TIMEOUT_MS,
    SqliteBackend,
    connect_sqlite,
    is_damage,
    read_only_uri,
    sqlite_path,
)
from ckptstore.metadata.tables import TABLES

__all__ = ["BATCH", "BUSY_TIMEOUT_MS", "HEAD_REVISION", "KNOWN_REVISIONS", "Backend", "Database", "Tx",
           "connect_sqlite", "is_damage", "open_backend", "read_only_uri", "sqlite_path"]

HEAD_REVISION = "0012"  # the newest migration in migrations/versions; a test keeps the two in step
KNOWN_REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011",
                   "0012")
# revisions a read-only open reads as they are: their tables are HEAD_REVISION's but for those tables.SINCE lists,
# which only writers read (0010 changed no table; 0011 added the identity a join or a gc checks; 0012 gc's lease)
READS_AS_HEAD = ("0009", "0010", "0011")
LEASE_POLL_S = 10.0  # how often a wait for gc's delete lease reads it again (its session kept busy meanwhile)
BATCH = 500  # ids per IN (...) list: SQLite allows 32766 parameters, PostgreSQL 65535
RETRY_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6)  # seconds between tries to begin a transaction (a server restarting)
POSTGRES_SCHEMES = ("postgresql://", "postgresql+psycopg://", "postgres://")
T = TypeVar("T")
_OPEN: weakref.WeakSet[Database] = weakref.WeakSet()
_INHERITED: list[Any] = []  # a forked child's copies of its parent's connections: never used, never closed
# SQLite keeps its locks' bookkeeping per process: a fork during a write transaction copies it "held", and the
# child could never write. A fork waits (at most FORK_WAIT_S) for the SQLite write locks held to be let go.
FORK_WAIT_S = 30.0
_FORKING = threading.Condition()
_WRITING: dict[int, int] = {}  # thread id -> the write transactions it has open
_AT_FORK = threading.local()  # the forking thread's: whether its before-fork hook holds _FORKING, was interrupted


class Backend(Protocol):
    """What `Database` needs of an engine: connections, transaction control, and its errors explained."""

    name: str  # "sqlite" or "postgresql"
    where: str  # the database as messages name it (a path, or a server and database; never a password)
    errors: tuple[type[BaseException], ...]  # the driver's errors
    damage_errors: tuple[type[BaseException], ...]  # errors that may report a damaged database

    def connect(self) -> Any: ...
    def reusable(self, connection: Any) -> bool: ...
    def begin(self, connection: Any, write: bool) -> None: ...
    def allow_idle(self, connection: Any) -> None: ...
    def commit(self, connection: Any, write: bool) -> None: ...
    def rollback(self, connection: Any) -> None: ...
    def in_transaction(self, connection: Any) -> bool: ...
    def transient(self, exc: BaseException) -> bool: ...
    def prepare(self, sql: str) -> str: ...
    def explain(self, exc: BaseException) -> CkptError | None: ...
    def damage(self, exc: BaseException) -> CkptError | None: ...
    def tables(self, tx: Tx) -> set[str]: ...
    def accepted(self, db: Database) -> None: ...
    def own_place(self) -> str: ...
    def storage_problems(self, tx: Tx, limit: int) -> list[str]: ...
    def size_on_disk(self, db: Database) -> int: ...
    def executemany(self, connection: Any, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...
    repository_locks: bool
    def lock_repository(self, connection: Any, exclusive: bool, wait: bool) -> bool: ...
    def renew_gc_lease(self, connection: Any, seconds: float) -> float: ...
    def end_gc_lease(self, connection: Any, written: float) -> bool: ...
    def gc_lease_left(self, connection: Any) -> float: ...
    def no_revision(self) -> str: ...
    def repository(self) -> str: ...


# PostgreSQL's duplicate table, column and object (an index); SQLite says so in words only
_DUPLICATE_STATES = {"42P07", "42701", "42710"}
_MISSING_STATES = {"42P01", "42703"}  # undefined table, undefined column


def _tables_refused(exc: BaseException) -> str | None:
    """What a failed upgrade met: "newer", "missing" or None (something else: not the tables' doing).

    "newer": a table, column or index its steps make was there already; "missing": one an older revision made was not.
    """
    driver = getattr(exc, "orig", None) or exc
    state, text = getattr(driver, "sqlstate", None), str(driver).lower()
    if state in _DUPLICATE_STATES or state is None and (text.startswith(("table ", "index ")) and
                                                        "already exists" in text or "duplicate column" in text):
        return "newer"
    if state in _MISSING_STATES or state is None and text.startswith(("no such table", "no such column")):
        return "missing"
    return None


def shown_url(url: str) -> str:
    """A metadata URL as messages and listings show it: a PostgreSQL one without its password (postgres.describe)."""
    if not url.startswith(POSTGRES_SCHEMES):
        return url
    from ckptstore.metadata.postgres import describe

    try:
        return describe(url)
    except CkptError:  # not a URL libpq reads: not shown, as it may still hold a password
        return f"{url.partition('://')[0]}://(a URL libpq does not read; not shown)"


def open_backend(url: str, read_only: bool = False) -> Backend:
    """The backend for a metadata URL: `sqlite:///PATH` or `postgresql://USER@HOST:PORT/DB` (psycopg)."""
    if url.startswith(POSTGRES_SCHEMES):
        from ckptstore.metadata.postgres import PostgresBackend  # psycopg only for a server's URL

        return PostgresBackend(url, read_only)
    return SqliteBackend(url, read_only)


ORIGIN = "_ckpt_backend"  # the attribute a driver error carries: the backend of the transaction that raised it


class _Marking:
    """A block whose driver errors are marked with `backend` (ORIGIN), unless a statement nearer to them said so.

    A class, not a generator: it wraps every statement a transaction runs.
    """

    __slots__ = ("_backend", "_errors")

    def __init__(self, backend: Backend) -> None:
        self._backend, self._errors = backend, (*backend.errors, *backend.damage_errors)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> bool:
        if isinstance(exc, self._errors) and not hasattr(exc, ORIGIN):
            setattr(exc, ORIGIN, self._backend)
        return False


class Tx:
    """One open transaction: run statements, read rows.

    A driver error raised here is marked with this transaction's backend (ORIGIN): a transaction
    opened inside another database's (push and fetch read both) is then not taken for that one's.
    """

    def __init__(self, connection: Any, backend: Backend) -> None:
        self._connection = connection
        self.backend = backend
        self._marking = _Marking(backend)
        self._may_idle = False

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with self._marking:
            return self._connection.execute(self.backend.prepare(sql), params)

    def may_idle(self) -> None:
        """This write transaction reads the object store between statements: no idle limit ends it (PostgreSQL).

        Once per transaction: each function that reads the store in one may say so without a round trip more.
        """
        if self._may_idle:
            return
        with self._marking:
            self.backend.allow_idle(self._connection)
        self._may_idle = True

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._marking:
            self.backend.executemany(self._connection, self.backend.prepare(sql), rows)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        with self._marking:  # fetching reads the pages: where a damaged one is found
            return self.execute(sql, params).fetchall()

    def first(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        with self._marking:
            return self.execute(sql, params).fetchone()

    def scalar(self, sql: str, params: Sequence[Any] = ()) -> Any:
        row = self.first(sql, params)
        return row[0] if row else None

    def column(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return [row[0] for row in self.rows(sql, params)]

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

    def insert_ignore(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Insert rows, skipping those whose primary key exists (content-addressed rows never change).

        Rows go in sorted by their leading columns (where every table's key starts), so a batch
        appends to B-tree pages in order instead of splitting pages at random.
        """
        names = ", ".join(f'"{c}"' for c in columns)
        self.executemany(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))}) "
                         "ON CONFLICT DO NOTHING", sorted(rows, key=lambda row: tuple(row[:2])))


class Database:
    """The metadata of one repository: a SQLite file, or a database on a PostgreSQL server.

    `read()` gives a consistent snapshot; `write()` takes the write lock up front, so two
    committers queue instead of failing halfway. Connections are pooled: a transaction takes an
    idle one (or opens one) and gives it back when it ends, so any number of threads share as
    many connections as run transactions at once. `read_only` (`why` says for what reason)
    opens without writing anything, not even the WAL setting or a schema upgrade; `write()` then
    refuses. Beginning a transaction is retried while the engine says the failure is transient
    (a server restarting, a connection dropped while idle): nothing has run in it yet.
    """

    def __init__(self, url: str, read_only: bool = False, why: str = "", create: bool = True) -> None:
        self.url = url
        self.backend = open_backend(url, read_only)
        self.path: Path | None = getattr(self.backend, "path", None)  # the SQLite file; None on a server
        self.where = self.backend.where
        self.read_only = read_only
        self.why = why or "opened read-only"
        self._idle: list[Any] = []
        self._guard = threading.Lock()
        self._writing = threading.local()
        self._lock_sessions: list[Any] = []  # the sessions holding repository_lock now
        self._held_alone: list[Any] = []  # those of them holding it exclusively (gc, prune): they renew gc's lease
        self._lease_written: float | None = None  # gc's delete lease as this process last set it (none: not yet)
        self._closed = False
        self._create = create
        _OPEN.add(self)
        try:
            if not create and self.path is not None and not self.path.exists():
                raise self._missing("is missing")
            if not create and self.path is not None and self.path.stat().st_size == 0:  # before SQLite writes a header
                raise self._missing("holds no schema (it is empty)")
            self.check_schema()
            # read-only while it lasts (sqlite.py); one opened read-only stays so
            self._full = not read_only and getattr(self.backend, "disk_full", False)
            if self._full:  # bytes, or inodes: there freeing bytes would not help
                held = no_inodes_left(self.path)
                full = no_more_files(held) if held else f"the disk is full where {self.where} is"
                self.read_only, self.why = True, f"{full}; nothing was lost"
        except BaseException:
            self.close()  # no connection outlives a database that failed to open
            raise

    def _forget_parents_connections(self) -> None:
        """In a forked child (a DataLoader worker): the connections and the lock sessions are the parent's.

        SQLite's rule is never to use (or close) a connection across fork, and a server's socket is
        shared with the parent: the child keeps them untouched and connects anew. A lock another
        thread held at the fork would never be released here: the child gets fresh ones.
        """
        _INHERITED.extend([*self._idle, *self._lock_sessions])
        self._idle, self._lock_sessions, self._held_alone = [], [], []
        self._guard, self._writing = threading.Lock(), threading.local()

    def _acquire(self) -> Any:
        with self._guard:
            if self._closed:
                raise CkptError(f"the metadata database {self.where} was closed")
            if self._idle:
                return self._idle.pop()
        return self.backend.connect()

    def _release(self, connection: Any) -> None:
        reusable = self.backend.reusable(connection)
        with self._guard:
            if not self._closed and reusable:
                self._idle.append(connection)
                return
        with contextlib.suppress(*self.backend.errors):
            connection.close()

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again with backoff while the engine calls its failure transient."""
        for delay in (*RETRY_DELAYS, None):
            try:
                return attempt()
            except self.backend.errors as exc:
                if delay is None or not self.backend.transient(exc):
                    raise
                with self._guard:  # the server restarted: every idle connection is as dead as the one that failed
                    stale, self._idle = self._idle, []
                for old in stale:
                    with contextlib.suppress(*self.backend.errors):
                        old.close()
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _begin(self, write: bool) -> Any:
        """A connection with a transaction begun on it; transient failures are retried (nothing ran in it yet)."""
        def attempt() -> Any:
            connection = self._acquire()
            try:
                self.backend.begin(connection, write)
            except BaseException:
                if self.backend.in_transaction(connection):
                    with contextlib.suppress(*self.backend.errors):
                        self.backend.rollback(connection)
                self._release(connection)
                raise
            return connection

        return self._retrying(attempt)

    @contextlib.contextmanager
    def repository_lock(self, exclusive: bool = False, wait: bool = True) -> Iterator[None]:
        """The repository lock on the database itself, for every machine that shares it: commits shared, gc alone.

        A SQLite repository has its file lock (repo/lock.py) and needs nothing more. On a server
        the lock lives in a session of its own, so it goes when the process does, as a flock would.
        """
        if not self.backend.repository_locks:
            yield
            return
        connection = None
        try:
            connection = self._retrying(self.backend.connect)
            held = self.backend.lock_repository(connection, exclusive, wait)
        except self.backend.errors as exc:
            if connection is not None:
                connection.close()
            raise (self.backend.explain(exc) or CkptError(f"cannot take the repository lock on {self.where}: "
                                                          f"{exc}")) from exc
        try:
            if not held:
                raise RepoLockedError(f"{self.where} is busy: a ckpt process (here or on another machine sharing it) "
                                      "is committing or collecting garbage; try again when it finishes")
            self._lock_sessions.append(connection)
            if exclusive:
                self._held_alone.append(connection)
            self._wait_out_gc_lease(connection)
            yield
        finally:
            for held_by in (self._lock_sessions, self._held_alone):
                with contextlib.suppress(ValueError):
                    held_by.remove(connection)
            with contextlib.suppress(*self.backend.errors):
                connection.close()  # ending the session releases the lock

    def confirm_locks(self, deleting: bool = False, deleted: str | None = None, lease_s: float | None = None) -> None:
        """Every repository lock this process took is still held: before a write commits, and around gc's deletes.

        A session cut while idle (the server restarted, an operator or a timeout ended it) lets a gc
        on another machine delete what this command wrote; its record must then not be written.
        A gc whose lock went may be deleting an object that a commit elsewhere has just found
        present and will not upload again (`deleting`): it must stop, and say which object it was
        deleting then (`deleted`, a delete retried against a throttling store can last minutes).
        `lease_s`: in the same round trip, on the exclusive lock's own session (one that ended cannot), gc's
        delete lease is set to the database's clock plus that: what a delete sent next may take to land (0: its
        deletes ended). Whoever takes the lock while the lease is live waits it out (`_wait_out_gc_lease`).
        gc passes it only with no delete in flight (before one is sent, after the last returned): a lock found
        lost then has its lease ended from a fresh session (`_end_lost_gc_lease`), or every writer waits minutes.
        """
        for connection in list(self._lock_sessions):
            try:
                if lease_s is not None and connection in self._held_alone:
                    self._lease_written = self.backend.renew_gc_lease(connection, lease_s)
                else:
                    connection.execute("SELECT 1")
            except self.backend.errors as exc:
                ended = f"its session ended: {' '.join(str(exc).split())[:160]}"
                if deleting:
                    risk = ""
                    if lease_s is not None and self._end_lost_gc_lease():
                        risk = " No delete it sent is in flight and its delete lease was ended: commits elsewhere " \
                               "do not wait."
                    elif lease_s is not None:  # its lease holds them off: no delete it sent lands after they look
                        risk = " Commits elsewhere wait until a delete it sent can no longer land, so none loses it."
                    elif deleted:  # a local folder's: no lease
                        risk = (f" A commit made elsewhere while object {deleted} was being deleted may need it: run "
                                "`ckpt fsck`, and commit again the files of a commit it names broken.")
                    raise LostLockError(f"lost the repository lock on {self.where} while deleting unreachable objects "
                                        f"({ended}); deleting stopped.{risk} Run the command again to finish",
                                        ended, deleting=True) from None
                raise LostLockError(f"lost the repository lock on {self.where} while this command ran ({ended}); a "
                                    "gc elsewhere may have removed what it wrote, so nothing was recorded: run the "
                                    "command again", ended) from None

    def _end_lost_gc_lease(self) -> bool:
        """End gc's delete lease from a fresh session, its lock's session gone and no delete in flight: whether it did.

        Only if it still holds what this process last set: a renewal whose answer was lost (it may have set a
        value never seen here) or another gc that took the lock since wrote one not ours to end. Best effort:
        a server out of reach leaves it to run out, which only costs writers a wait.
        """
        if self._lease_written is None:
            return False
        try:
            with contextlib.closing(self.backend.connect()) as connection:
                if not self.backend.end_gc_lease(connection, self._lease_written):
                    return False
        except self.backend.errors:
            return False
        self._lease_written = 0.0  # what it holds now: a second try says it is ended still, unless rewritten
        return True

    def _wait_out_gc_lease(self, connection: Any) -> None:
        """With the repository lock just taken: wait while a gc that stopped mid-delete may still have one in flight.

        gc renews its lease before each delete, on its lock's own session (`confirm_locks`); one whose session
        ended meanwhile (a restart, an idle timeout), or that was stopped during a delete (Ctrl-C, an error out
        of it), may have a delete retried against a throttling bucket that lands minutes later, removing an
        object this command would find present (and not upload) or upload anew.
        Once the lease ends no such delete can land, and none renews it while we hold the lock: the wait is
        bounded by what is read now. One query; no wait unless a gc lost its lock.
        """
        try:
            left = self.backend.gc_lease_left(connection)
            if left <= 0:
                return
            from ckptstore.warn import warn_caller

            warn_caller(f"waiting {math.ceil(left)} s before going on: a gc on {self.where} stopped while deleting "
                        "unreachable objects (its lock lost, or the command interrupted mid-delete), and a delete it "
                        "sent may land until then; this command then goes on by itself")
            faults.point("lock:gc-lease-wait")
            while left > 0:
                time.sleep(min(left, LEASE_POLL_S))
                left = self.backend.gc_lease_left(connection)
        except self.backend.errors as exc:
            raise (self.backend.explain(exc) or CkptError(f"cannot read gc's delete lease on {self.where}: "
                                                          f"{' '.join(str(exc).split())[:160]}")) from exc

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[Tx]:
        """A transaction; the engine's errors come out as CkptError where their cause is known.

        Only errors of this database: one marked as another's (Tx) passes through untouched, or a push's
        damaged sender was reported as its healthy receiver, to be restored from a backup.
        """
        try:
            with self._raw_transaction(write) as tx:
                yield tx
        except (*self.backend.errors, *self.backend.damage_errors) as exc:
            if getattr(exc, ORIGIN, self.backend) is not self.backend:
                raise  # another database's, read inside this transaction's block: its own transaction says so
            known = self.backend.explain(exc) if isinstance(exc, self.backend.errors) else None
            if known is not None:
                raise known from exc
            damage = self.backend.damage(exc) if isinstance(exc, self.backend.damage_errors) else None
            if damage is None:
                raise
            raise damage from None

    @contextlib.contextmanager
    def _raw_transaction(self, write: bool) -> Iterator[Tx]:
        connection = self._begin(write)
        # SQLite's write lock is held from here: a fork waits until it is let go (`_before_fork`)
        held = _holding_write() if write and self.path is not None else contextlib.nullcontext()
        try:
            with held:
                try:
                    yield Tx(connection, self.backend)
                except BaseException:
                    self.backend.rollback(connection)
                    raise
                self.backend.commit(connection, write)
        finally:
            if self.backend.in_transaction(connection):  # the commit itself failed (disk full, I/O error)
                with contextlib.suppress(*self.backend.errors):
                    self.backend.rollback(connection)
            self._release(connection)

    @property
    def full(self) -> bool:
        """Whether it is read-only for want of room (as it was found last: refuse_writes looks again)."""
        return self.read_only and self._full

    def refuse_writes(self, what: str = "this command") -> None:
        """Raise ReadOnlyRepoError when the database was opened read-only (or the disk is full still)."""
        if self.read_only and self._full:  # read-only for want of room: is there some now?
            self._release(self._acquire())
            self.read_only = self._full = self.backend.disk_full
        if self.read_only:
            raise ReadOnlyRepoError(
                f"{what} would write to {self.backend.repository()}, which is read-only here "
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
            with self._transaction(write=True) as tx:
                self._refuse_a_changed_schema(tx)
                yield tx
                self.confirm_locks()
        finally:
            self._writing.active = False

    def _refuse_a_changed_schema(self, tx: Tx) -> None:
        """Refuse to write once a newer ckptstore upgraded the schema after this process opened the database.

        The revision is checked on open; a process running since (a training job's background commits,
        a watch) would go on writing by the older rules. Read under the writers' lock, which an upgrade
        takes too: one primary-key read per write.
        """
        found = tx.scalar("SELECT version_num FROM alembic_version")
        if found == HEAD_REVISION:
            return
        if found in KNOWN_REVISIONS:  # older: a backup restored, or a downgrade
            raise CkptError(f"{self.where} was taken back to metadata schema {found!r} since this process opened "
                            f"it at {HEAD_REVISION!r} (a backup restored, or a downgrade), so nothing was recorded "
                            "(objects it stored are left for `ckpt gc`); start this process again, which upgrades it")
        raise CkptError(f"{self.where} has metadata schema {found!r} since this process opened it at "
                        f"{HEAD_REVISION!r}: a newer ckptstore upgraded it meanwhile, so nothing was recorded (objects "
                        "it stored are left for `ckpt gc`); upgrade ckptstore here and start this process again")

    def read(self) -> contextlib.AbstractContextManager[Tx]:
        """A read-only snapshot of the metadata, for the length of the block."""
        return self._transaction(write=False)

    def write(self) -> contextlib.AbstractContextManager[Tx]:
        """One serialized read-write transaction; commits on success, rolls back on any error."""
        return self._write()

    def revision(self) -> str | None:
        """The schema revision the database is at, or None for an empty database."""
        with self.read() as tx:
            tables = self.backend.tables(tx)
            found = tx.scalar("SELECT version_num FROM alembic_version") if "alembic_version" in tables else None
            if found is None and tables - set(TABLES):
                raise self._foreign(f"holds another program's tables ({listing(sorted(tables), 5)})")
            if found is None and tables - {"alembic_version"}:
                # our tables without a revision: damage, not an empty database to create the schema in
                raise CorruptDatabaseError(f"the metadata database {self.where} is damaged (or another program's): "
                                           f"it has tables ({listing(sorted(tables), 5)}) but no schema revision. "
                                           f"{self.backend.no_revision()}")
            return found

    def check_schema(self) -> None:
        """Bring an empty or older database to HEAD_REVISION; refuse one a newer ckptstore wrote.

        `made` says afterwards whether this client made the schema (an empty database), not found one.
        """
        self.made = False
        current = self.revision()
        if current == HEAD_REVISION or self.read_only and current in READS_AS_HEAD:
            if not self.read_only:
                self.backend.accepted(self)
            return
        if current is None and not self._create:
            raise self._missing("holds no schema (it is empty)")
        self._known(current)
        if self.read_only:
            raise ReadOnlyRepoError(f"{self.where} has metadata schema {current!r}, older than this ckptstore's "
                                    f"{HEAD_REVISION!r}, and is read-only here ({self.why}); open it once where it "
                                    "can be written to upgrade it, or use the ckptstore that wrote it")
        from ckptstore.metadata.migrate import upgrade

        try:
            current = upgrade(self.url)  # under the writers' lock: another client may have upgraded it meanwhile
        except Exception as exc:  # SQLAlchemy's wrapping of the driver's error (a server gone away meanwhile)
            self._known(self.revision())  # a newer ckptstore upgraded it meanwhile: Alembic cannot find its revision
            known = self.backend.explain(exc)
            if known is not None:
                raise known from exc
            refused = _tables_refused(exc) if current is not None else None
            if refused is not None:  # "newer": the steps after `current` were applied already; "missing": damage
                raise self._mismatched(current, exc, refused) from exc
            raise
        self.backend.accepted(self)
        self.made = current is None
        if current not in (None, HEAD_REVISION):  # an older ckptstore elsewhere is refused from now on: say so here
            from ckptstore.warn import warn_caller

            warn_caller(f"upgraded the metadata schema of {self.where} from {current} to {HEAD_REVISION}: a ckptstore "
                        "older than this one can no longer open it; upgrade it wherever the repository is used")

    def _known(self, revision: str | None) -> None:
        """Refuse a revision this ckptstore does not know: another program's, or a newer ckptstore's."""
        if revision is not None and not re.fullmatch(r"\d{4}", revision):  # ours are numbered 0001, 0002, ...
            raise self._foreign(f"is at another program's schema revision {revision!r}")
        if revision is not None and revision not in KNOWN_REVISIONS:
            raise CkptError(f"{self.where} has metadata schema {revision!r}, written by a newer ckptstore; "
                            "upgrade ckptstore to open it")

    def _mismatched(self, recorded: str, exc: BaseException, refused: str) -> CorruptDatabaseError:
        """An upgrade from `recorded` that the tables refused: tables newer than the row says, or some missing."""
        cause = " ".join(str(getattr(exc, "orig", None) or exc).split())[:200]
        if refused == "missing":  # a table or column revision `recorded` has is gone: no row to set right
            return CorruptDatabaseError(
                f"the metadata database {self.where} records schema revision {recorded!r}, but a table or column "
                f"of that revision is missing: upgrading it failed ({cause}); nothing was changed. It is damaged: "
                "restore it from a backup")
        return CorruptDatabaseError(
            f"the metadata database {self.where} records schema revision {recorded!r}, but its tables are not that "
            f"revision's: upgrading them failed ({cause}). Its alembic_version row was rewritten, or an old one "
            f"restored over newer tables; the commits and refs are untouched. Set the row back to the revision the "
            f"tables are at (this ckptstore's is {HEAD_REVISION!r}: UPDATE alembic_version SET version_num = "
            f"'{HEAD_REVISION}'), or restore the database from a backup")

    def _foreign(self, what: str) -> CkptError:
        return CkptError(f"the metadata database {self.where} {what}: it is not ckptstore's, and nothing was "
                         f"written to it; give the repository a database of its own{self.backend.own_place()}")

    def _missing(self, what: str) -> MissingDatabaseError:
        # A repository's history lives only here: starting an empty one over its objects would let
        # gc delete them all, so opening (unlike init) never creates the schema.
        return MissingDatabaseError(f"the metadata database {self.where} {what}, but a repository's commits and refs "
                                    "live in it. Nothing was written, and no command runs until it is back: if the "
                                    "repository or its database moved, point metadata_url in .ckpt/config.toml at it "
                                    "(sqlite:////ABSOLUTE/PATH, or sqlite:///PATH inside the repository); "
                                    "else restore it from a backup. Only if it is lost for good, remove the "
                                    "repository's .ckpt folder (its objects with it) to start over")

    def size_on_disk(self) -> int:
        """Bytes the metadata takes on disk: the SQLite file and its log, or our tables on the server."""
        return self.backend.size_on_disk(self)

    def close(self) -> None:
        """Close the idle connections; one still in a transaction closes when it ends."""
        with self._guard:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            with contextlib.suppress(*self.backend.errors):
                connection.close()


@contextlib.contextmanager
def _holding_write() -> Iterator[None]:
    """Count this thread's SQLite write lock, taken just now, for a fork to wait on (not while BEGIN waits).

    A thread whose BEGIN waits for another process holds nothing a child would inherit; counting it
    made every fork meanwhile wait. What is left: a fork between BEGIN and this count.
    """
    me = threading.get_ident()
    with _FORKING:
        _WRITING[me] = _WRITING.get(me, 0) + 1
    try:
        yield
    finally:
        with _FORKING:
            left = _WRITING.pop(me, 1) - 1  # absent in a child forked inside this very transaction
            if left:
                _WRITING[me] = left
            _FORKING.notify_all()


def _before_fork() -> None:
    """Wait for other threads' SQLite write locks to be let go (the forking thread's own cannot be waited for).

    The fork goes ahead whatever this hook raises (CPython only prints it): a Ctrl-C that ends the
    wait is raised again once the fork has returned in the parent.
    """
    _AT_FORK.held = _AT_FORK.interrupted = False
    try:
        _FORKING.acquire()
        _AT_FORK.held = True
        me = threading.get_ident()
        _FORKING.wait_for(lambda: not any(thread != me for thread in _WRITING), timeout=FORK_WAIT_S)
    except KeyboardInterrupt:
        _AT_FORK.interrupted = True


def _after_fork_in_child() -> None:
    global _FORKING
    _FORKING = threading.Condition()  # the parent's is held by the fork: the child's writes start free
    _WRITING.clear()
    _AT_FORK.held = _AT_FORK.interrupted = False
    for database in list(_OPEN):
        database._forget_parents_connections()


def _after_fork_in_parent() -> None:
    if _AT_FORK.held:
        _FORKING.release()
    if _AT_FORK.interrupted:  # raised in any at-fork hook, it would be printed and lost again: raised after them
        caller = sys._getframe(1)  # the frame that called os.fork (the hooks run inside that call)
        threading.Thread(target=_interrupt_once_forked, args=(threading.get_ident(), caller, caller.f_lasti),
                         daemon=True).start()


def _interrupt_once_forked(thread: int, caller: Any, at: int) -> None:
    """The Ctrl-C that ended a fork's wait, again in the main thread, once os.fork has returned into `caller`.

    Other libraries' at-fork hooks may still run after this one: the interrupt waits (at most 2 s)
    until `caller` has moved past the call (or left the stack).
    """
    for _ in range(2000):
        frame = sys._current_frames().get(thread)
        if frame is None or (frame is caller and caller.f_lasti != at):
            break
        while frame is not None and frame is not caller:
            frame = frame.f_back
        if frame is None:
            break
        time.sleep(0.001)
    _thread.interrupt_main(signal.SIGINT)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
