"""The PostgreSQL backend of `Database`: many machines share one repository's metadata on a server.

Writers serialize on one advisory lock taken first in their transaction (SQLite's BEGIN IMMEDIATE):
two committers queue instead of failing halfway, and each sees the other's rows once it holds the
lock (READ COMMITTED). The locks are the schema's: repositories in other schemas of one database
never wait for each other. Readers get a REPEATABLE READ, READ ONLY snapshot. psycopg is imported
here only, when a `postgresql://` URL is opened.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from ckptstore.errors import CkptError, CorruptDatabaseError, ReadOnlyRepoError, causes, disk_full
from ckptstore.holders import LOCK_NOTICE_S, holder_named, process_tag
from ckptstore.metadata.tables import TABLES
from ckptstore.warn import caller_origin, warn_caller, warnings_at

if TYPE_CHECKING:
    from ckptstore.metadata.db import Database, Tx

WRITE_LOCK = 0x636B_7074  # "ckpt": the advisory lock every writer (and every schema upgrade) takes first
REPO_LOCK = 0x636B_7067  # "ckpg": commits hold it shared from first object to ref moved, gc alone
APP_PREFIX = "ckptstore "  # application_name: this prefix, then `process_tag()`, so a waiter elsewhere names us
LOCK_WAIT = "120s"  # as long as SQLite's busy timeout: a writer gives up after waiting this long
CONNECT_TIMEOUT_S = 10
# how long the server may take to answer one round trip (CKPT_PG_REQUEST_SECONDS): generous, so the big
# transaction of a many-rank commit is never cut; a writer queues for the write lock in waits of half of it
REQUEST_SECONDS = 300.0
EXECUTEMANY_ROWS = 5000  # rows sent in one pipelined batch, under one deadline (5,000: well under a second here)


def schema_key(key: int) -> str:
    """SQL for advisory lock `key` of the session's schema, so repositories in other schemas never wait on each other.

    In `public` the key itself, as every ckptstore before took it in any schema: an older process still running on
    a repository there is excluded. Elsewhere the key beside the schema's oid, unique in its database (the lock's
    scope); an older process on such a schema takes the bare key, so upgrade all the machines sharing it together.
    """
    return (f"COALESCE((SELECT CASE WHEN n.nspname = 'public' THEN {key} ELSE {key}::bigint << 32 | n.oid::bigint "
            f"END FROM pg_catalog.pg_namespace n WHERE n.nspname = current_schema()), {key})")


# A server that stops answering mid-command (a network partition) is found by the kernel: keepalives probe an idle
# link, tcp_user_timeout drops one whose data goes unacknowledged this long. Without them a commit waited forever.
# Where the URL sets one, its own value stands.
LINK_CHECKS = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3",
               "tcp_user_timeout": "60000"}
# The server's side of the link, sent as `-c` options: a client gone in a partition (its close lost) was found by
# the OS's keepalive only, after about two hours, its sessions holding the write and repository locks meanwhile.
# These find it in about a minute, as the client finds the server. Where the URL's options or PGOPTIONS set one,
# its own value stands; a pooler that refuses them (pgbouncer) gets them by SET once connected.
SERVER_LINK_CHECKS = {"tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10", "tcp_keepalives_count": "3",
                      "tcp_user_timeout": "60000"}
# A write transaction left idle this many request limits is ended by the server, freeing the write lock: a client
# stopped, or gone behind a middlebox that keeps the server's link alive. Statements in one follow each other at
# once; one that reads the object store between them lifts it (`Tx.may_idle`). Lock sessions idle outside any
# transaction, for the minutes a commit uploads, and have no idle limit.
IDLE_WRITE_LIMITS = 3


def request_seconds() -> float:
    """CKPT_PG_REQUEST_SECONDS, else REQUEST_SECONDS; at least a second. Anything but a number of seconds is refused."""
    text = os.environ.get("CKPT_PG_REQUEST_SECONDS", "").strip()
    if not text:
        return REQUEST_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < 10**9:  # NaN fails it too
        raise CkptError(f"CKPT_PG_REQUEST_SECONDS={text!r}: give a number of seconds (0 to 10^9)")
    return max(1.0, seconds)


class Unanswered(psycopg.OperationalError):
    """The server took longer than CKPT_PG_REQUEST_SECONDS to answer; the connection was closed."""


class NoDeadline(str):
    """A statement that may wait as long as it must: the repository lock, which a commit holds waiting out a gc."""


# the first psycopg whose Connection.wait takes a deadline (`timeout`, raising _WaitTimeout): 3.1 read `timeout`
# as its poll interval, 3.2 to 3.3.5 refused it; pyproject.toml's postgres extra asks for the same
PSYCOPG_NEEDED = "psycopg[binary]>=3.3.6"


def psycopg_too_old() -> str:
    """Why this psycopg cannot bound a round trip ("" where it can): a command on it could wait for ever."""
    takes = "timeout" in inspect.signature(psycopg.Connection.wait).parameters
    if takes and isinstance(getattr(pg_errors, "_WaitTimeout", None), type):
        return ""
    return (f"psycopg {psycopg.__version__} is too old for a PostgreSQL repository (it cannot bound a wait for the "
            f"server): pip install '{PSYCOPG_NEEDED}'")


class AnsweringConnection(psycopg.Connection):
    """A connection on which each round trip must be answered within `limit` seconds (a NoDeadline statement: no end).

    Keepalives and tcp_user_timeout find a dead link, not a server (or a pooler in front of a dead
    one) that acknowledges and never answers: a command waited on it for ever. psycopg's own wait
    takes the deadline, so it costs no thread and nothing per statement.
    """

    limit: float = REQUEST_SECONDS
    unbounded = False  # while a NoDeadline statement runs
    cut = False  # a round trip outlived the limit and the connection was closed

    def wait(self, gen: Any, *args: Any, **kwargs: Any) -> Any:
        if self.unbounded or args[1:] or "timeout" in kwargs:  # a caller's own stands
            return super().wait(gen, *args, **kwargs)
        try:
            return super().wait(gen, *args, timeout=self.limit, **kwargs)
        except pg_errors._WaitTimeout:  # psycopg's for `timeout`: private, but the one it raises
            self.pgconn.finish()  # cut mid-statement: the connection is in no state to be used again
            self.cut = True
            raise Unanswered(f"no answer in {self.limit:g} s: CKPT_PG_REQUEST_SECONDS={self.limit:g}") from None

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(query, NoDeadline):
            return super().execute(query, *args, **kwargs)
        self.unbounded = True
        try:
            return super().execute(query, *args, **kwargs)
        finally:
            self.unbounded = False


class _LostPipelineNoise(logging.Filter):
    """Drops psycopg's "error ignored terminating <Pipeline>" logged in this thread once `connection` is lost.

    A link that broke (a reset, a server gone) or a deadline that cut it in an executemany's pipeline leaves
    psycopg unable to end it, and it logs so (to stderr, where nothing configures logging) above the one line
    a CLI user gets for the error that follows; psycopg's other records pass.
    """

    def __init__(self, connection: psycopg.Connection) -> None:
        super().__init__()
        self.connection, self.thread = connection, threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.connection.closed and record.thread == self.thread  # closed: broken, or cut by a deadline
                    and str(record.msg).startswith("error ignored terminating"))


# SQLSTATEs worth another try before any statement of ours ran: serialization failure, deadlock,
# too many connections, the server starting up or shutting down, a connection dropped
_TRANSIENT_STATES = {"40001", "40P01", "53300", "57P01", "57P02", "57P03", "08000", "08001", "08003", "08004",
                     "08006"}
# connection failures that another try will not cure (a restarting server refuses at once: a timeout or an
# unknown host name is the network or the URL, and each try would wait CONNECT_TIMEOUT_S again)
_PERMANENT_WORDS = ("password", "authentication", "does not exist", "pg_hba.conf", "permission denied",
                    "invalid", "timeout expired", "could not translate host name", "failed to resolve host")


def libpq_url(url: str) -> str:
    """`url` as libpq reads it: SQLAlchemy's `postgresql+psycopg://` spelling becomes `postgresql://`."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql://{rest}" if sep and scheme.split("+")[0] in ("postgresql", "postgres") else url


