"""The SQLite backend of `Database`: a file beside the repository, in WAL mode, through the stdlib driver.

Everything SQLite-specific lives here: how a connection is opened (read-only or not), how a
transaction starts, which errors mean a full disk or a damaged file, and what the file weighs.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sqlite3
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import (
    CkptError,
    CorruptDatabaseError,
    DiskFullError,
    ReadOnlyRepoError,
    disk_full,
    explain,
    file_too_large,
    inodes_used_up,
    no_inodes_left,
)
from ckptstore.paths import without_credentials

if TYPE_CHECKING:
    from ckptstore.metadata.db import Database, Tx

BUSY_TIMEOUT_MS = 120_000
LOW_SPACE = 1 << 20  # free bytes under which an I/O error writing the database means "disk full"
PAGE_WRITE = 1 << 16  # SQLite's largest page: a file this near the file-size limit cannot take another
PREFIX = "sqlite:///"
# "no such column/table": the schema was checked on open, so a table or column it lacks now is damage
_DAMAGE_WORDS = ("malformed", "not a database", "could not decode", "disk i/o error", "corrupt", "no such column",
                 "no such table")


def sqlite_path(url: str) -> Path:
    """The file a `sqlite:///PATH` URL names; a URL of another kind is refused with a clear error."""
    if not url.startswith(PREFIX):
        raise CkptError(f"metadata URL {without_credentials(url)!r} is not supported; use sqlite:///PATH or "
                        "postgresql://USER@HOST/DB")
    return Path(url[len(PREFIX) :])


def absolute_url(url: str, base: Path) -> str:
    """`url` with a relative SQLite path made absolute against `base`; any other URL (or "") as it is.

    A relative path read from wherever a command happens to run would open (and create) another,
    empty database: the repository would seem to have no commits, and gc would delete its objects.
    """
    if not url.startswith(PREFIX) or Path(url[len(PREFIX) :]).is_absolute():
        return url
    return PREFIX + str((base / url[len(PREFIX) :]).resolve())


def kept_url(url: str, root: Path) -> str:
    """`url` as a repository at `root` records it: a SQLite file inside `root` relative to it, so a move carries it.

    Recorded absolute, a repository moved with its database inside it opened the old, now missing path.
    """
    if not url.startswith(PREFIX):
        return url
    path = Path(url[len(PREFIX) :])
    return PREFIX + str(path.relative_to(root)) if path.is_relative_to(root) else url


def read_only_uri(path: Path, immutable: bool = False) -> str:
    """The URI that opens `path` without writing to it.

    `mode=ro` where SQLite can share the WAL with writers (its -wal file exists, or the folder
    is writable, where SQLite creates the -wal and -shm files it reads through); otherwise no
    writer can be connected (it would have created the -wal file), so the file is read as
    immutable: SQLite cannot open a WAL database read-only in a folder it cannot write.
    """
    wal = path.with_name(path.name + "-wal")
    shared = not immutable and (wal.exists() or os.access(path.parent, os.W_OK))
    return f"{path.resolve().as_uri()}?{'mode=ro' if shared else 'immutable=1'}"


class ImmutableConnection(sqlite3.Connection):
    """A connection that reads the file as immutable (a full disk): it never sees later commits, so is never pooled."""


def connect_sqlite(path: Path, read_only: bool = False, immutable: bool = False) -> sqlite3.Connection:
    """A connection in WAL mode with full sync, a long busy timeout and explicit transactions.

    Read-only, it sets nothing that writes: the database is in WAL mode since it was created.
    """
    if not path.parent.is_dir():  # SQLite would say only "unable to open database file"
        raise CkptError(f"the metadata database's folder {path.parent} does not exist; create it or choose "
                        "another path")
    if not read_only:
        _make_with_umask(path)
    target = read_only_uri(path, immutable) if read_only else path
    connection = sqlite3.connect(target, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                 check_same_thread=False, uri=read_only,
                                 factory=ImmutableConnection if immutable else sqlite3.Connection)
    connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    if read_only:
        return connection
    connection.execute("PRAGMA synchronous=FULL")
    # WAL is set once, on an empty file: ours are WAL from their first table on, and a file that holds
    # tables in another mode is another program's (or a newer schema's), which must not change by a byte.
    if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal" and \
            connection.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone() is None:
        connection.execute("PRAGMA journal_mode=WAL")
    return connection


def _refuse_special_file(path: Path) -> None:
    """Refuse a device, FIFO or socket named as the database: SQLite read /dev/zero as an empty database.

    `init --metadata sqlite:////dev/zero` then failed saying the repository's database held no schema.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing (made anew), or unreadable: connecting says which
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder is said as one where SQLite fails on it
        raise CkptError(f"the metadata URL names {path}, which is not a file (a device, FIFO or socket), so no "
                        "SQLite database: give the path of a database file, new or existing")


