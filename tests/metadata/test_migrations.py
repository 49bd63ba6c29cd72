import contextlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError
from ckptstore.metadata import Database
from ckptstore.metadata.db import HEAD_REVISION, KNOWN_REVISIONS
from ckptstore.metadata.migrate import downgrade, head_revision, upgrade
from ckptstore.repo.config import RepoConfig

pytestmark = pytest.mark.both_backends


def _columns(path, table):
    with sqlite3.connect(path) as conn:
        return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def test_repository_made_by_an_older_schema_opens_and_upgrades(tmp_path):  # SQLite; PostgreSQL: test_postgres.py
    (tmp_path / ".ckpt").mkdir()
    RepoConfig().save(tmp_path / ".ckpt" / "config.toml")
    db_path = tmp_path / ".ckpt" / "ckpt.db"
    upgrade(f"sqlite:///{db_path}", "0001")
    assert not _columns(db_path, "known_files")
    with Repository.open(tmp_path) as repo:
        assert repo.db.revision() == HEAD_REVISION
    assert _columns(db_path, "known_files") == {"digest", "commit_id", "size"}
    assert "checksum" in _columns(db_path, "tensor_chunks")


def test_the_schema_check_knows_the_newest_migration():
    assert HEAD_REVISION == head_revision()
    assert KNOWN_REVISIONS[-1] == HEAD_REVISION


def test_a_database_from_a_newer_ckptstore_is_refused(tmp_path, metadata_url):
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo, repo.db.write() as tx:
        tx.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(CkptError, match="newer ckptstore"):
        Repository.open(tmp_path)


def test_a_process_open_before_a_newer_ckptstore_upgraded_the_schema_writes_nothing_after(tmp_path, metadata_url):
    """The revision was checked on open only: a training job's background commits, started before a teammate's
    newer ckptstore upgraded the shared database, went on writing by the older rules (rolling-upgrade audit)."""
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        first = repo.commit({"w": torch.zeros(4)}, message="before")
        with Repository.open(tmp_path) as newer, newer.db.write() as tx:  # what the newer ckptstore's upgrade leaves
            tx.execute("UPDATE alembic_version SET version_num = '9999'")
        refusal = r"schema '9999' since this process opened it at '\d{4}': a newer ckptstore upgraded it meanwhile, so"
        with pytest.raises(CkptError, match=refusal):
            repo.commit({"w": torch.ones(4)}, message="after")
        handle = repo.commit({"w": torch.full((4,), 2.0)}, message="after, in the background", blocking=False)
        with pytest.raises(CkptError, match=refusal):  # raised where the job asks for its result, not lost
            handle.result()
        with pytest.raises(CkptError, match=refusal):
            repo.branch("later")
        with repo.db.read() as tx:
            assert tx.column("SELECT id FROM commits") == [first]


def test_a_schema_taken_back_while_a_process_ran_is_said_so_and_written_nothing(tmp_path, metadata_url):
    """Older than the process opened it (a backup restored, a downgrade): not 'a newer ckptstore upgraded it'."""
    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        first = repo.commit({"w": torch.zeros(4)}, message="before")
        with Repository.open(tmp_path) as restorer, restorer.db.write() as tx:
            tx.execute("UPDATE alembic_version SET version_num = '0009'")
        with pytest.raises(CkptError, match=r"was taken back to metadata schema '0009' since this process opened "
                                            r"it at '\d{4}' \(a backup restored, or a downgrade\), so nothing was "
                                            r"recorded \(objects it stored are left for `ckpt gc`\); start this "
                                            r"process again"):
            repo.commit({"w": torch.ones(4)}, message="after")
        with repo.db.read() as tx:
            assert tx.column("SELECT id FROM commits") == [first]


def test_a_revision_row_taken_back_over_newer_tables_is_named_with_what_to_do_and_changes_nothing(tmp_path,
                                                                                                  metadata_url):
    """alembic_version rewritten to 0005 over 0011's tables: every command, fsck too, said "unexpected
    OperationalError … table pruned_commits already exists … please report it" (damaged-metadata audit, helper 314)."""
    from tests.conftest import ckpt_here

    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        first = repo.commit({"w": torch.zeros(4)}, message="before")
        with repo.db.write() as tx:
            tx.execute("UPDATE alembic_version SET version_num = '0005'")
    for verb in ("status", "fsck"):
        result = ckpt_here(tmp_path, verb)
        assert result.returncode == 1
        assert "records schema revision '0005', but its tables are not that revision's" in result.stderr
        assert f"UPDATE alembic_version SET version_num = '{HEAD_REVISION}'" in result.stderr
    from ckptstore.metadata.migrate import make_engine

    engine = make_engine(metadata_url or f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}")
    with engine.connect() as conn:  # the refused upgrade left the row and the commits as they were
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "0005"
        assert [row[0] for row in conn.exec_driver_sql("SELECT id FROM commits")] == [first]
    engine.dispose()


