"""The metadata on a real PostgreSQL server: migrations, write serialization, snapshots, retries, errors."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError, ReadOnlyRepoError
from ckptstore.metadata import Database
from ckptstore.metadata.db import HEAD_REVISION
from ckptstore.metadata.migrate import downgrade, make_engine, upgrade
from ckptstore.metadata.postgres import TABLES, describe, to_psycopg
from ckptstore.repo import fsck
from ckptstore.testing.postgres_server import PASSWORD, PASSWORD_USER
from tests.conftest import assert_same, ckpt_env

ROOT = Path(__file__).resolve().parents[2]


def _tables(url: str) -> dict[str, set[str]]:
    from sqlalchemy import inspect

    engine = make_engine(url)
    try:
        found = inspect(engine)
        return {t: {c["name"] for c in found.get_columns(t)} for t in found.get_table_names()}
    finally:
        engine.dispose()


def test_migrations_from_empty_to_head_and_back_and_up_again(postgres_url, tmp_path):
    from ckptstore.metadata.schema import metadata

    upgrade(postgres_url, "0001")
    assert "lossy" not in _tables(postgres_url)["commits"]
    Database(postgres_url).close()  # opening upgrades
    head = {"alembic_version": {"version_num"}, **{t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}}
    assert _tables(postgres_url) == head
    assert set(TABLES) == set(head)  # size_on_disk counts every table
    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        states = [{"w": torch.randn(300, generator=torch.Generator().manual_seed(s))} for s in range(2)]
        cids = [repo.commit(state, step=n) for n, state in enumerate(states)]
        repo.tag("first", cids[0])
    for _ in range(2):  # twice: each rebuild must leave the names the next one reuses free
        downgrade(postgres_url, "0005")
        upgrade(postgres_url)
    with Repository.open(tmp_path) as repo:
        assert repo.db.revision() == HEAD_REVISION and fsck(repo).ok
        assert [c.id for c in repo.log()] == cids[::-1] and repo.tags() == {"first": cids[0]}
        for cid, state in zip(cids, states):
            assert_same(state, repo.checkout(cid))
    downgrade(postgres_url, "base")
    assert _tables(postgres_url) == {"alembic_version": {"version_num"}}  # every table of ours gone
    upgrade(postgres_url)
    assert _tables(postgres_url) == head


OPEN_SCRIPT = """
import sys
from ckptstore.metadata import Database
sys.stdin.readline()
db = Database(sys.argv[1])
print(db.revision(), flush=True)
"""


def test_processes_opening_an_empty_database_at_once_create_the_schema_once(postgres_url):
    env = ckpt_env()
    openers = [subprocess.Popen([sys.executable, "-c", OPEN_SCRIPT, postgres_url], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for _ in range(4)]
    for p in openers:  # all imported and waiting: they open together
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=120) for p in openers]
    assert all(p.returncode == 0 for p in openers), results
    assert [out.strip() for out, _ in results] == [HEAD_REVISION] * 4


def test_writers_queue_and_see_each_other(postgres_url):
    """A second writer waits for the first to commit, then reads its rows (no lost update, no failure)."""
    db = Database(postgres_url)
    entered, seen = threading.Event(), {}

    def second() -> None:
        entered.wait()
        start = time.perf_counter()
        with db.write() as tx:
            seen["waited"] = time.perf_counter() - start
            seen["refs"] = tx.column("SELECT name FROM refs ORDER BY name")
            tx.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('b', 'branch', ?)", ("2" * 64,))

    thread = threading.Thread(target=second)
    thread.start()
    with db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('a', 'branch', ?)", ("1" * 64,))
        entered.set()
        time.sleep(0.6)
    thread.join(timeout=60)
    assert seen["refs"] == ["a"] and seen["waited"] >= 0.4, seen
    with db.read() as tx:
        assert tx.column("SELECT name FROM refs ORDER BY name") == ["a", "b"]
    db.close()


def test_a_read_is_one_snapshot(postgres_url):
    db = Database(postgres_url)
    with db.read() as tx:
        assert tx.scalar("SELECT count(*) FROM refs") == 0
        with db.write() as writer:
            writer.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
        assert tx.scalar("SELECT count(*) FROM refs") == 0  # committed meanwhile, not in this snapshot
    with db.read() as tx:
        assert tx.scalar("SELECT count(*) FROM refs") == 1
    db.close()


def test_placeholders_percent_signs_and_bytea(postgres_url):
    assert to_psycopg("SELECT '?', \"a?\", ? || '%' WHERE x LIKE 'a%'") == \
        "SELECT '?', \"a?\", %s || '%%' WHERE x LIKE 'a%%'"
    db = Database(postgres_url)
    with db.read() as tx:
        assert tx.first("SELECT '?', ? || '%'", ("a",)) == ("?", "a%")
        assert tx.scalar("SELECT '50%'") == "50%"
        value = tx.scalar("SELECT CAST(? AS bytea)", (b"\x00\xff raw",))
        assert type(value) is bytes and value == b"\x00\xff raw"
    db.close()


def test_size_on_disk_counts_our_tables(postgres_url, tmp_path):
    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        empty = repo.db.size_on_disk()
        repo.commit({f"t{i}": torch.randn(8) for i in range(300)})
        assert 0 < empty < repo.db.size_on_disk()
        assert repo.stats()["metadata_bytes"] == repo.db.size_on_disk()


def test_read_only_refuses_writes_and_the_server_enforces_it(postgres_url, tmp_path):
    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        cid = repo.commit({"w": torch.ones(3)})
    with Repository.open(tmp_path, read_only=True) as repo:
        assert repo.resolve("HEAD") == cid and torch.equal(repo.checkout("HEAD")["w"], torch.ones(3))
        with pytest.raises(ReadOnlyRepoError, match="read-only"):
            repo.branch("b")
        with repo.db.read() as tx:
            assert tx.scalar("SHOW default_transaction_read_only") == "on"
        assert repo.branches() == {"main": cid}


def test_connections_cut_while_idle_are_replaced(postgres_server, postgres_url):
    """The server dropped our pooled connections (a restart, an admin): the next transaction reconnects."""
    db = Database(postgres_url)
    with db.read() as tx:
        tx.scalar("SELECT 1")
    name = postgres_url.rsplit("/", 1)[1]
    postgres_server.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
    with db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
    with db.read() as tx:
        assert tx.scalar("SELECT count(*) FROM refs") == 1
    db.close()


def test_a_unix_socket_url_and_sqlalchemys_spelling_open_the_same_database(postgres_server, postgres_url):
    name = postgres_url.rsplit("/", 1)[1]
    Database(postgres_url).close()
    for url in (postgres_server.socket_url(name), postgres_url.replace("postgresql://", "postgresql+psycopg://")):
        db = Database(url)
        assert db.revision() == HEAD_REVISION
        db.close()


def test_wrong_credentials_and_unknown_databases_are_clear_errors(postgres_server):
    wrong = postgres_server.url(user=PASSWORD_USER, password="not-the-" + PASSWORD)
    with pytest.raises(CkptError, match=f"refused the login of user '{PASSWORD_USER}'") as info:
        Database(wrong)
    assert "not-the-" not in str(info.value) and str(postgres_server.port) in str(info.value)
    Database(postgres_server.url(user=PASSWORD_USER, password=PASSWORD)).close()  # the right one works
    with pytest.raises(CkptError, match="has no database 'nowhere'"):
        Database(postgres_server.url("nowhere"))
    with pytest.raises(CkptError, match="has no user 'nobody'"):
        Database(postgres_server.url(user="nobody"))
    assert describe("postgresql+psycopg://u:secret@h:5/d") == "postgresql://u@h:5/d"


def test_refs_list_in_the_same_order_as_on_sqlite_whatever_the_servers_collation(postgres_server, tmp_path):
    names = ["Zeta", "alpha", "Beta", "_x", "b-2", "b_1"]
    postgres_server.execute("CREATE DATABASE linguistic TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' "
                            "LOCALE 'C.UTF-8'")
    try:
        listed = {}
        for engine, url in (("sqlite", ""), ("postgresql", postgres_server.url("linguistic"))):
            with Repository.init(tmp_path / engine, metadata_url=url) as repo:
                cid = repo.commit({"w": torch.ones(2)})
                for name in names:
                    repo.branch(name)
                    repo.tag(f"t{name}", cid)
                listed[engine] = (list(repo.branches()), list(repo.tags()))
        assert listed["postgresql"] == listed["sqlite"] == (sorted([*names, "main"]), sorted(f"t{n}" for n in names))
    finally:
        postgres_server.execute("DROP DATABASE linguistic WITH (FORCE)")


def test_a_schema_of_its_own_named_in_the_url_holds_when_opened_read_only(postgres_server, tmp_path):
    name = postgres_server.new_database().rsplit("/", 1)[1]
    postgres_server.execute("CREATE TABLE spatial_ref_sys (id int)", "CREATE SCHEMA ckpt", database=name)
    url = postgres_server.url(name) + "?options=-csearch_path%3Dckpt"
    with Repository.init(tmp_path, metadata_url=url) as repo:
        cid = repo.commit({"w": torch.ones(2)})
    with Repository.open(tmp_path, read_only=True) as repo:  # read-only adds an option of its own
        assert [c.id for c in repo.log()] == [cid]



def test_a_search_path_naming_a_schema_that_does_not_exist_is_named_with_its_database(postgres_server, tmp_path):
    """A mistyped schema name (own_place's advice: CREATE SCHEMA, then search_path): init said "unexpected
    ProgrammingError ... please report it", an open that the database held no schema."""
    from psycopg import errors as pg_errors

    from ckptstore.metadata.postgres import PostgresBackend
    from tests.conftest import ckpt_here

    name = postgres_server.new_database().rsplit("/", 1)[1]
    postgres_server.execute("CREATE SCHEMA ckpt", database=name)
    said_missing = (f"schema 'ckpt2' does not exist in database '{name}' on PostgreSQL at "
                    f"127.0.0.1:{postgres_server.port}")
    mistyped = postgres_server.url(name) + "?options=-csearch_path%3Dckpt2"
    said = ckpt_here(tmp_path, "init", "r", "--metadata", mistyped)
    assert said.returncode == 1 and said.stderr == f"error: {said_missing}: CREATE SCHEMA ckpt2 there, or fix the " \
                                                   "search_path in the metadata URL (?options=-csearch_path%3DNAME)\n"
    assert not (tmp_path / "r").exists()
    url = postgres_server.url(name) + "?options=-csearch_path%3Dckpt"
    with Repository.init(tmp_path / "r", metadata_url=url) as repo:
        repo.commit({"w": torch.ones(2)})
    config = tmp_path / "r" / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace(url, mistyped))
    for flags in ([], ["--read-only"]):
        said = ckpt_here(tmp_path / "r", *flags, "log")
        assert said.returncode == 1 and said.stderr.startswith(f"error: {said_missing}:"), said.stderr
    # a schema dropped under a running init: the server's own error is said the same way
    raised = pg_errors.InvalidSchemaName("no schema has been selected to create in")
    assert str(PostgresBackend(mistyped, False).explain(raised)).startswith(said_missing)


