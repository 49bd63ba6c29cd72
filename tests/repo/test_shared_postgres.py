"""One repository shared by several "machines": folders whose config names the same PostgreSQL database and objects.

Every command here is a real `ckpt` process, as on separate machines.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
import torch

from ckptstore import Repository
from ckptstore.metadata.postgres import REPO_LOCK, WRITE_LOCK
from ckptstore.repo import fsck
from ckptstore.testing.postgres_server import PASSWORD_USER, PostgresServer
from tests.conftest import assert_same, ckpt_env, ckpt_here, wait_until_held
from tests.test_cli_errors import one_error_line

ROOT = Path(__file__).resolve().parents[2]


def ckpt(cwd: Path, *args: str, wait: bool = True):
    """`ckpt ARGS` on one machine: a process of its own when it must run beside others (wait=False), else here."""
    if wait:
        return ckpt_here(cwd, *args)
    env = ckpt_env()
    return subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def machines(tmp_path: Path, url: str, count: int = 2) -> list[Path]:
    """`count` folders joined to one repository: the metadata at `url`, the objects in one shared folder."""
    objects = f"file://{tmp_path / 'shared-objects'}"
    folders = []
    for i in range(count):
        folder = tmp_path / f"machine{i}"
        folder.mkdir()
        result = ckpt(folder, "init", "--objects", objects, "--metadata", url)
        assert result.returncode == 0, result.stderr
        assert "postgresql://postgres@127.0.0.1" in result.stdout
        folders.append(folder)
    return folders


def save(folder: Path, name: str, seed: int) -> dict:
    state = {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(seed)), "seed": seed}
    torch.save(state, folder / name)
    return state


def test_two_machines_commit_to_two_branches_at_once_and_every_commit_is_there(postgres_url, tmp_path):
    first, second = machines(tmp_path, postgres_url)
    states = {}
    for folder, branch in ((first, "run-a"), (second, "run-b")):
        for i in range(3):
            states[(branch, i)] = save(folder, f"{branch}-{i}.pt", hash((branch, i)) % 1000)
    env = ckpt_env()
    script = " && ".join(f"{sys.executable} -m ckptstore commit {{b}}-{i}.pt --branch {{b}} -m {{b}}-{i}"
                         for i in range(3))
    runs = [subprocess.Popen(["bash", "-c", script.format(b=branch)], cwd=folder, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # each machine commits three times in a row
            for folder, branch in ((first, "run-a"), (second, "run-b"))]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    log = json.loads(ckpt(first, "log", "--all", "--json").stdout)
    assert sorted(c["message"] for c in log) == sorted(f"{b}-{i}" for b in ("run-a", "run-b") for i in range(3))
    with Repository.open(second) as repo:  # each machine reads what the other committed
        assert fsck(repo).ok
        for branch in ("run-a", "run-b"):
            for i in range(3):
                assert_same(states[(branch, i)], repo.checkout(f"{branch}~{2 - i}"))


def _waiting_writers(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0]


def test_two_machines_moving_one_branch_get_exactly_one_conflict_and_lose_nothing(postgres_url, tmp_path):
    first, second = machines(tmp_path, postgres_url)
    base = save(first, "base.pt", 1)
    assert ckpt(first, "commit", "base.pt", "-m", "base").returncode == 0
    states = [save(folder, "next.pt", seed) for folder, seed in ((first, 2), (second, 3))]
    with psycopg.connect(postgres_url, autocommit=True) as holder:
        holder.execute(f"SELECT pg_advisory_lock({WRITE_LOCK})")  # both read main, then queue to move it
        runs = [ckpt(folder, "commit", "next.pt", "-m", folder.name, wait=False) for folder in (first, second)]
        deadline = time.time() + 120
        while _waiting_writers(postgres_url) < 2 and time.time() < deadline and all(r.poll() is None for r in runs):
            time.sleep(0.05)
        assert _waiting_writers(postgres_url) == 2
        holder.execute(f"SELECT pg_advisory_unlock({WRITE_LOCK})")
    results = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert sorted(code for code, _, _ in results) == [0, 3], results  # 3: ConflictError
    loser = next(i for i, (code, _, _) in enumerate(results) if code == 3)
    lines = results[loser][2].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: main moved to") and "Traceback" not in results[loser][2]
    assert ckpt((first, second)[loser], "commit", "next.pt", "-m", "again").returncode == 0  # commit again: on top
    with Repository.open(first) as repo:
        log = repo.log()
        assert [c.message for c in log][-1] == "base" and len(log) == 3 and fsck(repo).ok
        assert_same(base, repo.checkout("main~2"))
        assert_same(states[1 - loser], repo.checkout("main~1"))
        assert_same(states[loser], repo.checkout("main"))


def _waiting_for(url: str, key: int) -> int:
    """How many sessions wait for advisory lock `key` (pg_locks shows its low 32 bits as objid)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                            "AND objid = %s", (key & 0xFFFF_FFFF,)).fetchone()[0]