def sqlalchemy_url(url: str) -> str:
    """`url` as SQLAlchemy reads it, with psycopg (3) as the driver whatever the URL named."""
    return "postgresql+psycopg://" + libpq_url(url).partition("://")[2]


def describe(url: str) -> str:
    """The server, database and schema a URL names, for messages: `postgresql://user@host:port/db`, never a password.

    A search_path the URL sets follows, ` (search_path NAME)`: repositories in two schemas of one database differ.
    """
    try:
        parts = conninfo_to_dict(libpq_url(url))
    except psycopg.Error:
        raise CkptError("the metadata URL is not a valid PostgreSQL URL; expected "
                        "postgresql://USER@HOST:PORT/DATABASE (a unix socket: ...?host=/socket/dir)") from None
    host = str(parts.get("host") or parts.get("hostaddr") or "localhost")
    port = str(parts.get("port") or "5432")
    user = f"{parts['user']}@" if parts.get("user") else ""
    schema = f" (search_path {search_path(url)})" if search_path(url) else ""
    return f"postgresql://{user}{host}:{port}/{parts.get('dbname') or ''}{schema}"


def options_named(options: str) -> set[str]:
    """The settings a libpq `options` string sets (`-c NAME=VALUE`, `-cNAME=VALUE` or `--NAME=VALUE`)."""
    return {name.replace("-", "_") for name in re.findall(r"(?:-c\s*|--)([\w.-]+)=", options)}