def test_repositories_in_two_schemas_of_one_database_lock_apart_and_are_named_apart(postgres_server, tmp_path,
                                                                                    monkeypatch):
    """The advice is a schema per repository, but every lock was the database's: a commit in one stalled gc in the
    other, writers of both queued on one lock, and messages named the same database for both."""
    import psycopg

    from ckptstore.errors import RepoLockedError
    from ckptstore.metadata import postgres
    from ckptstore.repo.joining import _commit_in_flight

    monkeypatch.setattr(postgres, "LOCK_WAIT", "2s")
    name = postgres_server.new_database().rsplit("/", 1)[1]
    postgres_server.execute("CREATE SCHEMA sa", "CREATE SCHEMA sb", database=name)
    urls = {schema: f"{postgres_server.url(name)}?options=-csearch_path%3D{schema}" for schema in ("sa", "sb",
                                                                                                   "public")}
    repos = {schema: Repository.init(tmp_path / schema, metadata_url=url) for schema, url in urls.items()}
    try:
        assert repos["sa"].db.where == f"postgresql://postgres@127.0.0.1:{postgres_server.port}/{name} (search_path sa)"
        with repos["sa"].lock():  # a commit in flight in sa
            assert _commit_in_flight(repos["sa"]) and not _commit_in_flight(repos["sb"])
            with repos["sb"].lock(exclusive=True, wait=False):  # gc in sb runs
                pass
            with pytest.raises(RepoLockedError, match=r"\(search_path sa\) is busy"), Repository.open(tmp_path / "sa") \
                    as again, again.db.repository_lock(exclusive=True, wait=False):  # another machine's gc in sa waits
                pass
        with repos["sa"].db.write() as tx:  # a writer in sa holds the writers' lock: one in sb is not held up
            tx.execute("UPDATE refs SET name = name WHERE 1 = 0")
            repos["sb"].commit({"w": torch.ones(2)})
        # in public, the database-wide key stands: a commit of an older ckptstore still running there excludes gc
        with psycopg.connect(postgres_server.url(name), autocommit=True) as older:
            older.execute(f"SELECT pg_advisory_lock_shared({postgres.REPO_LOCK})")
            with pytest.raises(RepoLockedError, match="is busy"), repos["public"].lock(exclusive=True, wait=False):
                pass
            with repos["sa"].lock(exclusive=True, wait=False):
                pass
    finally:
        for repo in repos.values():
            repo.close()