def _until(condition, processes, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline and all(p.poll() is None for p in processes):
        time.sleep(0.05)


def test_gc_on_one_machine_waits_for_a_commit_in_flight_on_another(postgres_url, tmp_path):
    first, second = machines(tmp_path, postgres_url)
    save(first, "old.pt", 1)
    assert ckpt(first, "commit", "old.pt").returncode == 0
    state = save(second, "new.pt", 2)
    with psycopg.connect(postgres_url, autocommit=True) as holder:
        holder.execute(f"SELECT pg_advisory_lock({WRITE_LOCK})")  # the commit writes its objects, then waits here
        commit = ckpt(second, "commit", "new.pt", "-m", "in flight", wait=False)
        _until(lambda: _waiting_for(postgres_url, WRITE_LOCK) == 1, [commit])
        assert _waiting_for(postgres_url, WRITE_LOCK) == 1, commit.communicate()
        gc = ckpt(first, "gc", wait=False)  # must not read what is live before that commit is recorded
        _until(lambda: _waiting_for(postgres_url, REPO_LOCK) == 1, [gc])
        assert _waiting_for(postgres_url, REPO_LOCK) == 1 and gc.poll() is None, gc.communicate()
        holder.execute(f"SELECT pg_advisory_unlock({WRITE_LOCK})")
    assert commit.wait(timeout=120) == 0, commit.communicate()
    assert gc.wait(timeout=120) == 0, gc.communicate()
    with Repository.open(first) as repo:
        assert fsck(repo, full=True).ok and fsck(repo).unreferenced_objects == 0
        assert_same(state, repo.checkout("HEAD"))


def test_joining_a_repository_without_commits_says_it_joined(postgres_url, tmp_path):
    """A teammate's repository with no commit yet: its second machine's init said "Initialized empty", as if it had
    made a repository of its own (auditor)."""
    objects = ["--objects", f"file://{tmp_path / 'team-objects'}"]  # both URLs: the objects each machine sees
    assert ckpt(tmp_path, "init", "a", "--metadata", postgres_url, *objects).stdout.startswith("Initialized empty")
    joined = ckpt(tmp_path, "init", "b", "--metadata", postgres_url, *objects)
    assert joined.returncode == 0 and joined.stdout.startswith("Joined the ckptstore repository"), joined


def test_joining_keeps_the_repository_as_it_is(postgres_url, tmp_path):
    team_objects = f"file://{tmp_path / 'team-objects'}"  # a folder of objects each machine sees (objects of its
    # own .ckpt/ would hold none of the commits: such a join is refused, tests/repo/test_creation.py)
    with Repository.init(tmp_path / "a", objects_url=team_objects, metadata_url=postgres_url) as repo:
        cid = repo.commit({"w": torch.ones(2)})
        repo.branch("side")
        repo.checkout_to("side", tmp_path / "out.pt")
    result = ckpt(tmp_path, "init", "b", "--metadata", postgres_url, "--objects", team_objects)
    assert result.returncode == 0 and result.stdout.startswith("Joined the ckptstore repository"), result
    with Repository.open(tmp_path / "b") as repo:
        assert repo.branches() == {"main": cid, "side": cid} and repo.head() == ("main", cid)


def test_the_metadata_and_objects_of_two_repositories_are_never_paired(postgres_server, tmp_path):
    import pytest

    from ckptstore.errors import RepoExistsError
    from ckptstore.repo import gc

    team_objects, team_db = f"file://{tmp_path / 'team-objects'}", postgres_server.new_database()
    with Repository.init(tmp_path / "a", objects_url=team_objects, metadata_url=team_db) as repo:
        cid = repo.commit({"w": torch.ones(4)})
    empty_db = postgres_server.new_database()
    for attempt in range(2):  # a refusal leaves no schema behind that would let the same command through
        with pytest.raises(RepoExistsError, match="already holds objects that no commit"):
            Repository.init(tmp_path / f"b{attempt}", objects_url=team_objects, metadata_url=empty_db)
    with pytest.raises(RepoExistsError, match="holds none of the objects that the metadata .* or the bucket lost them"):
        Repository.init(tmp_path / "c", objects_url=f"file://{tmp_path / 'other-objects'}", metadata_url=team_db)
    # another repository's metadata with no commit yet, joined with the team's prefix: its gc would delete them all
    Repository.init(tmp_path / "y", objects_url=f"file://{tmp_path / 'y-objects'}", metadata_url=empty_db).close()
    with pytest.raises(RepoExistsError, match="already holds objects that no commit"):
        Repository.init(tmp_path / "e", objects_url=team_objects, metadata_url=empty_db)
    assert not any((tmp_path / name).exists() for name in ("b0", "b1", "c", "e"))
    with Repository.init(tmp_path / "d", objects_url=team_objects, metadata_url=team_db) as joined:
        gc(joined)
        assert_same({"w": torch.ones(4)}, joined.checkout(cid))
        assert fsck(joined).ok


def test_a_machine_joins_while_the_first_commit_uploads(postgres_server, tmp_path, monkeypatch):
    """The metadata names nothing yet and the prefix holds that commit's objects: the commit's lock says they are its.

    (Nothing in flight, the same join is refused: test_the_metadata_and_objects_of_two_repositories_are_never_paired.)
    """
    import threading

    objects, database = f"file://{tmp_path / 'team-objects'}", postgres_server.new_database()
    go = tmp_path / "go"
    monkeypatch.setenv("CKPT_WAIT_AT", f"commit:objects-written={go}")
    first = Repository.init(tmp_path / "a", objects_url=objects, metadata_url=database)
    done = {}
    writer = threading.Thread(target=lambda: done.update(cid=first.commit({"w": torch.ones(5000)}, "first")))
    writer.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "go.reached").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    monkeypatch.delenv("CKPT_WAIT_AT")
    try:
        Repository.init(tmp_path / "b", objects_url=objects, metadata_url=database).close()
    finally:
        go.touch()
        writer.join(60)
        first.close()
    with Repository.open(tmp_path / "b") as joined:
        assert_same({"w": torch.ones(5000)}, joined.checkout(done["cid"]))