def _startup_option_refused(exc: psycopg.OperationalError) -> bool:
    """Whether a connect failed on a `-c` option: a pooler's "unsupported startup parameter", an older server's name."""
    text = str(exc).lower()
    return "startup parameter" in text or "unrecognized configuration parameter" in text


def search_path(url: str) -> str:
    """The search_path a URL's options set (`?options=-csearch_path%3DNAME`), or "" where it sets none.

    libpq passes the options to the server as its command line: `-c NAME=VALUE` (a space optional) or
    `--NAME=VALUE`, a backslash keeping a space; the last one given wins.
    """
    options = str(conninfo_to_dict(libpq_url(url)).get("options") or "")
    found = re.findall(r"(?:-c\s*|--)search_path=((?:\\.|\S)+)", options)
    return re.sub(r"\\(.)", r"\1", found[-1]) if found else ""


@functools.lru_cache(maxsize=512)
def to_psycopg(sql: str) -> str:
    """A statement with "?" placeholders in psycopg's style: "?" outside quotes becomes %s, every % doubles."""
    out, quote = [], ""
    for char in sql:
        if char == "%":
            out.append("%%")  # psycopg reads % everywhere, inside quotes too
        elif quote:
            quote = "" if char == quote else quote
            out.append(char)
        elif char in "'\"":
            quote = char
            out.append(char)
        else:
            out.append("%s" if char == "?" else char)
    return "".join(out)


def _session_named(application_name: str | None, server_pid: int) -> str:
    """A session holding a lock, by the process a ckptstore names in its application_name, else by what there is."""
    if application_name and application_name.startswith(APP_PREFIX):
        return holder_named(application_name[len(APP_PREFIX):])
    client = repr(application_name) if application_name else "another client"
    return f"a session of {client} (server pid {server_pid})"