def test_a_reading_command_behind_a_table_lock_gives_up_with_one_line(postgres_url, tmp_path, monkeypatch):
    """A schema change elsewhere holding a table exclusively: `ckpt log` waited forever; it waits as writers do."""
    import psycopg

    from ckptstore.metadata import postgres
    from tests.conftest import ckpt_here

    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.ones(3)})
    monkeypatch.setattr(postgres, "LOCK_WAIT", "1s")
    with psycopg.connect(postgres_url) as holder:
        holder.execute("LOCK TABLE refs IN ACCESS EXCLUSIVE MODE")  # in its transaction until the block ends
        started = time.monotonic()
        said = ckpt_here(tmp_path, "log", timeout=60)
        assert time.monotonic() - started < 30
    assert said.returncode == 1 and said.stderr.count("\n") == 1, said.stderr
    assert "another process has held a lock on the metadata" in said.stderr
    assert ckpt_here(tmp_path, "log").returncode == 0


@pytest.mark.parametrize("durable, fsync", [(False, "off"), (True, "on")])
def test_the_throwaway_server_runs_without_fsync_unless_durable(durable, fsync):
    """bench.s3_repo compares a durable local repository with a durable server: `durable=True` keeps fsync."""
    import psycopg

    from ckptstore.testing.postgres_server import PostgresServer

    with PostgresServer(durable=durable) as server, psycopg.connect(server.url()) as connection:
        settings = [connection.execute(f"SHOW {name}").fetchone()[0] for name in ("fsync", "synchronous_commit")]
    assert settings == [fsync, fsync]