def _cut_the_lock_session_at(point: str, server, url: str, monkeypatch, then=lambda: None) -> None:
    """At fault point `point`, end the session holding the repository lock (as a restart would), then `then()`.

    Only in the database at `url`: under xdist another test's gc on the same server holds the same lock key.
    """
    from ckptstore import faults

    passing = faults.point
    database = url.rsplit("/", 1)[1].split("?")[0]

    def cut(name):
        if name == point:
            server.execute(f"SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND objid = "
                           f"{REPO_LOCK} AND granted AND database = (SELECT oid FROM pg_database WHERE datname = "
                           f"'{database}')")
            then()
        passing(name)

    monkeypatch.setattr(faults, "point", cut)


def test_a_commit_whose_lock_session_was_cut_records_nothing(postgres_server, postgres_url, tmp_path, monkeypatch):
    """A cut session releases the lock: a gc elsewhere may then delete the objects the commit wrote."""
    import pytest

    from ckptstore.errors import CkptError

    with Repository.init(tmp_path, objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url) as repo:
        first = repo.commit({"w": torch.zeros(100)})
        # between objects and record
        _cut_the_lock_session_at("commit:manifest-written", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(CkptError, match="lost the repository lock .* nothing was recorded"):
            repo.commit({"w": torch.ones(100)})
        monkeypatch.undo()
        assert [c.id for c in repo.log()] == [first]
        second = repo.commit({"w": torch.ones(100)})  # the next command takes the lock anew
        assert_same({"w": torch.ones(100)}, repo.checkout(second))
        assert fsck(repo).ok


def test_a_gc_whose_lock_session_was_cut_stops_deleting_before_a_commit_elsewhere_loses_an_object(
        postgres_server, postgres_url, tmp_path, monkeypatch):
    """gc went on deleting after a server restart ended its lock: a second machine's commit of the same bytes,
    made in between, found the objects present, uploaded nothing, and was left broken (auditor, high)."""
    import pytest

    from ckptstore.errors import CkptError
    from ckptstore.repo.maintenance import gc

    objects = f"file://{tmp_path / 'objects'}"
    state = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(1))}
    with Repository.init(tmp_path / "a", objects_url=objects, metadata_url=postgres_url) as repo:
        kept = repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit(state, branch="x")
        repo.delete_branch("x")  # its objects are garbage now
        made = {}

        def commit_elsewhere():
            with Repository.init(tmp_path / "b", objects_url=objects, metadata_url=postgres_url) as other:
                other.branch("y", kept)
                made["y"] = other.commit(state, branch="y")

        _cut_the_lock_session_at("gc:db-committed", postgres_server, postgres_url, monkeypatch, then=commit_elsewhere)
        with pytest.raises(CkptError, match="lost the repository lock .* deleting stopped"):
            gc(repo, prune_unreachable=True)
        monkeypatch.undo()
    with Repository.open(tmp_path / "b") as other:
        assert_same(state, other.checkout(made["y"]))
        gc(other, prune_unreachable=True)  # run again: it finishes, and takes nothing y needs
        assert_same(state, other.checkout("y")) and fsck(other).ok