class _LockNotice:
    """The one warning of a wait for the repository lock, LOCK_NOTICE_S into it, unless the lock comes first.

    Said from a timer's thread, since the waiting thread is blocked in its request (which must stay in the
    server's queue), pointing at the user's call that waits (or the background commit's origin).
    """

    def __init__(self, backend: PostgresBackend, waiter_pid: int, exclusive: bool) -> None:
        self.backend, self.waiter_pid, self.exclusive = backend, waiter_pid, exclusive
        self.origin = caller_origin()  # taken in the waiting thread: the timer's own frames name no user line
        self.timer = threading.Timer(LOCK_NOTICE_S, self._say)
        self.timer.name, self.timer.daemon = "ckpt-lock-notice", True  # never what keeps a process alive
        self.timer.start()

    def _say(self) -> None:
        try:
            line = self.backend.lock_waiting_line(self.waiter_pid, self.exclusive)
        except (*self.backend.errors, OSError) as exc:  # the wait goes on: say so, without its holders
            line = (f"waiting for the repository lock on {self.backend.where} (its holders could not be looked "
                    f"up: {' '.join(str(exc).split())[:200]}); this command goes on once it is free")
        with warnings_at(self.origin):
            warn_caller(line)

    def stop(self) -> None:
        """The wait is over: no warning from now on; one being looked up is waited for, its connection closed."""
        self.timer.cancel()
        self.timer.join()