def test_a_newer_ckptstore_upgrading_between_our_check_and_our_upgrade_is_the_same_refusal(tmp_path, monkeypatch):
    from ckptstore.metadata import migrate

    url = f"sqlite:///{tmp_path / 'ckpt.db'}"
    upgrade(url, "0007")

    def raced(target, revision="head"):  # another process, with a newer ckptstore, upgraded it meanwhile
        with sqlite3.connect(tmp_path / "ckpt.db") as other:
            other.execute("UPDATE alembic_version SET version_num = '9999'")
        return upgrade(target, revision)

    monkeypatch.setattr(migrate, "upgrade", raced)
    with pytest.raises(CkptError, match="'9999', written by a newer ckptstore"):
        Database(url)


def test_of_clients_opening_an_older_schema_at_once_only_the_one_that_upgraded_it_says_so(tmp_path, monkeypatch):
    """Each client warned that it had upgraded the shared schema, by the revision it read before the writers'
    lock; the one that found it upgraded under the lock did nothing (rolling-upgrade audit)."""
    import warnings

    from ckptstore.metadata import migrate
    from ckptstore.metadata.migrate import downgrade

    Repository.init(tmp_path).close()
    url = f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}"
    downgrade(url, "0009")
    real = migrate.upgrade

    def another_client_first(target, revision="head"):  # another machine's newer client upgraded it meanwhile
        real(target, revision)
        return real(target, revision)

    monkeypatch.setattr(migrate, "upgrade", another_client_first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Repository.open(tmp_path).close()
    assert [str(w.message) for w in caught if "upgraded the metadata schema" in str(w.message)] == []
    downgrade(url, "0009")
    monkeypatch.setattr(migrate, "upgrade", real)
    with pytest.warns(RuntimeWarning, match="upgraded the metadata schema of .* from 0009 to"):
        Repository.open(tmp_path).close()


def test_a_backup_restored_from_vacuum_into_is_put_back_in_wal_when_opened_to_write(tmp_path):
    Database(f"sqlite:///{tmp_path / 'ckpt.db'}").close()
    with sqlite3.connect(tmp_path / "ckpt.db") as original:
        original.execute(f"VACUUM INTO '{tmp_path / 'restored.db'}'")
    mode = lambda: sqlite3.connect(tmp_path / "restored.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode() == "delete"  # what a backup made so holds
    Database(f"sqlite:///{tmp_path / 'restored.db'}", read_only=True).close()
    assert mode() == "delete"  # a reader changes nothing
    Database(f"sqlite:///{tmp_path / 'restored.db'}").close()
    assert mode() == "wal"


def test_database_uses_wal(tmp_path):  # SQLite only: the file's journal
    with Repository.init(tmp_path) as repo, repo.db.read() as tx:
        assert tx.scalar("PRAGMA journal_mode") == "wal"
        assert tx.scalar("PRAGMA synchronous") == 2  # FULL


def test_a_write_that_fails_leaves_nothing(tmp_path, metadata_url):
    db = Database(metadata_url or f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(RuntimeError), db.write() as tx:
        tx.execute("INSERT INTO refs (name, kind, target) VALUES ('HEAD', 'head', 'main')")
        raise RuntimeError("boom")
    with db.read() as tx:
        assert tx.rows("SELECT * FROM refs") == []
    db.close()


def test_migrations_build_the_schema_that_schema_py_mirrors(tmp_path, metadata_url):
    from sqlalchemy import inspect

    from ckptstore.metadata.migrate import make_engine
    from ckptstore.metadata.schema import metadata

    with Repository.init(tmp_path, metadata_url=metadata_url):
        pass
    engine = make_engine(metadata_url or f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}")
    try:
        found = inspect(engine)
        for table in metadata.sorted_tables:
            assert {c["name"] for c in found.get_columns(table.name)} == {c.name for c in table.columns}, table.name
            assert set(found.get_pk_constraint(table.name)["constrained_columns"]) == {
                c.name for c in table.primary_key.columns}, table.name
    finally:
        engine.dispose()


def test_files_known_to_a_pruned_commit_stay_known_through_later_commits(tmp_path, metadata_url):
    import torch

    from ckptstore.repo import gc

    with Repository.init(tmp_path, metadata_url=metadata_url) as repo:
        torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
        repo.branch("side", repo.commit({"w": torch.zeros(3)}))
        repo.commit(tmp_path / "a.pt", branch="side")  # the first commit of this file's content
        repo.commit(tmp_path / "a.pt", message="the same file on main", allow_empty=True)
        repo.delete_branch("side")
        assert gc(repo, prune_unreachable=True).commits_removed == 1
        assert [f["state"] for f in repo.status()["files"]] == ["unchanged"]
        repo.checkout_to("HEAD")  # would refuse to overwrite a file whose content no commit holds


def test_an_upgrade_says_older_ckptstores_are_shut_out_and_a_new_repository_says_nothing(tmp_path):
    """Any command of a newer ckptstore upgraded a team's repository without a word: the older machines' next
    command was refused (auditor)."""
    import warnings

    from ckptstore.metadata.migrate import downgrade

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Repository.init(tmp_path).close()
    db_path = tmp_path / ".ckpt" / "ckpt.db"
    with sqlite3.connect(db_path) as conn:
        tables = conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
    downgrade(f"sqlite:///{db_path}", "0009")
    with pytest.warns(RuntimeWarning, match=r"upgraded the metadata schema of .* from 0009 to 0012: a ckptstore "
                                            r"older than this one can no longer open it"):
        Repository.open(tmp_path).close()
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == tables


def test_a_0009_repository_is_read_as_it_is_where_it_cannot_be_written(tmp_path):
    """0010 changed no table, yet a read-only open of every 0009 repository was refused (reader)."""
    with Repository.init(tmp_path) as repo:
        cid = repo.commit({"w": torch.ones(4)})
    with sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0009'")
    with Repository.open(tmp_path, read_only=True) as repo:
        assert [c.id for c in repo.log()] == [cid] and torch.equal(repo.checkout(cid)["w"], torch.ones(4))
        assert repo.db.revision() == "0009"


def _rows(path) -> dict[str, set[tuple]]:
    """Every table's rows, each row as {column: value} in column-name order (a rebuild may reorder columns)."""
    from ckptstore.metadata.tables import TABLES

    found = {}
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in TABLES:
            names = sorted(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))
            select = ", ".join(f'"{name}"' for name in names)
            found[table] = {tuple(zip(names, row)) for row in conn.execute(f"SELECT {select} FROM {table}")}
    return found


def _without(rows: set[tuple], **values) -> set[tuple]:
    """`rows` with the columns in `values` set to those values."""
    return {tuple((name, values.get(name, value)) for name, value in row) for row in rows}


def test_every_downgrade_and_upgrade_back_keeps_every_row_an_older_schema_can_hold(tmp_path):
    """The 0006 upgrade's copy of known_files could go and no test saw it: every file then counted as unsaved work
    checkout would overwrite (mutation audit). Each older revision, from the same database: down to it, up to
    head, and every table holds what that revision's schema could keep."""
    from ckptstore.metadata.migrate import downgrade
    from ckptstore.repo import pruning, remote
    from ckptstore.repo.config import RetentionPolicy
    from tests.conftest import assert_same

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.arange(8.0)}, run / "model.pt")
    torch.save({"m": torch.ones(5)}, run / "optim.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    seeded = lambda seed, n: torch.randn(n, generator=torch.Generator().manual_seed(seed))
    with Repository.init(tmp_path / "repo") as repo:
        repo.commit({"w": seeded(0, 300)}, message="pruned later", step=0)
        tagged = repo.commit({"w": seeded(1, 300)}, step=1, metrics={"loss": 2.5})
        repo.tag("v1", tagged)
        repo.branch("side", tagged)
        repo.commit(run, message="a run folder", branch="side", step=2)
        repo.commit(tmp_path / "a.pt", branch="side")  # one file's content in two commits: two known_files rows
        repo.commit(tmp_path / "a.pt", message="the same file on main", allow_empty=True)
        repo.commit({"w": seeded(2, 5000), "b": seeded(3, 64)}, lossy="balanced", metrics={"loss": 1.5}, step=3)
        pruned = repo.log()[-1].id
        assert pruning.prune(repo, RetentionPolicy(keep_last=3)).pruned == [pruned]
        head = repo.resolve("main")
        restored = repo.checkout(head)  # lossy: what it restores, not what was committed
    with Repository.init(tmp_path / "other") as other:  # a push into the repository: unchecked_tensors rows
        remote.add(other, "origin", str(tmp_path / "repo"))
        other.commit({"w": seeded(4, 300)}, message="theirs")
        other.branch("theirs", "HEAD")
        remote.push(other, "origin", "theirs")
    path = tmp_path / "repo" / ".ckpt" / "ckpt.db"
    saved = tmp_path / "saved.db"
    with contextlib.closing(sqlite3.connect(path)) as live, contextlib.closing(sqlite3.connect(saved)) as copy:
        live.backup(copy)
    before = _rows(path)
    assert all(before[table] for table in before), [table for table in before if not before[table]]
    known_per_digest = {}  # before 0006 a digest had one row: its least commit id (0006's downgrade keeps that)
    for row in sorted(before["known_files"]):
        known_per_digest.setdefault(dict(row)["digest"], row)
    assert len(known_per_digest) < len(before["known_files"])
    url = f"sqlite:///{path}"
    for revision in sorted((r for r in KNOWN_REVISIONS if r < HEAD_REVISION), reverse=True):
        with contextlib.closing(sqlite3.connect(saved)) as copy, contextlib.closing(sqlite3.connect(path)) as live:
            copy.backup(live)  # each revision from the same database: the losses below do not add up
        downgrade(url, revision)
        upgrade(url)
        expected = dict(before)
        # what an older schema has no place for is gone, as its downgrade says; every other row must come back
        if revision < "0009":  # no unchecked_tensors table: upgraded, every record is listed as unchecked
            expected["unchecked_tensors"] = {(("tensor_id", dict(row)["id"]),) for row in before["tensors"]}
        if revision < "0008":  # no pruned_commits table: a pruned commit's row stays, its mark goes
            expected["pruned_commits"] = set()
        if revision < "0006":  # known_files keyed by digest alone
            expected["known_files"] = set(known_per_digest.values())
        if revision < "0005":
            expected["tensor_chunks"] = _without(expected["tensor_chunks"], checksum=None)
        if revision < "0004":  # no offset and length: a chunk is a whole object, so packed chunks cannot restore
            expected["tensor_chunks"] = _without(expected["tensor_chunks"], offset=0, length=None)
        if revision < "0003":
            expected["commits"] = _without(expected["commits"], lossy=None)
        if revision < "0002":
            expected["known_files"] = set()
        after = _rows(path)
        if revision < "0011":  # the identity is made anew (a prefix's owner.json names the old one: see 0011)
            assert len(after["repository_identity"]) == 1 and after["repository_identity"] != before[
                "repository_identity"]
            expected["repository_identity"] = after["repository_identity"]
        for table in before:
            assert after[table] == expected[table], (revision, table)
        if revision >= "0004":
            with Repository.open(tmp_path / "repo", read_only=True) as repo:
                assert repo.db.revision() == HEAD_REVISION
                assert repo.resolve("main") == head and repo.commit_info(pruned).pruned == (revision >= "0008")
                assert_same(restored, repo.checkout(head))  # bit-exact: what it restored before


def test_an_upgrade_from_before_0009_lists_every_record_so_none_is_reused_unchecked(tmp_path):
    """Before 0009 each machine listed its received records in its own `.ckpt/received`, which nothing reads now:
    upgraded, a commit of the user's zeros reused a crafted remote's record of them, on this machine or another,
    and restored other bytes (rolling-upgrade audit; reader 28)."""
    from ckptstore.hashing import tensor_id
    from ckptstore.metadata.migrate import downgrade
    from ckptstore.repo import fsck
    from tests.conftest import assert_same, received_lie, unchecked

    with Repository.init(tmp_path) as repo:
        honest = repo.manifest(repo.commit({"v": torch.arange(16.0)})).entries["v"].tensor
    zeros = torch.zeros(16)
    poisoned = tensor_id("torch.float32", (16,), zeros.numpy().view("uint8"))
    received_lie(tmp_path / ".ckpt", poisoned, honest, listed=False)  # the record as an older fetch left it
    downgrade(f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}", "0008")  # its list was a file, on some machine
    with pytest.warns(RuntimeWarning, match="from 0008 to"), Repository.open(tmp_path) as repo:
        assert unchecked(repo, {poisoned, honest}) == {poisoned, honest}
        cid = repo.commit({"v": zeros}, message="my zeros")
        assert_same({"v": zeros}, repo.checkout(cid))
        assert fsck(repo, full=True).ok


def test_a_frozen_lossy_weight_after_an_upgrade_from_before_0009_is_stored_again_once_not_at_every_commit(tmp_path):
    """Its listed record never left the list: every commit encoded the weight anew and stored a full keyframe
    that no row held and gc never reclaimed (reader 29). The commit's own record takes the listed one's rows."""
    from ckptstore.metadata.migrate import downgrade
    from tests.conftest import unchecked

    generator = torch.Generator().manual_seed(0)
    frozen = torch.randn(256, 256, generator=generator)
    trained = torch.randn(64, 64, generator=generator)
    state = lambda step: {"frozen": frozen, "trained": trained * (1 + step)}
    with Repository.init(tmp_path) as repo:
        for step in range(2):
            repo.commit(state(step), step=step, lossy="balanced")
    downgrade(f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}", "0008")
    with pytest.warns(RuntimeWarning, match="from 0008 to"), Repository.open(tmp_path) as repo:
        listed = repo.manifest(repo.resolve("HEAD")).entries["frozen"].tensor
        assert unchecked(repo, {listed}) == {listed}
        cids = [repo.commit(state(step), step=step, lossy="balanced") for step in range(2, 5)]
        stored = [repo.commit_info(cid).stored_bytes for cid in cids]
        assert unchecked(repo, {listed}) == set()
        assert all(repo.manifest(cid).entries["frozen"].tensor == listed for cid in cids)
        # the frozen weight's one keyframe (under a byte per value at balanced), then only the trained one's bytes
        assert stored[0] > frozen.numel() // 2 > 10 * max(stored[1:]), stored


def _read_where_it_cannot_be_written(root, revision: str) -> None:
    """A repository taken back to `revision`, opened read-only: it reads its commit, and fsck finds no damage."""
    from ckptstore.metadata.migrate import downgrade
    from ckptstore.repo import fsck

    with Repository.init(root) as repo:
        cid = repo.commit({"w": torch.ones(4)})
    downgrade(f"sqlite:///{root / '.ckpt' / 'ckpt.db'}", revision)
    with Repository.open(root, read_only=True) as repo:
        assert repo.db.revision() == revision and [c.id for c in repo.log()] == [cid]
        assert fsck(repo, full=True).ok


def test_a_0010_repository_read_where_it_cannot_be_written_is_not_called_damaged(tmp_path):
    """0011 added the identity only joins and gc read: a read-only open of a 0010 repository reads it, and fsck
    there does not report the table as missing."""
    _read_where_it_cannot_be_written(tmp_path, "0010")


def test_a_0011_repository_read_where_it_cannot_be_written_lacks_only_the_gc_lease_and_is_not_called_damaged(
        tmp_path):
    """0012 added gc's delete lease, which only writers read: a read-only open of a 0011 repository reads it as it is,
    and fsck there does not report the table as missing; opened to write, it is upgraded with its one row."""
    _read_where_it_cannot_be_written(tmp_path, "0011")
    with pytest.warns(RuntimeWarning, match="from 0011 to 0012"), Repository.open(tmp_path) as repo:
        with repo.db.read() as tx:
            assert tx.rows("SELECT id, expires_at FROM gc_lease") == [(1, 0.0)]


def test_an_old_revision_missing_one_of_its_tables_is_called_damaged_not_a_rewritten_row(tmp_path):
    """A genuine 0008 database that lost its tensors table was said to have a rewritten revision row, with advice to
    set it to the newest revision: three migrations skipped over a damaged schema (reviewer helper 321)."""
    from tests.conftest import ckpt_here

    url = f"sqlite:///{tmp_path / '.ckpt' / 'ckpt.db'}"
    Repository.init(tmp_path).close()
    downgrade(url, "0008")
    with sqlite3.connect(tmp_path / ".ckpt" / "ckpt.db") as conn:
        conn.execute("DROP TABLE tensors")
    result = ckpt_here(tmp_path, "log")
    assert result.returncode == 1 and "records schema revision '0008', but a table or column of that revision is " \
        "missing" in result.stderr and "restore it from a backup" in result.stderr, result.stderr
    assert "UPDATE alembic_version" not in result.stderr


OLD_REPOSITORIES = Path(__file__).resolve().parents[1] / "fixtures" / "old_repositories"


def _revisions() -> list[str]:
    """Every revision the migration scripts hold, oldest first: one added later is covered as it lands."""
    from alembic.script import ScriptDirectory

    from ckptstore.metadata.migrate import migrations_dir

    return sorted(script.revision for script in ScriptDirectory(str(migrations_dir())).walk_revisions())


def _frozen_rows(revision: str) -> tuple[Path, dict]:
    """The repository the newest release at or before `revision` wrote (make_old_repositories.py froze them).

    Before 0002 no release was made: 0001 holds the 0002 release's rows, less known_files it had no table for.
    """
    frozen = sorted(p for p in OLD_REPOSITORIES.iterdir() if p.name <= max(revision, "0002"))[-1]
    return frozen, json.loads((frozen / "rows.json").read_text())


def _old_repository(root: Path, url: str, revision: str) -> tuple[Path, dict]:
    """A repository whose database was made at `revision` and holds, by plain SQL, what an old release wrote.

    Returns the frozen folder and its record (rows.json).
    """
    from sqlalchemy import inspect, text

    from ckptstore.metadata.migrate import make_engine

    frozen, data = _frozen_rows(revision)
    (root / ".ckpt").mkdir()
    for saved in (frozen / "objects").iterdir():  # <id>.bin, put back at objects/ab/cdef...
        (root / ".ckpt" / "objects" / saved.name[:2]).mkdir(parents=True, exist_ok=True)
        shutil.copy(saved, root / ".ckpt" / "objects" / saved.name[:2] / saved.stem[2:])
    config = data["config_toml"]  # as the release wrote it
    (root / ".ckpt" / "config.toml").write_text(config.replace('metadata_url = ""', f'metadata_url = "{url}"'))
    url = url or f"sqlite:///{root / '.ckpt' / 'ckpt.db'}"
    upgrade(url, revision)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            tables = set(inspect(conn).get_table_names())
            assert revision < data["revision"] or set(data["tables"]) <= tables  # no row left out, but 0001's
            for table, found in data["tables"].items():
                if table in tables:
                    columns = ", ".join(f'"{c}"' for c in found["columns"])
                    values = ", ".join(f":c{i}" for i in range(len(found["columns"])))
                    conn.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({values})"),
                                 [{f"c{i}": v for i, v in enumerate(row)} for row in found["rows"]])
    finally:
        engine.dispose()
    return frozen, data