def _make_with_umask(path: Path) -> None:
    """Make the database file as the umask says (SQLite makes it 0644): its -wal and -shm files take its modes.

    A 0644 database, or the -wal a group member's read left at 0644, kept the group's others from writing.
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        pass


def is_damage(exc: BaseException) -> bool:
    """True for SQLite's (or its text decoding's) report of a damaged database file."""
    if isinstance(exc, UnicodeDecodeError):
        return True
    return not isinstance(exc, sqlite3.IntegrityError) and any(w in str(exc).lower() for w in _DAMAGE_WORDS)


class SqliteBackend:
    """One SQLite file: WAL, synchronous=FULL, `BEGIN IMMEDIATE` for writers (they queue on the busy timeout)."""

    name = "sqlite"
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    damage_errors: tuple[type[BaseException], ...] = (sqlite3.DatabaseError, UnicodeDecodeError)

    def __init__(self, url: str, read_only: bool) -> None:
        self.path = sqlite_path(url)
        self.where = str(self.path)
        _refuse_special_file(self.path)
        self.read_only = read_only
        self.disk_full = False  # no room even to read (see connect): read as immutable, write nothing

    def connect(self) -> sqlite3.Connection:
        """A connection; on a full disk with no writer connected, an immutable one that reads without writing.

        Even a reader needs room for the WAL's -wal and -shm files, so a full disk used to stop every
        command, restoring to another disk included. An empty or missing -wal file means every commit
        is in the main file, so reading it as immutable sees all of them. Each connection tries the
        usual way first: once there is room again, reads and writes go on as before.
        """
        connection = None
        try:
            connection = connect_sqlite(self.path, self.read_only)
            connection.execute("SELECT count(*) FROM sqlite_master").fetchone()  # maps the WAL's shared memory
            self.disk_full = False
            return connection
        except sqlite3.OperationalError as exc:
            if connection is not None:
                connection.close()
            wal = self.path.with_name(self.path.name + "-wal")
            # a file-size limit is no full disk: it is said as itself, not as "the disk is full" of a read-only open
            full = isinstance(self.explain(exc), DiskFullError) and self._past_size_limit(exc) is None
            if not full or (wal.exists() and wal.stat().st_size):
                raise
        self.disk_full = True
        return connect_sqlite(self.path, read_only=True, immutable=True)

    def reusable(self, connection: sqlite3.Connection) -> bool:
        # an immutable connection never sees a writer's later commits: read-only, open anew each time
        return not isinstance(connection, ImmutableConnection) and not (
            self.read_only and "immutable=1" in read_only_uri(self.path))

    def begin(self, connection: sqlite3.Connection, write: bool) -> None:
        connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def allow_idle(self, connection: sqlite3.Connection) -> None:
        """Nothing to lift: a SQLite transaction has no idle limit."""

    def commit(self, connection: sqlite3.Connection, write: bool) -> None:
        connection.commit()

    def rollback(self, connection: sqlite3.Connection) -> None:
        connection.rollback()

    def in_transaction(self, connection: sqlite3.Connection) -> bool:
        return connection.in_transaction

    def transient(self, exc: BaseException) -> bool:
        return False  # SQLite waits out a busy database itself (busy_timeout)

    def prepare(self, sql: str) -> str:
        return sql

    def executemany(self, connection: sqlite3.Connection, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        connection.executemany(sql, rows)

    def explain(self, exc: BaseException) -> CkptError | None:
        """SQLite's error as the user's problem (a full disk, a read-only file), or None.

        SQLite reports a full disk as "disk I/O error" when the WAL's shared memory cannot grow.
        """
        driver = getattr(exc, "orig", None) or exc  # SQLAlchemy's wrapping (a schema upgrade's) of SQLite's error
        text = str(driver).lower()
        if isinstance(driver, sqlite3.OperationalError) and "disk i/o error" in text:
            if (too_large := self._past_size_limit(driver)) is not None:
                return too_large
            import shutil  # only here: it imports the compression modules

            with contextlib.suppress(OSError):
                if shutil.disk_usage(self.path.parent).free < LOW_SPACE:
                    return disk_full(f"SQLite: {driver} writing {self.path}")
        if isinstance(driver, sqlite3.OperationalError) and "unable to open database file" in text:
            return self._unopenable()
        if isinstance(driver, sqlite3.OperationalError) and "database is locked" in text:
            return CkptError(f"another process has held a write transaction on {self.path} for "
                             f"{BUSY_TIMEOUT_MS // 1000} s; nothing was changed: run the command again once it is done "
                             "(a process stuck with the file open, such as an sqlite3 shell, holds it)")
        return explain(exc)

    def _past_size_limit(self, driver: BaseException) -> DiskFullError | None:
        """File too large, where the database or its -wal or -shm file is at this process's file-size limit.

        SQLite says "disk I/O error" of a write refused for `ulimit -f` (EFBIG) as of a failing disk: that
        sent the user to `ckpt fsck` for damage that is not there.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft == resource.RLIM_INFINITY:
            return None
        for path in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            with contextlib.suppress(OSError):
                if path.stat().st_size + PAGE_WRITE > soft:
                    return file_too_large(f"SQLite: {driver} writing {path}")
        return None

    def _unopenable(self) -> CkptError:
        """Why SQLite could not open the file, as far as the file system tells."""
        wal, shm = Path(f"{self.path}-wal"), Path(f"{self.path}-shm")
        with contextlib.suppress(OSError):  # a folder this user may not search: the general answer below
            if self.path.is_dir():
                return CkptError(f"{self.path} is a folder, not the repository's metadata database")
            if self.path.exists() and not os.access(self.path, os.R_OK):
                return CkptError(f"{self.path} cannot be read by this user (permission denied); ask for read access")
            if wal.is_file() and wal.stat().st_size and not shm.exists():
                return ReadOnlyRepoError(
                    f"{wal} holds commits not yet in {self.path.name}, and {shm.name} is missing where the folder "
                    "cannot be written: open the repository once where its .ckpt folder is writable, or copy "
                    f"{shm.name} along with the other two")
        held = no_inodes_left(self.path)
        if held:  # SQLite makes its -wal and -shm files beside the database, reading too
            return inodes_used_up(held)
        return CkptError(f"SQLite could not open {self.path}: check that this user may read it and its folder, and "
                         "write the folder (or use --read-only), and the limit on open files (ulimit -n)")

    def damage(self, exc: BaseException) -> CkptError | None:
        """SQLite's report of a damaged (or unreadable) file as CorruptDatabaseError, or None."""
        if not is_damage(exc):
            return None
        if "disk i/o error" in str(exc).lower():  # a failing disk or file system, or a damaged file: not known
            if (too_large := self._past_size_limit(exc)) is not None:
                return too_large
            return CorruptDatabaseError(
                f"the metadata database {self.path} could not be read or written (SQLite: {exc}); nothing was "
                "changed. Check the disk and file system (space, mount, permissions) and run it again; if it "
                "persists, `ckpt fsck` says whether the file is damaged")
        return CorruptDatabaseError(f"the metadata database {self.path} is damaged (SQLite: {exc}); nothing was "
                                    "changed. Restore .ckpt/ckpt.db from a backup; `ckpt fsck` lists what the "
                                    "objects still hold once it opens")

    repository_locks = False  # the repository's file lock (repo/lock.py) covers every process that can open the file

    def lock_repository(self, connection: Any, exclusive: bool, wait: bool) -> bool:
        raise NotImplementedError("a SQLite repository has no lock in its database (repository_locks)")

    def renew_gc_lease(self, connection: Any, seconds: float) -> float:
        raise NotImplementedError("a SQLite repository's gc holds a file lock, which it cannot lose: no lease")

    def end_gc_lease(self, connection: Any, written: float) -> bool:
        raise NotImplementedError("a SQLite repository's gc holds a file lock, which it cannot lose: no lease")

    def gc_lease_left(self, connection: Any) -> float:
        raise NotImplementedError("a SQLite repository's gc holds a file lock, which it cannot lose: no lease")

    def accepted(self, db: Database) -> None:
        """Our schema, opened to write: the file in WAL (connect_sqlite set it only on an empty file).

        A backup restored from `VACUUM INTO` or `.dump` is in rollback mode, where a reader that finds
        no -wal file (read_only_uri) could read as immutable under a writer. Best effort: while another
        process reads it, the switch is left to a later open, without waiting.
        """
        with db.read() as tx:
            mode = tx.scalar("PRAGMA journal_mode")
        if mode != "wal":
            with contextlib.suppress(sqlite3.Error):
                connection = connect_sqlite(self.path)
                try:
                    connection.execute("PRAGMA busy_timeout=0")  # a reader in another process: not now, no wait
                    connection.execute("PRAGMA journal_mode=WAL")
                finally:
                    connection.close()

    def own_place(self) -> str:
        return ""

    def tables(self, tx: Tx) -> set[str]:
        return {str(row[0]) for row in tx.rows("SELECT name FROM sqlite_master WHERE type = 'table' "
                                               "AND name NOT LIKE 'sqlite_%'")}

    def storage_problems(self, tx: Tx, limit: int) -> list[str]:
        found = [str(row[0]) for row in tx.rows(f"PRAGMA integrity_check({int(limit)})")]
        return [] if found == ["ok"] else found

    def size_on_disk(self, db: Database) -> int:
        """Bytes of the file and the write-ahead log beside it."""
        files = (self.path, self.path.with_name(self.path.name + "-wal"))
        return sum(f.stat().st_size for f in files if f.exists())

    def no_revision(self) -> str:
        return "Restore .ckpt/ckpt.db from a backup"

    def repository(self) -> str:
        """The repository whose `.ckpt` holds the file; one kept elsewhere (sqlite:////PATH) is named by its file."""
        if self.path.parent.name == ".ckpt":
            return f"the repository at {self.path.parent.parent}"
        return f"the metadata at {self.path}"