class PostgresBackend:
    """One database on a PostgreSQL server, through psycopg with autocommit off by our own BEGIN."""

    name = "postgresql"
    errors: tuple[type[BaseException], ...] = (psycopg.Error,)
    damage_errors: tuple[type[BaseException], ...] = (psycopg.Error,)

    def __init__(self, url: str, read_only: bool) -> None:
        if too_old := psycopg_too_old():  # refused before any connection: every round trip needs its deadline
            raise CkptError(too_old)
        self.where = describe(url)
        self.conninfo = libpq_url(url)
        self.read_only = read_only
        parts = conninfo_to_dict(self.conninfo)
        self.server = f"{parts.get('host') or parts.get('hostaddr') or 'localhost'}:{parts.get('port') or 5432}"
        self.user = str(parts.get("user") or "")
        self.dbname = str(parts.get("dbname") or "")
        self.request_seconds = request_seconds()
        # the URL's own options (a search_path), else PGOPTIONS: an `options` keyword replaces both, so ours go after
        self.given_options = str(parts.get("options") or os.environ.get("PGOPTIONS") or "").strip()
        self.server_checks = {name: value for name, value in SERVER_LINK_CHECKS.items()
                              if name not in options_named(self.given_options)}
        self.idle_limit = "" if "idle_in_transaction_session_timeout" in options_named(self.given_options) else \
            f"{round(1000 * IDLE_WRITE_LIMITS * self.request_seconds)}ms"
        self.server_checks_refused = False  # a pooler refused them as startup options: SET once connected

    def connect(self) -> psycopg.Connection:
        url_gives = conninfo_to_dict(self.conninfo)
        ours = [f"-c {name}={value}" for name, value in self.server_checks.items() if not self.server_checks_refused]
        # read-only: the server itself refuses a write, whatever a bug in ckptstore might try
        read_only = ["-c default_transaction_read_only=on"] if self.read_only else []
        options = " ".join([self.given_options, *ours, *read_only]).strip()
        checks = {name: value for name, value in LINK_CHECKS.items() if name not in url_gives}
        try:
            connection = AnsweringConnection.connect(
                self.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                application_name=(APP_PREFIX + process_tag())[:63],  # the most kept
                **checks, **({"options": options} if options else {}))
        except psycopg.OperationalError as exc:
            if not ours or not _startup_option_refused(exc):
                raise
            self.server_checks_refused = True
            return self.connect()
        connection.limit = self.request_seconds
        if self.server_checks_refused:
            self._set_server_checks(connection)
        return connection

    def _set_server_checks(self, connection: psycopg.Connection) -> None:
        """SERVER_LINK_CHECKS by SET, where a pooler refused them as startup options; one the server lacks is skipped.

        Behind a pooler they reach the server session it lends, whose link is the pooler's to watch.
        """
        for name, value in self.server_checks.items():
            with contextlib.suppress(pg_errors.UndefinedObject, pg_errors.InvalidParameterValue,
                                     pg_errors.CantChangeRuntimeParam):
                connection.execute(f"SET {name} = {value}")

    def reusable(self, connection: psycopg.Connection) -> bool:
        return not (connection.closed or connection.broken)

    def begin(self, connection: psycopg.Connection, write: bool) -> None:
        if write:
            self._queue_for_the_write_lock(connection)
        else:  # bounded too: a schema upgrade or an ALTER elsewhere holds its tables exclusively
            connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; "
                               f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")

    def _queue_for_the_write_lock(self, connection: psycopg.Connection) -> None:
        """Begin and queue behind any other writer for up to LOCK_WAIT, in waits the server ends within the limit.

        One wait for all of LOCK_WAIT would give a server that stops answering as long as a writer ahead of us:
        a hang was found after the limit plus 120 s. Each wait here is cut by lock_timeout at half the limit
        and answered, and queues again (from a savepoint) until LOCK_WAIT is spent: the server's error says so.
        """
        deadline = time.monotonic() + float(LOCK_WAIT.removesuffix("s"))
        start = "BEGIN ISOLATION LEVEL READ COMMITTED; SAVEPOINT write_lock"
        while True:
            wait_ms = max(1, round(1000 * min(self.request_seconds / 2, deadline - time.monotonic())))  # 0: no end
            try:
                connection.execute(f"{start}; SET LOCAL lock_timeout = '{wait_ms}ms'; "
                                   f"SELECT pg_advisory_xact_lock({schema_key(WRITE_LOCK)}); RELEASE SAVEPOINT "
                                   f"write_lock; SET LOCAL lock_timeout = '{LOCK_WAIT}'{self._idle_limit_sql()}")
                return
            except pg_errors.LockNotAvailable:
                if time.monotonic() >= deadline:
                    raise
            start = "ROLLBACK TO SAVEPOINT write_lock"  # the transaction goes on; the lock is queued for again

    def _idle_limit_sql(self) -> str:
        """The statement giving a write transaction its idle limit (IDLE_WRITE_LIMITS), after a "; ", or ""."""
        return f"; SET LOCAL idle_in_transaction_session_timeout = '{self.idle_limit}'" if self.idle_limit else ""

    def allow_idle(self, connection: psycopg.Connection) -> None:
        """Lift the idle limit for the rest of this transaction: it reads the object store between statements."""
        if self.idle_limit:
            connection.execute("SET LOCAL idle_in_transaction_session_timeout = 0")

    def commit(self, connection: psycopg.Connection, write: bool) -> None:
        """COMMIT; a link lost then leaves a write's outcome unknown, and is a lost connection to a read."""
        try:
            connection.execute("COMMIT")
        except psycopg.OperationalError as exc:  # the server may have committed before the link broke
            if not write:
                raise
            raise CkptError(f"lost the connection to PostgreSQL at {self.server} while committing "
                            f"({' '.join(str(exc).split())[:200]}); the change may or may not have been recorded: "
                            "check with `ckpt log` (and `ckpt fsck`) before running the command again") from exc

    def rollback(self, connection: psycopg.Connection) -> None:
        if not connection.broken:
            with contextlib.suppress(psycopg.OperationalError):  # a dead link: the server rolled back itself
                connection.execute("ROLLBACK")

    def in_transaction(self, connection: psycopg.Connection) -> bool:
        return not connection.broken and connection.info.transaction_status != TransactionStatus.IDLE

    def transient(self, exc: BaseException) -> bool:
        """Whether trying again may succeed: the server restarting or busy, a connection dropped, a lost race."""
        if getattr(exc, "sqlstate", None) in _TRANSIENT_STATES:
            return True
        if isinstance(exc, Unanswered):  # another try would wait the whole limit again
            return False
        text = str(exc).lower()
        return (isinstance(exc, psycopg.OperationalError) and getattr(exc, "sqlstate", None) is None
                and not any(word in text for word in _PERMANENT_WORDS))

    def prepare(self, sql: str) -> str:
        return to_psycopg(sql)

    def executemany(self, connection: psycopg.Connection, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Send `rows` in batches of EXECUTEMANY_ROWS, each under its own request deadline (AnsweringConnection).

        psycopg pipelines a batch in one wait: a commit's 150,000 rows in one took longer than a low limit.
        """
        rows = list(rows)
        quiet = _LostPipelineNoise(connection)
        psycopg_log = logging.getLogger("psycopg")
        psycopg_log.addFilter(quiet)
        try:
            with connection.cursor() as cursor:
                for start in range(0, len(rows), EXECUTEMANY_ROWS):
                    cursor.executemany(sql, rows[start:start + EXECUTEMANY_ROWS])
        finally:
            psycopg_log.removeFilter(quiet)

    def explain(self, exc: BaseException) -> CkptError | None:
        """Psycopg's error (or one wrapping it, as SQLAlchemy's do) as a CkptError naming the server, or None."""
        found = next((current for current in causes(exc) if isinstance(current, psycopg.Error)), None)
        return None if found is None else self._explained(found)

    def _explained(self, exc: psycopg.Error) -> CkptError | None:
        text = " ".join(str(exc).split())
        lowered = text.lower()
        at = f"PostgreSQL at {self.server}"
        if isinstance(exc, Unanswered):
            return CkptError(f"{at} did not answer ({text}): the server, or a pooler in front of it, hangs; nothing "
                             "was changed by the interrupted transaction: run the command again once it answers")
        if isinstance(exc, pg_errors.IdleInTransactionSessionTimeout):  # IDLE_WRITE_LIMITS: a stalled client
            return CkptError(f"{at} ended a write transaction of this command that sat idle for {self.idle_limit} "
                             f"({IDLE_WRITE_LIMITS} times CKPT_PG_REQUEST_SECONDS); nothing was changed: run the "
                             "command again")
        if isinstance(exc, pg_errors.InvalidSchemaName):  # "no schema has been selected to create in"
            return self.no_schema(search_path(self.conninfo))
        if isinstance(exc, pg_errors.ReadOnlySqlTransaction):
            return ReadOnlyRepoError(f"{self.where} is read-only here ({text}); reading commands work")
        if isinstance(exc, pg_errors.DiskFull):
            return disk_full(f"{at}: {text}")
        if isinstance(exc, (pg_errors.SerializationFailure, pg_errors.DeadlockDetected)):
            return CkptError(f"another process changed the metadata on {self.where} at the same time ({text}); "
                             "nothing was changed: run the command again")
        if isinstance(exc, pg_errors.LockNotAvailable):
            return CkptError(f"another process has held a lock on the metadata on {self.where} for {LOCK_WAIT} (a "
                             "writer, or a schema change); nothing was changed: run the command again once it is done")
        if isinstance(exc, pg_errors.InsufficientPrivilege):
            return CkptError(f"{at} refused user {self.user or '(default)'!r} ({text}); ask for access to "
                             f"database {self.dbname!r}")
        if isinstance(exc, psycopg.DataError):  # a value the server's columns cannot hold; SQLite's may
            return CkptError(f"{at} refused a value ({text}); nothing was changed")
        if isinstance(exc, psycopg.OperationalError):
            return self._connection_problem(exc, lowered, at)
        return None

    def _connection_problem(self, exc: psycopg.OperationalError, text: str, at: str) -> CkptError:
        """Why a connection failed or broke, and what to do about it."""
        who = repr(self.user) if self.user else "(the default user)"
        if "password" in text or "authentication failed" in text:
            return CkptError(f"{at} refused the login of user {who}: wrong or missing password. Check the "
                             "password in the metadata URL, PGPASSWORD or ~/.pgpass")
        if "role" in text and "does not exist" in text:
            return CkptError(f"{at} has no user {who}; check the user in the metadata URL")
        if "database" in text and "does not exist" in text:
            return CkptError(f"{at} has no database {self.dbname!r}; create it (createdb {self.dbname}) or fix "
                             "the metadata URL")
        if "pg_hba.conf" in text:
            return CkptError(f"{at} does not let user {who} connect from this machine (pg_hba.conf); ask its "
                             "administrator for access")
        if "too many" in text:
            return CkptError(f"{at} has too many connections open; run fewer processes at once or raise its "
                             "max_connections")
        if any(words in text for words in ("for connection option", "invalid port number", "invalid sslmode value")):
            return CkptError(f"the metadata URL for {at} is not valid ({' '.join(str(exc).split())[:200]}): fix it")
        if "starting up" in text or "shutting down" in text or "recovery" in text:
            return CkptError(f"{at} is starting up or shutting down; run the command again in a moment")
        for words, why in (("refused", "connection refused"), ("no such file", "no server socket there"),
                           ("timeout expired", "timed out"), ("could not translate host name", "unknown host"),
                           ("failed to resolve host", "unknown host")):
            if words in text:
                return CkptError(f"cannot reach {at} ({why}); is the server running, and is the metadata URL "
                                 "right?")
        return CkptError(f"lost the connection to {at} ({' '.join(str(exc).split())[:200]}); nothing was changed "
                         "by the interrupted transaction: run the command again once the server is up")

    def damage(self, exc: BaseException) -> CkptError | None:
        """A table or column missing after the schema check on open: the database was altered underneath us."""
        if isinstance(exc, (pg_errors.UndefinedTable, pg_errors.UndefinedColumn)):
            return CorruptDatabaseError(f"the metadata database {self.where} is damaged: "
                                        f"{' '.join(str(exc).split())}. Restore it from a backup (pg_dump)")
        return None

    repository_locks = True  # the repository lock lives on the server, for every machine sharing it

    def lock_repository(self, connection: psycopg.Connection, exclusive: bool, wait: bool) -> bool:
        """Take the repository lock in `connection`'s session; False where it is held and `wait` is False.

        Waiting, it waits out a gc however long, in one request that stays in the server's queue: a wait
        cut (lock_timeout) to say so re-queued at the back, and commits that came after a waiting gc
        overtook it. LOCK_NOTICE_S into the wait, a warning names the holders (`_LockNotice`). Free, one round trip.
        """
        mode = "" if exclusive else "_shared"
        if connection.execute(f"SELECT pg_try_advisory_lock{mode}({schema_key(REPO_LOCK)})").fetchone()[0]:
            return True
        if not wait:
            return False
        notice = _LockNotice(self, connection.info.backend_pid, exclusive)
        try:
            connection.execute(NoDeadline(f"SELECT pg_advisory_lock{mode}({schema_key(REPO_LOCK)})"))
        finally:
            notice.stop()
        return True

    def renew_gc_lease(self, connection: psycopg.Connection, seconds: float) -> float:
        """Set gc's delete lease (migration 0012) to the database's clock plus `seconds`, in `connection`'s session.

        Called on the exclusive lock's session: one that ended cannot renew it, and its error says the lock went.
        Returns the value set, which alone lets `end_gc_lease` tell this lease from one written since.
        """
        return float(connection.execute(
            "INSERT INTO gc_lease (id, expires_at) VALUES (1, extract(epoch FROM clock_timestamp())::float8 + %s) "
            "ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at RETURNING expires_at",
            (float(seconds),)).fetchone()[0])

    def end_gc_lease(self, connection: psycopg.Connection, written: float) -> bool:
        """End gc's delete lease if it still holds `written` (what `renew_gc_lease` set): whether it did.

        A compare-and-swap, from any session: a lease written since (another gc's) is not this one's to end.
        """
        return connection.execute("UPDATE gc_lease SET expires_at = 0 WHERE id = 1 AND expires_at = %s "
                                  "RETURNING id", (float(written),)).fetchone() is not None

    def gc_lease_left(self, connection: psycopg.Connection) -> float:
        """Seconds until gc's delete lease ends, on the database's clock (0 or less: none is live)."""
        row = connection.execute("SELECT max(expires_at) - extract(epoch FROM clock_timestamp())::float8 "
                                 "FROM gc_lease").fetchone()
        return 0.0 if row is None or row[0] is None else float(row[0])

    def lock_waiting_line(self, waiter_pid: int, exclusive: bool) -> str:
        """What a command waiting for the repository lock waits for: its holders (and a gc queued first), by name.

        Looked up on a short connection of its own (the waiter's session is in its request), in pg_locks
        (a bigint key shows as classid, objid), the sessions named by the application_name each ckptstore
        sets (`connect`); its command, pid and host are readable by every user of the server.
        """
        with self.connect() as connection:
            rows = connection.execute(
                "SELECT l.granted, l.mode = 'ExclusiveLock', a.application_name, l.pid FROM pg_catalog.pg_locks l "
                "LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
                "AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) "
                f"AND l.objsubid = 1 AND (l.classid::bigint << 32 | l.objid::bigint) = {schema_key(REPO_LOCK)} "
                "AND l.pid <> %s ORDER BY l.granted DESC, l.pid", (waiter_pid,)).fetchall()
        alone = [_session_named(app, pid) for granted, sole, app, pid in rows if granted and sole]
        shared = [_session_named(app, pid) for granted, sole, app, pid in rows if granted and not sole]
        queued = [_session_named(app, pid) for granted, sole, app, pid in rows if not granted and sole]
        if alone:
            held = f"{alone[0]} holds it alone (a gc or prune)"
        elif shared:
            held = f"{len(shared)} commit(s) in flight hold it shared: {', '.join(shared[:3])}"
        else:
            held = "its holder just let it go"
        ahead = f", and {queued[0]} (a gc or prune) queues for it first" if queued and not exclusive else ""
        return f"waiting for the repository lock on {self.where}: {held}{ahead}; this command goes on once it is free"

    def accepted(self, db: Database) -> None:
        """Nothing to settle on a server once the schema is ours."""

    def own_place(self) -> str:
        return " (or a schema of its own in it: CREATE SCHEMA NAME, then add ?options=-csearch_path%3DNAME to the URL)"

    def tables(self, tx: Tx) -> set[str]:
        """Our schema's tables; a search_path naming no schema that exists (a mistyped name) is refused.

        Without a schema, the tables were looked for nowhere: an open said the database was empty,
        an init failed on its first CREATE TABLE.
        """
        schema, path, names = tx.first("SELECT current_schema(), current_setting('search_path'), ARRAY(SELECT "
                                       "tablename::text FROM pg_catalog.pg_tables WHERE schemaname = current_schema())")
        if schema is None:
            raise self.no_schema(path)
        return {str(name) for name in names}

    def no_schema(self, path: str) -> CkptError:
        """The search_path `path` names no schema that exists in this database: which one to make, or fix."""
        names = [name.strip().strip('"') for name in path.split(",") if name.strip()]
        on = f"database {self.dbname!r} on PostgreSQL at {self.server}"
        if len(names) == 1:
            return CkptError(f"schema {names[0]!r} does not exist in {on}: CREATE SCHEMA {names[0]} there, or fix "
                             "the search_path in the metadata URL (?options=-csearch_path%3DNAME)")
        return CkptError(f"no schema of the search_path ({path or 'the server default'}) exists in {on}: create one "
                         "(CREATE SCHEMA NAME), or fix the search_path in the metadata URL "
                         "(?options=-csearch_path%3DNAME)")

    def storage_problems(self, tx: Tx, limit: int) -> list[str]:
        return []  # the server checks its own pages; amcheck would need superuser rights we do not ask for

    def size_on_disk(self, db: Database) -> int:
        """Bytes our tables take on the server, with their indexes and TOAST."""
        marks = ", ".join("?" * len(TABLES))
        with db.read() as tx:
            return int(tx.scalar("SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_catalog.pg_class c "
                                 "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
                                 f"WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname IN ({marks})",
                                 TABLES))

    def no_revision(self) -> str:
        return "Restore it from a backup (pg_dump), or point the metadata URL at the right database"

    def repository(self) -> str:
        return f"the metadata at {self.where}"