def test_opening_a_database_with_no_schema_is_refused_and_writes_nothing(postgres_server, postgres_url, tmp_path):
    """Only init makes a schema: `ckpt log` on a database recreated empty (or a URL repointed at a fresh one) began
    an empty history over the repository's objects, which a gc would then all delete (mutation audit)."""
    from tests.conftest import ckpt_here

    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        cid = repo.commit({"w": torch.ones(1000)}, message="precious")
    objects = sorted(p.name for p in (tmp_path / ".ckpt" / "objects").rglob("*") if p.is_file())
    empty = postgres_server.new_database()
    try:
        config = tmp_path / ".ckpt" / "config.toml"
        config.write_text(config.read_text().replace(postgres_url, empty))
        for command in (["log"], ["gc"], ["commit", "-m", "x", "nothing.pt"]):
            said = ckpt_here(tmp_path, *command)
            assert said.returncode == 1, (command, said.stdout, said.stderr)
            assert said.stderr.startswith(f"error: the metadata database {describe(empty)} holds no schema (it is "
                                          "empty)") and "Nothing was written" in said.stderr, said.stderr
        assert _tables(empty) == {}  # no schema made, no revision written
        assert sorted(p.name for p in (tmp_path / ".ckpt" / "objects").rglob("*") if p.is_file()) == objects
    finally:
        postgres_server.drop_database(empty)
    config.write_text(config.read_text().replace(empty, postgres_url))
    with Repository.open(tmp_path) as repo:
        assert [c.id for c in repo.log()] == [cid] and fsck(repo).ok


def test_a_connection_lost_at_commit_says_a_write_may_or_may_not_be_recorded_and_a_read_changed_nothing(
        postgres_url, tmp_path, monkeypatch):
    """The server may have committed before the link broke: "nothing was changed, run it again" could be false.
    A read-only transaction's COMMIT records nothing: it was told to check `ckpt log` too (auditor 357)."""
    import psycopg

    from ckptstore.metadata import postgres

    real = postgres.PostgresBackend.commit

    def cut(backend, connection, *write):  # the link breaks as COMMIT goes out (here: just before: nothing recorded)
        with psycopg.connect(backend.conninfo, autocommit=True) as other:
            other.execute("SELECT pg_terminate_backend(%s)", (connection.info.backend_pid,))
        return real(backend, connection, *write)

    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        cid = repo.commit({"w": torch.ones(3)})
        monkeypatch.setattr(postgres.PostgresBackend, "commit", cut)
        with pytest.raises(CkptError, match=r"lost the connection to PostgreSQL at .* while committing \(.*\); the "
                                            r"change may or may not have been recorded: check with `ckpt log`") as lost:
            repo.tag("t1", cid)
        assert "nothing was changed" not in str(lost.value)
        with pytest.raises(CkptError, match=r"lost the connection to PostgreSQL at .*nothing was changed by the "
                                            r"interrupted transaction: run the command again") as lost:
            repo.tags()  # a read's COMMIT: nothing could have been recorded (auditor 357)
        assert "may or may not" not in str(lost.value)
        monkeypatch.undo()
        assert repo.tags() == {}  # the server rolled back: the tag can be made again
        repo.tag("t1", cid)
        assert repo.tags() == {"t1": cid}


def test_an_upgrade_behind_a_stalled_writer_gives_up_after_the_writers_wait(postgres_url, tmp_path, monkeypatch):
    """The upgrade queued behind the writers' lock with no bound: a teammate's stalled commit held a new client's
    first command (even `ckpt log`) silent for minutes (rolling-upgrade audit). It waits as long as a writer does."""
    import psycopg

    from ckptstore.metadata import postgres
    from ckptstore.metadata.migrate import downgrade

    Repository.init(tmp_path, metadata_url=postgres_url).close()
    downgrade(postgres_url, "0009")  # a repository an older ckptstore last wrote
    monkeypatch.setattr(postgres, "LOCK_WAIT", "1s")
    with psycopg.connect(to_psycopg(postgres_url), autocommit=True) as stalled:
        stalled.execute("BEGIN")
        stalled.execute(f"SELECT pg_advisory_xact_lock({postgres.WRITE_LOCK})")  # a writer stopped mid-transaction
        unstall = threading.Timer(30, lambda: stalled.execute("ROLLBACK"))  # unbounded, the open would hang here
        unstall.start()
        try:
            started = time.monotonic()
            with pytest.raises(CkptError, match="another process has held a lock on the metadata on .* for 1s"):
                Repository.open(tmp_path)
            assert time.monotonic() - started < 30
        finally:
            unstall.cancel()
        stalled.execute("ROLLBACK")
    with pytest.warns(RuntimeWarning, match="from 0009 to"), Repository.open(tmp_path) as repo:  # then it goes ahead
        assert repo.db.revision() == HEAD_REVISION


