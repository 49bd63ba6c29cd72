"""A throwaway PostgreSQL server for tests and benchmarks: initdb into a temporary folder, start, stop, remove.

It listens on 127.0.0.1 only (a free port) and on a unix socket in its folder, trusts every
local connection except those of `PASSWORD_USER`, who must give `PASSWORD` (to test a wrong
one), and runs with fsync and synchronous_commit off: a test server loses nothing anyone needs,
but a SIGKILL of it may lose transactions it already reported committed (a fault test that kills
the server must turn synchronous_commit on first). `durable=True` keeps PostgreSQL's defaults
instead, for benchmarks that compare it with a local repository, which fsyncs. initdb refuses to
run as root, so as root the server runs as the `postgres` system user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ckptstore.errors import CkptError
from ckptstore.testing.net import free_port

PASSWORD_USER = "ckpt_password"
PASSWORD = "right-password"
INSTALL_HINT = ("install PostgreSQL (Debian: `apt-get install -y postgresql`, which scripts/services.sh runs), "
                "or put its bin folder (with initdb and pg_ctl) on PATH")
_HBA = f"""local all all trust
host all {PASSWORD_USER} 127.0.0.1/32 scram-sha-256
host all all 127.0.0.1/32 trust
"""


def find_bin() -> Path:
    """The folder holding initdb and pg_ctl: from PATH, else the newest /usr/lib/postgresql/*/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent  # Debian links them into PATH; the real folder holds `postgres`
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if versions:
        return Path(versions[-1]).parent
    raise CkptError(f"no PostgreSQL server programs (initdb, pg_ctl) on this machine: {INSTALL_HINT}")


class PostgresServer:
    """A PostgreSQL server in a temporary folder; `with PostgresServer() as server: url = server.new_database()`."""

    def __init__(self, durable: bool = False) -> None:
        self.bin = find_bin()
        self.durable = durable
        self.folder = Path(tempfile.mkdtemp(prefix="ckpt-postgres-"))
        self.data = self.folder / "data"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0  # initdb and postgres refuse to run as root
        self._databases = 0
        self.running = False

    # ------------------------------------------------------------ processes
    def _run(self, *args: str) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.folder)
        if result.returncode != 0:
            log = self.folder / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise CkptError(f"{args[0]} failed ({result.returncode}): {result.stderr.strip()[-2000:]} {tail}")
        return result

    def _init(self) -> None:
        if self._as_postgres:
            shutil.chown(self.folder, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C",
                  "--no-sync")
        (self.data / "pg_hba.conf").write_text(_HBA)

    def start(self) -> None:
        """Start the server (again, after `stop`), waiting until it accepts connections."""
        settings = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.folder} "
                    "-c max_connections=200")
        if not self.durable:
            settings += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.folder / "server.log"), "-w", "-t", "60",
                  "-o", settings, "start")
        self.running = True

    def stop(self) -> None:
        """Stop the server now (`pg_ctl stop -m fast`): open connections are cut, as in a crash of the link."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
        self.running = False

    # ------------------------------------------------------------ databases
    def url(self, database: str = "postgres", user: str = "postgres", password: str = "") -> str:
        """The URL of `database` on this server over TCP."""
        login = f"{user}:{password}" if password else user
        return f"postgresql://{login}@127.0.0.1:{self.port}/{database}"

    def socket_url(self, database: str = "postgres") -> str:
        """The URL of `database` over the unix socket in the server's folder (libpq's `?host=/dir`)."""
        return f"postgresql://postgres@/{database}?host={self.folder}&port={self.port}"

    def execute(self, *statements: str, database: str = "postgres") -> None:
        """Run statements as the superuser, each in its own transaction."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def new_database(self, template: str = "") -> str:
        """A fresh database, by URL: empty, or a copy of the database at URL `template` (with nobody connected)."""
        self._databases += 1
        name = f"ckpt_{self._databases}"
        self.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template.rsplit('/', 1)[1]}" if template else ""))
        return self.url(name)

    def drop_database(self, url: str) -> None:
        """Remove a database `new_database` made, cutting any connection still open to it."""
        self.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")

    # ------------------------------------------------------------ lifetime
    def __enter__(self) -> PostgresServer:
        try:
            self._init()
            self.start()
            self.execute(f"CREATE ROLE {PASSWORD_USER} LOGIN SUPERUSER PASSWORD '{PASSWORD}'")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server if it runs and remove its folder."""
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(CkptError, subprocess.SubprocessError, OSError):
                self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)