def test_a_gc_whose_lock_session_ended_during_a_delete_names_that_object_and_fsck(postgres_server, postgres_url,
                                                                                    tmp_path, monkeypatch):
    """A delete under way when the lock went (a throttling bucket retries one for a minute) can remove an object a
    commit elsewhere found present meanwhile: gc said "no commit made elsewhere meanwhile loses an object", and a
    gc whose last delete was the one said nothing at all (auditor helper 350)."""
    import pytest

    from ckptstore.errors import LostLockError
    from ckptstore.repo.maintenance import gc

    state = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(2))}
    with Repository.init(tmp_path, objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit(state, branch="x")
        repo.delete_branch("x")  # its objects are garbage now
        deleted, delete = [], repo.store.delete
        monkeypatch.setattr(repo.store, "delete", lambda oid: (deleted.append(oid), delete(oid))[1])
        _cut_the_lock_session_at("gc:object-deleted", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(LostLockError) as lost:
            gc(repo, prune_unreachable=True)
        monkeypatch.undo()
    assert deleted and f"object {deleted[-1]} was being deleted" in str(lost.value) and "ckpt fsck" in str(lost.value)
    assert "no commit made elsewhere meanwhile loses" not in str(lost.value)


def _chunk_objects(repo) -> set[str]:
    with repo.db.read() as tx:
        return set(tx.column("SELECT object_id FROM tensor_chunks"))


def test_a_gc_whose_lock_went_during_a_slow_delete_holds_a_commit_elsewhere_until_the_delete_has_landed(
        postgres_server, postgres_url, s3_url, tmp_path, monkeypatch):
    """A delete retried against a throttling bucket landed after gc's lock session had ended: a commit on another
    machine, made meanwhile, found the object present, uploaded nothing, recorded it, and lost it; only fsck found
    it (auditor, high). gc's delete lease now holds that commit until the delete can no longer land: it then
    finds the object gone, uploads it again, and loses nothing."""
    import threading

    from ckptstore import faults
    from ckptstore.errors import LostLockError
    from ckptstore.objectstore.fallback import held_here
    from ckptstore.repo import maintenance

    state = {"w": torch.randn(50_000, generator=torch.Generator().manual_seed(3))}
    monkeypatch.setattr(maintenance, "LEASE_MARGIN_S", 0.0, raising=False)
    with Repository.init(tmp_path / "a", objects_url=s3_url, metadata_url=postgres_url) as repo, \
            Repository.init(tmp_path / "b", objects_url=s3_url, metadata_url=postgres_url) as other:
        held_here(repo.store).delete_lands_within = 6.0  # the test's delete lands within a second or two
        kept = repo.commit({"w": torch.zeros(100)})
        before = _chunk_objects(repo)
        repo.branch("x")
        repo.commit(state, branch="x")
        needed = _chunk_objects(repo) - before
        repo.delete_branch("x")  # its objects are garbage now
        other.branch("y", kept)
        made, reached, waited = {}, threading.Event(), []

        def commit_elsewhere():
            try:
                made["y"] = other.commit(state, branch="y")  # the same bytes: it finds the objects present
            finally:
                reached.set()

        passing = faults.point

        def at(name):
            if name == "lock:gc-lease-wait":
                waited.append(name)
                reached.set()  # holding off: the delete lands now
            passing(name)

        monkeypatch.setattr(faults, "point", at)
        committing = threading.Thread(target=commit_elsewhere)
        delete = repo.store.delete

        def slow_delete(oid):
            if oid in needed and not committing.ident:  # the first of the needed objects
                postgres_server.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = "
                                        f"'advisory' AND objid = {REPO_LOCK} AND granted")  # gc's lock session
                committing.start()
                assert reached.wait(120)
            delete(oid)  # lands after the commit elsewhere looked (or, held off, before it does)

        monkeypatch.setattr(repo.store, "delete", slow_delete)
        with pytest.raises(LostLockError) as lost:
            maintenance.gc(repo, prune_unreachable=True)
        committing.join(120)
        monkeypatch.undo()
        report = fsck(other)
        assert report.ok, report  # before: the object y's record names was deleted after y found it present
        assert_same(state, other.checkout(made["y"]))
        # the delete under way then had landed by the next renewal: the lease was ended, and the commit went on
        assert waited and "deleting stopped. No delete it sent is in flight and its delete lease was ended: " \
            "commits elsewhere do not wait. Run the command again" in str(lost.value)


def test_a_gc_that_ends_well_ends_its_delete_lease_and_a_commit_after_it_does_not_wait(postgres_url, s3_url,
                                                                                      tmp_path, monkeypatch):
    """Each delete renews the lease to the database's clock plus what a delete may take; the last ends it."""
    import warnings

    from ckptstore.objectstore.fallback import held_here
    from ckptstore.repo import maintenance

    def lease_left() -> float:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            return conn.execute("SELECT expires_at - extract(epoch FROM clock_timestamp())::float8 "
                                "FROM gc_lease").fetchone()[0]

    with Repository.init(tmp_path, objects_url=s3_url, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit({"w": torch.randn(50_000)}, branch="x")
        repo.delete_branch("x")
        bound = held_here(repo.store).delete_lands_within
        seen, delete = [], repo.store.delete
        monkeypatch.setattr(repo.store, "delete", lambda oid: (seen.append(lease_left()), delete(oid))[1])
        assert maintenance.gc(repo, prune_unreachable=True).objects_removed == len(seen) > 0
        lease = bound + maintenance.LEASE_MARGIN_S
        assert all(lease - 30 < left <= lease for left in seen), (seen, lease)
        assert lease_left() <= 0
        monkeypatch.undo()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a wait for a lease would warn
            repo.commit({"w": torch.ones(100)})


def _lease_left(url: str) -> float:
    """Seconds gc's delete lease still runs on the database's clock (<= 0: none)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT expires_at - extract(epoch FROM clock_timestamp())::float8 FROM gc_lease"
                            ).fetchone()[0]


@pytest.mark.parametrize("stop", ["ctrl-c between deletes", "error between deletes", "ctrl-c mid-delete"])
def test_a_gc_stopped_between_deletes_ends_its_delete_lease_and_one_stopped_mid_delete_keeps_it(
        postgres_url, s3_url, tmp_path, monkeypatch, stop):
    """Ctrl-C (or any error) of a gc after a delete returned left its lease live: every writer on every machine
    waited 6 minutes, told the gc had lost its lock (reviewer 366). No delete is in flight there: the lease ends,
    and a commit goes on at once. One stopped inside a delete (it may land later) keeps it."""
    import warnings

    from ckptstore import faults
    from ckptstore.errors import DiskFullError
    from ckptstore.repo import maintenance

    with Repository.init(tmp_path, objects_url=s3_url, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit({"w": torch.randn(50_000)}, branch="x")
        repo.delete_branch("x")  # its chunk and manifest are garbage: two deletes at least
        if stop == "error between deletes":
            monkeypatch.setenv("CKPT_FAIL_AT", "gc:object-deleted")
        elif stop == "ctrl-c between deletes":
            monkeypatch.setattr(faults, "point", lambda name: _raise(KeyboardInterrupt())
                                if name == "gc:object-deleted" else None)
        else:
            monkeypatch.setattr(repo.store, "delete", lambda oid: _raise(KeyboardInterrupt()))
        with pytest.raises(DiskFullError if stop.startswith("error") else KeyboardInterrupt):
            maintenance.gc(repo, prune_unreachable=True)
        monkeypatch.undo()
        if stop == "ctrl-c mid-delete":
            assert _lease_left(postgres_url) > 300  # the delete it sent may land until then: writers wait
            return
        assert _lease_left(postgres_url) <= 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a wait for a lease would warn
            repo.commit({"w": torch.ones(100)})
        assert maintenance.gc(repo).objects_removed > 0 and fsck(repo).ok


@pytest.mark.parametrize("since", ["nothing", "another gc's lease"])
def test_a_gc_whose_lock_session_ended_between_deletes_ends_its_own_delete_lease_from_another_session(
        postgres_server, postgres_url, s3_url, tmp_path, monkeypatch, since):
    """Its lock session gone at a renewal (a restart, a network blip), gc left its lease to run out though its
    last delete had returned: every writer on every machine waited 6 minutes (auditor helper 364). It is ended
    from a fresh session now, only if it is still the value this gc wrote: another gc's, written since, stays."""
    import warnings

    from ckptstore.errors import LostLockError
    from ckptstore.repo import maintenance

    def another_gcs_lease():
        with psycopg.connect(postgres_url, autocommit=True) as conn:  # as a gc that took the lock since would
            conn.execute("UPDATE gc_lease SET expires_at = extract(epoch FROM clock_timestamp())::float8 + 300")

    with Repository.init(tmp_path, objects_url=s3_url, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit({"w": torch.randn(50_000)}, branch="x")
        repo.delete_branch("x")  # its chunk and manifest are garbage: two deletes at least
        _cut_the_lock_session_at("gc:object-deleted", postgres_server, postgres_url, monkeypatch,
                                 then=another_gcs_lease if since != "nothing" else lambda: None)
        with pytest.raises(LostLockError) as lost:
            maintenance.gc(repo, prune_unreachable=True)
        monkeypatch.undo()
        if since != "nothing":
            assert _lease_left(postgres_url) > 250, "another gc's lease was ended"
            assert "Commits elsewhere wait until a delete it sent can no longer land" in str(lost.value)
            return
        assert _lease_left(postgres_url) <= 0
        assert "its delete lease was ended: commits elsewhere do not wait" in str(lost.value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a wait for a lease would warn
            repo.commit({"w": torch.ones(100)})
        assert maintenance.gc(repo).objects_removed > 0 and fsck(repo).ok


def test_a_ctrl_c_in_gcs_final_lease_ending_round_trip_still_ends_its_delete_lease(postgres_url, s3_url, tmp_path,
                                                                                    monkeypatch):
    """The round trip ending the lease after the last delete sat outside the loop's try: a Ctrl-C in it left the
    lease running its full length, 6 minutes of waiting for every writer (reviewer helper 373). No delete is in
    flight there: it is ended all the same, and the Ctrl-C still comes out."""
    import warnings

    from ckptstore.repo import maintenance

    with Repository.init(tmp_path, objects_url=s3_url, metadata_url=postgres_url) as repo:
        repo.commit({"w": torch.zeros(100)})
        repo.branch("x")
        repo.commit({"w": torch.randn(50_000)}, branch="x")
        repo.delete_branch("x")
        renew, interrupted = repo.db.backend.renew_gc_lease, []

        def ctrl_c_at_the_end(connection, seconds):
            if seconds == 0.0 and not interrupted:  # the first try to end it: the user's Ctrl-C lands in it
                interrupted.append(seconds)
                raise KeyboardInterrupt
            return renew(connection, seconds)

        monkeypatch.setattr(repo.db.backend, "renew_gc_lease", ctrl_c_at_the_end)
        with pytest.raises(KeyboardInterrupt):
            maintenance.gc(repo, prune_unreachable=True)
        monkeypatch.undo()
        assert interrupted and _lease_left(postgres_url) <= 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a wait for a lease would warn
            repo.commit({"w": torch.ones(100)})


def _raise(exc: BaseException):
    raise exc


def test_a_prune_whose_lock_session_was_cut_after_it_was_recorded_says_so(postgres_server, postgres_url, tmp_path,
                                                                          monkeypatch):
    """It said "nothing was recorded" of a prune its database had recorded; only the clean-up was left."""
    import pytest

    from ckptstore.errors import LostLockError
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.maintenance import gc
    from ckptstore.repo.pruning import prune

    with Repository.init(tmp_path, objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url) as repo:
        states = [{"w": torch.randn(20_000, generator=torch.Generator().manual_seed(i))} for i in range(3)]
        cids = [repo.commit(state) for state in states]
        _cut_the_lock_session_at("prune:db-committed", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(LostLockError, match="the prune of 2 commit.s. was recorded, but the repository lock .* "
                                                "was lost before its clean-up .*: run `ckpt gc`") as lost:
            prune(repo, RetentionPolicy(keep_last=1))
        assert "nothing was recorded" not in str(lost.value)  # gc's line for a lock lost before it deleted
        monkeypatch.undo()
        assert [repo.commit_info(c).pruned for c in cids] == [True, True, False]
        assert gc(repo).objects_removed > 0 and fsck(repo).ok
        assert_same(states[2], repo.checkout(cids[2]))


def test_a_prune_whose_lock_went_during_its_clean_up_keeps_gcs_line_naming_the_object(postgres_server, postgres_url,
                                                                                       tmp_path, monkeypatch):
    """Prune rewrote gc's lost-lock line as "lost before its clean-up", dropping the object being deleted and the
    advice to run fsck that 0ba727a added (reviewer helper 351)."""
    import pytest

    from ckptstore.errors import LostLockError
    from ckptstore.repo.config import RetentionPolicy
    from ckptstore.repo.pruning import prune

    with Repository.init(tmp_path, objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url) as repo:
        for seed in range(3):
            repo.commit({"w": torch.randn(20_000, generator=torch.Generator().manual_seed(seed))})
        deleted, delete = [], repo.store.delete
        monkeypatch.setattr(repo.store, "delete", lambda oid: (deleted.append(oid), delete(oid))[1])
        _cut_the_lock_session_at("gc:object-deleted", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(LostLockError) as lost:
            prune(repo, RetentionPolicy(keep_last=1))
        monkeypatch.undo()
    said = str(lost.value)
    assert "the prune of 2 commit(s) was recorded" in said and f"object {deleted[-1]}" in said and "ckpt fsck" in said


def test_a_gc_with_nothing_to_delete_ends_well_though_its_lock_went_after_its_write(postgres_server, postgres_url,
                                                                                   tmp_path, monkeypatch):
    """0ba727a confirmed the lock after the loop even where nothing was deleted: a gc whose work was done failed
    with "deleting stopped, run the command again" (reviewer helper 351)."""
    from ckptstore.repo.maintenance import gc

    with Repository.init(tmp_path, objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url) as repo:
        cid = repo.commit({"w": torch.ones(100)})
        _cut_the_lock_session_at("gc:db-committed", postgres_server, postgres_url, monkeypatch)
        assert gc(repo).objects_removed == 0
        monkeypatch.undo()
        assert_same({"w": torch.ones(100)}, repo.checkout(cid))


def test_a_stopped_server_is_one_clear_line_and_the_command_works_once_it_is_back(tmp_path):
    with PostgresServer() as server:
        url = server.new_database()
        folder = tmp_path / "m"
        folder.mkdir()
        save(folder, "c.pt", 5)
        assert ckpt(folder, "init", "--metadata", url).returncode == 0
        server.stop()
        where = f"cannot reach PostgreSQL at 127.0.0.1:{server.port} (connection refused)"
        one_error_line(ckpt(folder, "commit", "c.pt"), where, "is the server running")
        server.start()
        result = ckpt(folder, "commit", "c.pt")
        assert result.returncode == 0, result.stderr
        assert len(json.loads(ckpt(folder, "log", "--json").stdout)) == 1


@pytest.mark.parametrize("policy", [True, False])
def test_a_commit_recorded_before_the_server_went_away_says_so_with_its_id(tmp_path, policy):
    """The summary line read the database that had gone away: its error replaced "was recorded" (first
    reader), and without a policy the recorded commit exited 1 with no id (second reader)."""
    with PostgresServer() as server:
        folder = tmp_path / "m"
        folder.mkdir()
        save(folder, "c.pt", 5)
        assert ckpt(folder, "init", "--metadata", server.new_database()).returncode == 0
        if policy:
            with open(folder / ".ckpt" / "config.toml", "a") as config:
                config.write("\n[retention]\nkeep_last = 1\n")
        assert ckpt(folder, "commit", "c.pt", "-m", "first").returncode == 0
        save(folder, "c.pt", 6)
        release = tmp_path / "release"
        committing = subprocess.Popen([sys.executable, "-m", "ckptstore", "commit", "c.pt", "-m", "second"],
                                      cwd=folder, env=ckpt_env(CKPT_WAIT_AT=f"commit:ref-moved={release}"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until_held(release, committing)
        server.stop()
        release.touch()
        out, err = committing.communicate(timeout=300)
        assert "Traceback" not in err and out.startswith("[")
        assert out.endswith("] second  (its sizes could not be read)\n")
        recorded = out[1:13]
        if policy:
            assert committing.returncode == 1 and err.startswith(f"error: commit {recorded} was recorded, but the "
                                                                 "[retention] policy's prune")
        else:
            assert committing.returncode == 0 and not err
        server.start()
        assert json.loads(ckpt(folder, "log", "--json").stdout)[0]["id"].startswith(recorded)


def test_wrong_credentials_are_one_clear_line(postgres_server, tmp_path):
    url = postgres_server.url(user=PASSWORD_USER, password="wrong-secret")
    result = ckpt(tmp_path, "init", "--metadata", url)
    one_error_line(result, f"PostgreSQL at 127.0.0.1:{postgres_server.port} refused the login of user "
                           f"'{PASSWORD_USER}'", "password")
    assert "wrong-secret" not in result.stderr
    assert not (tmp_path / ".ckpt").exists()  # nothing half-made: the same command can run again


def test_a_bucket_remote_keeps_its_records_in_postgresql_and_a_machine_joins_it(tmp_path, s3_url, postgres_url):
    """Push from a local repository to a remote on a bucket and a database; another machine joins that remote."""
    from ckptstore.repo import remote

    states = [{"w": torch.randn(50_000, generator=torch.Generator().manual_seed(s))} for s in range(2)]
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", s3_url, metadata_url=postgres_url)
        cids = [work.commit(state, message=f"c{i}") for i, state in enumerate(states)]
        assert remote.push(work, "origin").commits == 2
        assert remote.push(work, "origin").commits == 0  # nothing twice
    folder = tmp_path / "machine"
    folder.mkdir()
    result = ckpt(folder, "init", "--objects", s3_url, "--metadata", postgres_url)
    assert result.returncode == 0 and result.stdout.startswith("Joined the"), result
    with Repository.open(folder) as repo:
        assert repo.branches() == {"main": cids[1]} and fsck(repo).ok
        for cid, state in zip(cids, states):
            assert_same(state, repo.checkout(cid))


def test_a_push_whose_lock_session_on_the_remote_was_cut_says_the_branch_was_not_moved(postgres_server, postgres_url,
                                                                                      tmp_path, monkeypatch):
    """It said "nothing was recorded" of a push whose records had arrived; the rerun sent 0 commits (auditor)."""
    import pytest

    from ckptstore.errors import LostLockError
    from ckptstore.repo import remote

    state = {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(0))}
    Repository.init(tmp_path / "hub", objects_url=f"file://{tmp_path / 'objects'}", metadata_url=postgres_url).close()
    with Repository.init(tmp_path / "work") as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        cid = work.commit(state)
        _cut_the_lock_session_at("transfer:records-sent", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(LostLockError, match="push to origin stopped: .* 'main' was not moved there. Run the push"):
            remote.push(work, "origin")
        monkeypatch.undo()
        assert remote.push(work, "origin").refs_moved == [("main", None, cid)]
    with Repository.open(tmp_path / "hub") as hub:
        assert_same(state, hub.checkout("main")) and fsck(hub).ok


def test_a_fetch_whose_lock_session_here_was_cut_says_no_tracking_ref_moved(postgres_server, postgres_url, tmp_path,
                                                                             monkeypatch):
    """It said "nothing was recorded" of records that had arrived; the rerun copied 0 commits (reader)."""
    import pytest

    from ckptstore.errors import LostLockError
    from ckptstore.repo import remote

    state = {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(0))}
    with Repository.init(tmp_path / "hub") as hub:
        cid = hub.commit(state)
    with Repository.init(tmp_path / "work", objects_url=f"file://{tmp_path / 'objects'}",
                         metadata_url=postgres_url) as work:
        remote.add(work, "origin", str(tmp_path / "hub"))
        _cut_the_lock_session_at("transfer:records-sent", postgres_server, postgres_url, monkeypatch)
        with pytest.raises(LostLockError, match="fetch from origin stopped: .* no origin/BRANCH ref was moved"):
            remote.fetch(work, "origin")
        monkeypatch.undo()
        remote.fetch(work, "origin")
        assert work.resolve("origin/main") == cid and fsck(work).ok
        assert_same(state, work.checkout("origin/main"))


@pytest.mark.parametrize("url, said", [
    ("postgresql://u@127.0.0.1:notaport/db", 'invalid integer value "notaport" for connection option "port"'),
    ("postgresql://127.0.0.1:99999/x", 'invalid port number: "99999"'),
    ("postgresql://127.0.0.1:5432/x?sslmode=bogus", 'invalid sslmode value: "bogus"'),
])
def test_a_metadata_url_that_is_not_valid_is_said_so_not_an_outage(tmp_path, url, said):
    """It said "lost the connection … run the command again once the server is up" (auditor)."""
    assert ckpt(tmp_path, "init").returncode == 0
    config = tmp_path / ".ckpt" / "config.toml"
    config.write_text(config.read_text().replace('metadata_url = ""', f'metadata_url = "{url}"', 1))
    one_error_line(ckpt(tmp_path, "log"), "the metadata URL for PostgreSQL at", "is not valid", said, "fix it")