def test_connections_ask_the_kernel_to_find_a_server_that_stops_answering(postgres_url):
    """A link stalled mid-commit (a partition) left the commit waiting forever: no keepalives, no user timeout
    (auditor). The URL's own settings stand."""
    from ckptstore.metadata.postgres import LINK_CHECKS, PostgresBackend

    with PostgresBackend(postgres_url, read_only=False).connect() as connection:
        given = connection.info.get_parameters()
        assert {name: given.get(name) for name in LINK_CHECKS} == LINK_CHECKS
    with PostgresBackend(f"{postgres_url}?tcp_user_timeout=5000", read_only=False).connect() as connection:
        assert connection.info.get_parameters()["tcp_user_timeout"] == "5000"


def _server_settings(connection, names) -> dict[str, str]:
    """The session's values of settings `names`, as the server keeps them (milliseconds as a number)."""
    return dict(connection.execute("SELECT name, setting FROM pg_catalog.pg_settings WHERE name = ANY(%s)",
                                   (list(names),)).fetchall())


def test_the_server_is_asked_to_find_a_client_gone_in_a_partition_and_the_urls_own_settings_stand(postgres_url,
                                                                                                    monkeypatch):
    """Keepalives were the client's only: the server found a client gone in a partition after the OS's two hours,
    its sessions holding the write and repository locks (auditor 357). The URL's options and PGOPTIONS stand."""
    from ckptstore.metadata.postgres import SERVER_LINK_CHECKS, PostgresBackend

    with PostgresBackend(postgres_url, read_only=False).connect() as connection:
        assert _server_settings(connection, SERVER_LINK_CHECKS) == SERVER_LINK_CHECKS
    url = f"{postgres_url}?options=-c%20tcp_keepalives_idle%3D7%20-csearch_path%3Dpublic"
    monkeypatch.setenv("PGOPTIONS", "-c tcp_keepalives_count=5")  # libpq reads it only where the URL gives none
    with PostgresBackend(url, read_only=True).connect() as connection:
        assert _server_settings(connection, SERVER_LINK_CHECKS) == {**SERVER_LINK_CHECKS, "tcp_keepalives_idle": "7"}
        assert connection.execute("SHOW default_transaction_read_only").fetchone()[0] == "on"
    with PostgresBackend(postgres_url, read_only=False).connect() as connection:
        assert _server_settings(connection, SERVER_LINK_CHECKS) == {**SERVER_LINK_CHECKS, "tcp_keepalives_count": "5"}


def test_a_server_or_pooler_that_refuses_a_link_setting_at_startup_gets_them_set_once_connected(postgres_url,
                                                                                                 monkeypatch):
    """pgbouncer refuses unknown startup options ("unsupported startup parameter"), a server older than one of them
    its name: the connection is made without them and each is SET, one the server lacks skipped."""
    from ckptstore.metadata import postgres

    monkeypatch.setattr(postgres, "SERVER_LINK_CHECKS", {**postgres.SERVER_LINK_CHECKS, "ckpt_no_such_setting": "1"})
    backend = postgres.PostgresBackend(postgres_url, read_only=False)
    for _ in range(2):  # the second connects without them at once
        with backend.connect() as connection:
            assert backend.server_checks_refused
            assert _server_settings(connection, ["tcp_keepalives_idle", "tcp_user_timeout"]) == {
                "tcp_keepalives_idle": "30", "tcp_user_timeout": "60000"}


def _raised_within(seconds: float, work) -> BaseException | None:
    """What `work()` raised (None: nothing), run in a thread given `seconds`: a hang fails the test, not hangs it."""
    outcome: list[BaseException | None] = []

    def run():
        try:
            work()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting for the server after {seconds} s"
    return outcome[0]


def test_a_server_that_stops_answering_stops_the_command_after_the_request_limit(stalling, tmp_path):
    """A hung server (or a pooler in front of a dead one) keeps the link open and ACKs: keepalives and
    tcp_user_timeout never fire, and push waited in BEGIN for ever (auditor)."""
    proxy, url = stalling
    with Repository.init(tmp_path, metadata_url=url) as repo:
        cid = repo.commit({"w": torch.ones(3)})
        proxy.stalled = True
        started = time.monotonic()
        said = _raised_within(30, lambda: repo.tag("t1", cid))
        assert time.monotonic() - started < 10  # one limit, not one per retry of the begin
        assert isinstance(said, CkptError) and "did not answer" in str(said), said
        assert "CKPT_PG_REQUEST_SECONDS" in str(said) and "nothing was changed" in str(said)
        proxy.stalled = False
        assert repo.tags() == {}  # the cut connection was not pooled: the next transaction works
        repo.tag("t1", cid)
        assert repo.tags() == {"t1": cid}