@pytest.mark.parametrize("revision", _revisions())
def test_a_repository_written_at_each_revision_restores_every_commit_bit_exact_when_opened_and_takes_new_ones(
        tmp_path, metadata_url, revision):
    """Repositories of schemas 0001-0004, the first releases', were never opened by a newer ckptstore in a test
    (auditor helper 355): the rows and objects those releases wrote, frozen, at each revision the scripts hold."""
    import warnings

    from safetensors.torch import load_file

    from ckptstore.repo import fsck
    from tests.conftest import assert_same
    from tests.fixtures.make_old_repositories import flat_state

    frozen, data = _old_repository(tmp_path, metadata_url, revision)
    commits = data["commits"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "upgraded the metadata schema": its own test
        repo = Repository.open(tmp_path)
    with repo:
        assert repo.db.revision() == HEAD_REVISION
        assert repo.resolve("v1") == commits["first"]["id"] and repo.resolve("side") == commits["a file"]["id"]
        for commit in commits.values():
            assert flat_state(repo.checkout(commit["id"])) == commit["state"], commit
        committed = shutil.copy(frozen / "file.bin", tmp_path / "file.safetensors")  # the user kept it
        if revision < "0002":  # no known files yet: its content is not known to be stored
            with pytest.raises(CkptError, match="file.safetensors"):
                repo.checkout_to(commits["a file"]["id"], committed)
        else:  # known: checkout may overwrite it
            repo.checkout_to(commits["a file"]["id"], committed)
        assert flat_state(load_file(committed)) == commits["a file"]["state"]
        old_head, state = repo.resolve("main"), repo.checkout("main")
        state["w"] = state["w"] + 0.001
        new = repo.commit(state, message="today's", step=3)
        assert repo.commit_info(new).parents == [old_head]
        lossy = repo.commit(dict(state, b=state["b"] * 2), message="today's lossy", lossy="balanced")
        for commit in commits.values():
            assert flat_state(repo.checkout(commit["id"])) == commit["state"], commit
        assert_same(state, repo.checkout(new))
        report = fsck(repo, full=True)
        assert report.ok and not report.unreferenced_objects, report
        assert [c.id for c in repo.log()][:2] == [lossy, new]