def test_a_server_that_stops_answering_in_a_writers_begin_is_found_after_the_request_limit(stalling, tmp_path):
    """A writer's begin queued for the write lock in one round trip allowed the limit plus LOCK_WAIT: a hung server
    there was found after 121 s at CKPT_PG_REQUEST_SECONDS=1 (fixer helper 328). Now after about the limit."""
    proxy, url = stalling

    def begin_writing():
        with repo.db.write():
            pass

    with Repository.init(tmp_path, metadata_url=url) as repo:
        proxy.stalled = True  # the pooled connection's next round trip is the write's BEGIN and lock
        started = time.monotonic()
        said = _raised_within(60, begin_writing)
        assert time.monotonic() - started < 5, said
        assert isinstance(said, CkptError) and "did not answer (no answer in 1 s" in str(said), said


def test_a_writer_queued_longer_than_lock_wait_gives_up_with_one_line(stalling, postgres_url, tmp_path, monkeypatch):
    """Queued in waits of half the 1 s limit, a writer behind one that never finishes still waits LOCK_WAIT in all,
    then says who held it; the answered waits are no hang."""
    import psycopg

    from ckptstore.metadata import postgres

    _, url = stalling
    monkeypatch.setattr(postgres, "LOCK_WAIT", "3s")
    with Repository.init(tmp_path, metadata_url=url) as repo, psycopg.connect(postgres_url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute(f"SELECT pg_advisory_xact_lock({postgres.WRITE_LOCK})")  # a writer stopped mid-transaction
        started = time.monotonic()
        said = _raised_within(60, lambda: repo.tag("t1", "0" * 64))
        assert 2.9 < time.monotonic() - started < 10
        assert isinstance(said, CkptError) and "another process has held a lock on the metadata" in str(said), said
        assert "for 3s" in str(said)


CUT_BATCH_SCRIPT = """
import os, socket, sys
from ckptstore.cli import main
from ckptstore.metadata import postgres
real = postgres.PostgresBackend.executemany
def told(backend, connection, *args):
    with socket.socket(fileno=os.dup(connection.pgconn.socket)) as link:  # the batch fills it: psycopg waits to send
        link.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    print("batch", flush=True)
    sys.stdin.readline()  # the test stalls the server now
    return real(backend, connection, *args)
postgres.PostgresBackend.executemany = told
main(sys.argv[1:])
"""


def test_a_deadline_that_cuts_a_batch_shows_the_cli_user_one_line(stalling, tmp_path):
    """A server that stopped answering mid-executemany: psycopg's pipeline logged "error ignored terminating
    <psycopg.Pipeline ...>" to stderr above ckptstore's own line (fixer helper 328). Only ours is shown now."""
    proxy, url = stalling
    Repository.init(tmp_path, metadata_url=url).close()
    torch.save({f"t{i}": torch.full((4,), float(i)) for i in range(3000)}, tmp_path / "m.pt")  # rows that fill the link
    commit = subprocess.Popen([sys.executable, "-c", CUT_BATCH_SCRIPT, "commit", "m.pt"], cwd=tmp_path,
                              env=ckpt_env(CKPT_PG_REQUEST_SECONDS="1"), text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert commit.stdout.readline() == "batch\n"
        proxy.stalled = True
        commit.stdin.write("go\n")
        commit.stdin.flush()
        _, err = commit.communicate(timeout=60)
    finally:
        commit.kill()
    assert commit.returncode == 1 and err.count("\n") == 1, err
    assert "did not answer" in err and "error ignored" not in err and "Traceback" not in err


def test_a_link_broken_in_a_batch_logs_nothing_above_the_error_and_other_psycopg_lines_pass(postgres_server,
                                                                                             postgres_url, caplog):
    """A link reset while an executemany's rows went (no deadline cut it): psycopg logged "error ignored terminating
    <psycopg.Pipeline [BAD]>: the connection is lost" above the CLI user's one error line (auditor 364)."""
    import logging

    import psycopg

    from ckptstore.metadata import postgres
    from ckptstore.testing.fault_proxy import FaultProxy

    with FaultProxy(postgres_server.port) as proxy:
        backend = postgres.PostgresBackend(postgres_url.replace(f":{postgres_server.port}/", f":{proxy.port}/"),
                                           read_only=False)
        with backend.connect() as connection:
            connection.execute("CREATE TEMP TABLE sent (a text)")
            proxy.down_after(1000)  # the link goes while the batch is on its way
            with caplog.at_level(logging.WARNING, logger="psycopg"), pytest.raises(psycopg.OperationalError):
                backend.executemany(connection, backend.prepare("INSERT INTO sent VALUES (?)"), [("x" * 100,)] * 3000)
            assert connection.broken and not connection.cut
    assert [record.getMessage() for record in caplog.records if record.name.startswith("psycopg")] == []
    other = logging.LogRecord("psycopg", logging.WARNING, __file__, 0, "some other warning", None, None)
    assert postgres._LostPipelineNoise(connection).filter(other)


def test_a_server_that_stops_answering_at_commit_says_the_change_may_or_may_not_have_been_recorded(
        stalling, tmp_path, monkeypatch):
    """The COMMIT went out before the silence: it may have been recorded, so "nothing was changed" could be false."""
    from ckptstore.metadata import postgres

    proxy, url = stalling
    real = postgres.PostgresBackend.commit

    def stalled_commit(backend, connection, *write):
        proxy.stalled = True
        return real(backend, connection, *write)

    with Repository.init(tmp_path, metadata_url=url) as repo:
        cid = repo.commit({"w": torch.ones(3)})
        monkeypatch.setattr(postgres.PostgresBackend, "commit", stalled_commit)
        said = _raised_within(30, lambda: repo.tag("t1", cid))
        assert isinstance(said, CkptError), said
        assert "may or may not have been recorded" in str(said) and "CKPT_PG_REQUEST_SECONDS" in str(said)


def test_lock_waits_longer_than_the_request_limit_are_not_cut(stalling, postgres_url, tmp_path):
    """A writer queued behind another (bounded by LOCK_WAIT on the server) and a commit's repository lock behind a
    gc (unbounded, as documented) wait longer than one answer may take."""
    import psycopg

    from ckptstore.metadata import postgres

    _, url = stalling
    with Repository.init(tmp_path, metadata_url=url) as repo:
        cid = repo.commit({"w": torch.ones(3)})
        for lock in (f"pg_advisory_xact_lock({postgres.WRITE_LOCK})", f"pg_advisory_lock({postgres.REPO_LOCK})"):
            with psycopg.connect(postgres_url, autocommit=True) as holder:
                holder.execute("BEGIN")
                holder.execute(f"SELECT {lock}")  # another writer mid-transaction; a gc
                let_go = threading.Timer(2.5, holder.close)
                let_go.start()
                started = time.monotonic()
                if "xact" in lock:
                    assert _raised_within(60, lambda: repo.tag("t1", cid)) is None
                else:
                    assert _raised_within(60, lambda: repo.db.repository_lock().__enter__()) is None
                assert time.monotonic() - started > 2, lock  # it did wait, past the 1 s limit
                let_go.join()


def test_a_request_limit_that_is_no_number_of_seconds_is_refused(postgres_url, monkeypatch):
    from ckptstore.metadata.postgres import PostgresBackend

    monkeypatch.setenv("CKPT_PG_REQUEST_SECONDS", "5m")
    with pytest.raises(CkptError, match="CKPT_PG_REQUEST_SECONDS='5m': give a number of seconds"):
        PostgresBackend(postgres_url, read_only=False)


def test_a_psycopg_whose_wait_takes_no_deadline_is_refused_naming_the_one_to_install(tmp_path, postgres_url,
                                                                                      monkeypatch):
    """pyproject allowed psycopg 3.1 on, but only 3.3.6's Connection.wait takes a deadline: on an older one every
    command ran with none, and a hung server held it for ever (fixer helper 328). It is refused, naming pyproject's."""
    import psycopg
    import tomllib

    from ckptstore.metadata import postgres

    real = psycopg.Connection.wait

    def wait_of_3_2(self, gen, interval=0.1):
        return real(self, gen, interval)

    monkeypatch.setattr(psycopg.Connection, "wait", wait_of_3_2)
    with pytest.raises(CkptError, match=r"psycopg .* is too old .*: pip install 'psycopg\[binary\]>=3.3.6'"):
        Repository.init(tmp_path / "r", metadata_url=postgres_url)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["postgres"] == [postgres.PSYCOPG_NEEDED]  # the floor installed is the one asked for


def test_many_rows_go_in_batches_each_under_its_own_deadline(tmp_path, postgres_url, monkeypatch):
    """psycopg pipelines an executemany in one wait: a commit's 150,000 rows were one round trip to the deadline,
    and a busy but healthy server was called hung at CKPT_PG_REQUEST_SECONDS=1 (random tester helper 322)."""
    from ckptstore.metadata import postgres

    monkeypatch.setattr(postgres, "EXECUTEMANY_ROWS", 3)  # every insert of this commit in several batches
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(20)}
    with Repository.init(tmp_path / "r", metadata_url=postgres_url) as repo:
        cid = repo.commit(state)
        assert_same(state, repo.checkout(cid))
        assert fsck(repo, full=True).ok


def test_a_lock_taken_while_a_gcs_delete_lease_is_live_waits_it_out_and_one_run_out_costs_nothing(postgres_url):
    """A gc that lost its lock may have a delete in flight until its lease ends: whoever takes the lock meanwhile
    waits, saying why once; a lease that ran out (its gc killed long ago) is not waited for."""
    import warnings

    import psycopg

    def lease(seconds: float) -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("UPDATE gc_lease SET expires_at = extract(epoch FROM clock_timestamp())::float8 + %s",
                         (seconds,))

    db = Database(postgres_url)
    try:
        for exclusive in (False, True):
            lease(3)
            started = time.monotonic()
            with pytest.warns(RuntimeWarning, match=r"waiting [34] s before going on: a gc on .* stopped while "
                                                    r"deleting unreachable objects \(its lock lost, or the command "
                                                    r"interrupted mid-delete\)") as said:
                with db.repository_lock(exclusive=exclusive):
                    waited = time.monotonic() - started
            assert 2.5 < waited < 30 and len(said) == 1
        lease(-1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            started = time.monotonic()
            with db.repository_lock():
                assert time.monotonic() - started < 2
    finally:
        db.close()


def test_a_write_cut_off_by_a_partition_lets_go_of_the_write_lock_on_the_server_and_lock_sessions_stay(stalling,
                                                                                                        postgres_url):
    """A partition mid-write left the gone client's session idle in its transaction, holding the write lock: every
    write from any machine waited 120 s and failed, for about two hours (auditor 357). The server now ends a write
    transaction idle for 3 request limits (3 s here); a lock session, idle outside any transaction while a commit
    uploads, keeps its lock."""
    import psycopg

    from ckptstore.metadata.postgres import WRITE_LOCK, schema_key

    proxy, url = stalling
    db = Database(url)
    try:
        with db.repository_lock():  # a commit's shared lock, idle while it uploads
            with pytest.raises(CkptError, match="did not answer"), db.write() as tx:
                tx.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('a', 'branch', ?)", ("1" * 64,))
                proxy.stalled = True  # the partition: the next statement, and the close, never reach the server
                tx.scalar("SELECT 1")
            cut_off = time.monotonic()
            with psycopg.connect(postgres_url, autocommit=True) as other:
                while not other.execute(f"SELECT pg_try_advisory_xact_lock({schema_key(WRITE_LOCK)})").fetchone()[0]:
                    assert time.monotonic() - cut_off < 10, "the gone client's session still holds the write lock"
                    time.sleep(0.2)
            proxy.stalled = False
            db.confirm_locks()  # its session idled past the write limit, and holds the repository lock still
        with db.read() as tx:
            assert tx.column("SELECT name FROM refs") == []  # the cut-off write recorded nothing
    finally:
        db.close()


def test_a_gc_that_lists_a_slow_store_in_its_write_transaction_is_not_ended_by_the_idle_limit(postgres_url, tmp_path,
                                                                                              monkeypatch):
    """gc reads manifests and lists the store inside its write transaction, minutes on a big bucket: the write
    transactions' idle limit (3 request limits: 3 s here) must not end it."""
    from ckptstore.repo import maintenance

    monkeypatch.setenv("CKPT_PG_REQUEST_SECONDS", "1")
    with Repository.init(tmp_path, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.ones(3)})
        listing = type(repo.store).iter_sizes

        def slow_listing(store):  # a big bucket's listing
            time.sleep(4)
            yield from listing(store)

        monkeypatch.setattr(type(repo.store), "iter_sizes", slow_listing)
        maintenance.gc(repo)
        assert fsck(repo).ok


def test_a_write_transaction_left_idle_past_its_limit_is_ended_with_one_line(postgres_url, monkeypatch):
    """A client stopped mid-write lets go of the write lock after 3 request limits; the error says so in a line."""
    monkeypatch.setenv("CKPT_PG_REQUEST_SECONDS", "1")
    db = Database(postgres_url)
    try:
        with pytest.raises(CkptError, match=r"ended a write transaction of this command that sat idle for 3000ms .*"
                                            r"nothing was changed: run the command again"), db.write() as tx:
            tx.execute("INSERT INTO refs (name, kind, commit_id) VALUES ('a', 'branch', ?)", ("1" * 64,))
            time.sleep(3.5)
            tx.scalar("SELECT 1")
        with db.read() as tx:
            assert tx.column("SELECT name FROM refs") == []
    finally:
        db.close()


def test_a_metadata_url_is_shown_without_its_password():
    """`ckpt remote list` and a clone's 'holds no repository' printed the PostgreSQL password (auditor 428)."""
    from ckptstore.metadata import shown_url

    shown = shown_url("postgresql://ckpt:s3cret@127.0.0.1:5433/db1")
    assert shown == "postgresql://ckpt@127.0.0.1:5433/db1" and "s3cret" not in shown
    assert "s3cret" not in shown_url("postgresql://ckpt@host/db?password=s3cret")
    assert shown_url("sqlite:///tmp/x.db") == "sqlite:///tmp/x.db"


def test_remote_list_shows_no_password_of_a_remotes_metadata_url(tmp_path):
    from tests.conftest import ckpt_here

    Repository.init(tmp_path).close()
    with open(tmp_path / ".ckpt" / "config.toml", "a") as config:
        config.write('\n[remotes."origin"]\nurl = "s3://bucket/repo"\n'
                     'metadata_url = "postgresql://ckpt:s3cret@127.0.0.1:5433/db1"\nlazy = false\n')
    listed = ckpt_here(tmp_path, "remote", "list")
    assert listed.returncode == 0 and listed.stdout == \
        "origin\ts3://bucket/repo (metadata postgresql://ckpt@127.0.0.1:5433/db1)\n", listed
