"""A command waiting for the repository lock says so, naming who holds it: a commit behind a long gc hung silently.

Every command here is a real `ckpt` process: a gc (or a commit) held at a fault point while it holds the lock,
and a second command started beside it, in the same folder or on another "machine" sharing the PostgreSQL database.
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Repository
from tests.conftest import assert_same, ckpt_env, ckpt_here, end_left_running, wait_until_held

WAITING = "waiting for the repository lock"
SAID_WITHIN_S = 30.0  # the line is due 2 s into the wait; the rest is a loaded machine starting python and torch


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _none_left_running():
    """A failed test's processes (a gc held at its fault point for ever) are ended, not left holding the lock."""
    yield
    end_left_running(_STARTED)


class Running:
    """`ckpt ARGS` in a process of its own, its stderr read as it comes, so a test sees a line mid-wait."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=cwd,
                                        env=ckpt_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        _STARTED.append(self.process)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def line_with(self, words: str, timeout: float = SAID_WITHIN_S) -> str:
        """The first stderr line holding `words`, waited for while the process runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if words in line]
            if found:
                return found[0]
            assert self.process.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no line with {words!r} within {timeout:.0f} s; stderr so far: {''.join(self.lines)!r}")

    def finish(self) -> tuple[int, str, str]:
        out = self.process.stdout.read()
        code = self.process.wait(timeout=300)
        self.reader.join(timeout=60)
        return code, out, "".join(self.lines)


def _held_at(point: str, release: Path, cwd: Path, *args: str) -> Running:
    """`ckpt ARGS` stopped at fault `point` (holding the lock) until `release` exists."""
    running = Running(cwd, *args, env={"CKPT_WAIT_AT": f"{point}={release}"})
    wait_until_held(release, running.process)
    return running


def _checkpoint(folder: Path, seed: int) -> dict:
    state = {"w": torch.randn(30_000, generator=torch.Generator().manual_seed(seed)), "step": seed}
    torch.save(state, folder / "model.pt")
    return state


def _restores(folder: Path, state: dict) -> None:
    """The branch's last commit checks out to `state`, bit for bit."""
    result = ckpt_here(folder, "checkout", "main", "-o", str(folder / "out.pt"))
    assert result.returncode == 0, result.stderr
    assert_same(state, torch.load(folder / "out.pt", weights_only=True))


@pytest.mark.both_backends
def test_a_commit_waiting_for_a_gc_says_so_naming_it_then_commits_when_the_gc_ends(tmp_path, metadata_url):
    Repository.init(tmp_path, metadata_url=metadata_url).close()
    _checkpoint(tmp_path, 1)
    assert ckpt_here(tmp_path, "commit", "model.pt", "-m", "first").returncode == 0
    release = tmp_path / "release"
    gc = _held_at("gc:tmp-cleared", release, tmp_path, "gc")
    state = _checkpoint(tmp_path, 2)
    commit = Running(tmp_path, "commit", "model.pt", "-m", "behind the gc")
    line = commit.line_with(WAITING)
    assert line.startswith("warning: ") and f"`ckpt gc` (pid {gc.process.pid} on " in line, line
    assert commit.process.poll() is None  # it waits, unbounded, while the gc holds the lock
    release.touch()
    assert gc.finish()[0] == 0
    code, _, err = commit.finish()
    assert code == 0 and err.count(WAITING) == 1, err
    _restores(tmp_path, state)
    assert WAITING not in ckpt_here(tmp_path, "gc").stderr  # a free lock: not a word


@pytest.mark.both_backends
def test_a_gc_waiting_for_a_commit_in_flight_says_so(tmp_path, metadata_url):
    Repository.init(tmp_path, metadata_url=metadata_url).close()
    state = _checkpoint(tmp_path, 3)
    release = tmp_path / "release"
    commit = _held_at("commit:objects-written", release, tmp_path, "commit", "model.pt")
    gc = Running(tmp_path, "gc")
    line = gc.line_with(f"{WAITING} of {tmp_path / '.ckpt'}")  # its one line, 2 s into the wait
    assert line.startswith("warning: ") and "commits in flight hold it (shared)" in line, line
    release.touch()
    assert commit.finish()[0] == 0
    code, _, err = gc.finish()
    assert code == 0, err
    _restores(tmp_path, state)  # the gc waited: the commit's objects are all there


def _machines(tmp_path: Path, url: str) -> list[Path]:
    """Two folders joined to one repository: the metadata at `url`, the objects in one shared folder."""
    folders = []
    for name in ("machine-a", "machine-b"):
        folder = tmp_path / name
        folder.mkdir()
        result = ckpt_here(folder, "init", "--objects", f"file://{tmp_path / 'objects'}", "--metadata", url)
        assert result.returncode == 0, result.stderr
        folders.append(folder)
    return folders


def test_a_commit_on_another_machine_waiting_for_a_gc_names_it_from_the_server(tmp_path, postgres_url):
    """No file lock is shared here: only PostgreSQL's advisory lock, whose holder is found in pg_stat_activity."""
    here, there = _machines(tmp_path, postgres_url)
    release = tmp_path / "release"
    gc = _held_at("gc:tmp-cleared", release, here, "gc")
    state = _checkpoint(there, 4)
    commit = Running(there, "commit", "model.pt", "-m", "behind a gc elsewhere")
    line = commit.line_with(WAITING)
    assert "postgresql://" in line and f"`ckpt gc` (pid {gc.process.pid} on " in line, line
    assert "holds it alone" in line and commit.process.poll() is None, line
    release.touch()
    assert gc.finish()[0] == 0
    code, _, err = commit.finish()
    assert code == 0 and err.count(WAITING) == 1, err
    _restores(there, state)
    assert WAITING not in ckpt_here(here, "gc").stderr


def test_a_gc_waiting_for_a_commit_on_another_machine_names_the_commit(tmp_path, postgres_url):
    here, there = _machines(tmp_path, postgres_url)
    state = _checkpoint(there, 5)
    release = tmp_path / "release"
    commit = _held_at("commit:objects-written", release, there, "commit", "model.pt")
    gc = Running(here, "gc")
    line = gc.line_with(f"{WAITING} on postgresql://")  # after gc's own line, said at once, naming no one
    assert f"1 commit(s) in flight hold it shared: `ckpt commit` (pid {commit.process.pid} on " in line, line
    release.touch()
    assert commit.finish()[0] == 0
    code, _, err = gc.finish()
    assert code == 0, err
    _restores(there, state)


def _gate_held_until_let_go(repo_root: Path) -> tuple[threading.Event, threading.Thread]:
    """The folder's lock gate held alone, as a gc holds it, by a descriptor of this process, until the event is set."""
    import fcntl
    import os

    gate = os.open(repo_root / ".ckpt" / "lock.gate", os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(gate, fcntl.LOCK_EX)
    let_go = threading.Event()

    def hold() -> None:
        let_go.wait(timeout=60)
        os.close(gate)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    return let_go, holder


def _lock_warnings(caught: list) -> list:
    return [said for said in caught if WAITING in str(said.message)]


@pytest.mark.parametrize("blocking", [True, False], ids=["commit", "background-commit"])
def test_the_lock_waiting_warning_points_at_the_users_commit_line(tmp_path, monkeypatch, blocking):
    """It pointed at contextlib.py:137, the @contextmanager between the user's call and the lock (reviewer 343)."""
    import warnings

    import ckptstore
    from ckptstore.repo import lock

    monkeypatch.setattr(lock, "LOCK_NOTICE_S", 0.2)
    Repository.init(tmp_path).close()
    let_go, holder = _gate_held_until_let_go(tmp_path)
    threading.Timer(1.0, let_go.set).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        saved = ckptstore.save({"w": torch.ones(4)}, repo=tmp_path, message="behind a gc", blocking=blocking)
        if not blocking:
            saved.result(timeout=60)  # the background commit's thread said it, pointing at the save that started it
    holder.join(timeout=60)
    said = _lock_warnings(caught)
    assert len(said) == 1, [str(w.message) for w in caught]
    assert (said[0].filename, said[0].lineno) == (__file__, line), (said[0].filename, said[0].lineno)


def _waiting_for_the_lock(monitor, count: int) -> None:
    """Wait until `count` sessions are queued for an advisory lock (the repository lock: the only one taken here)."""
    deadline = time.monotonic() + SAID_WITHIN_S
    while time.monotonic() < deadline:
        queued = monitor.execute("SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' "
                                 "AND NOT granted").fetchone()[0]
        if queued >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {count} sessions queued for the repository lock")


def test_a_commit_that_asks_while_a_gc_waits_on_the_server_queues_behind_it(tmp_path, postgres_url):
    """The server queues a shared request behind a waiting gc (format.md); the wait was cut at 2 s (lock_timeout) to
    say so, which took the gc out of the queue: the commit behind it got the lock first (reviewer 343)."""
    import warnings

    import psycopg

    from ckptstore.holders import LOCK_NOTICE_S

    repos = [Repository.init(tmp_path / name, metadata_url=postgres_url, objects_url=f"file://{tmp_path / 'objects'}")
             for name in ("a", "b", "c")]
    granted: list[str] = []
    let_go = threading.Event()

    def hold(repo: Repository, name: str, exclusive: bool, until: threading.Event | None = None) -> None:
        with repo.db.repository_lock(exclusive=exclusive):
            granted.append(name)
            if until is not None:
                until.wait(timeout=60)

    with psycopg.connect(postgres_url, autocommit=True) as monitor, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = threading.Thread(target=hold, args=(repos[0], "C1", False, let_go), daemon=True)
        gc = threading.Thread(target=hold, args=(repos[1], "G", True), daemon=True)
        second = threading.Thread(target=hold, args=(repos[2], "C2", False), daemon=True)
        try:
            first.start()
            while not granted:
                time.sleep(0.01)
            gc.start()
            _waiting_for_the_lock(monitor, 1)
            second.start()
            _waiting_for_the_lock(monitor, 2)
            time.sleep(LOCK_NOTICE_S + 1.0)  # past each waiter's notice
            assert granted == ["C1"], granted  # the commit behind the gc waits for it
        finally:
            let_go.set()
            for thread in (first, gc, second):
                thread.join(timeout=60)
    for repo in repos:
        repo.close()
    assert granted == ["C1", "G", "C2"], granted
    said = _lock_warnings(caught)
    assert len(said) == 2 and all(w.filename == __file__ for w in said), [(w.filename, str(w.message)) for w in said]
    assert "1 commit(s) in flight hold it shared" in str(said[0].message), said[0].message
    assert "(a gc or prune) queues for it first" in str(said[1].message), said[1].message


def test_a_waiter_does_not_blame_a_dead_gc_whose_name_was_left_in_the_gate(tmp_path, monkeypatch):
    """A gc killed -9 leaves `PID@HOST ckpt gc` in lock.gate; a holder after it that cannot rewrite the file (another
    user's) holds the lock unnamed, and a waiting commit named the dead pid (reviewer 343). A tag naming a process of
    this host that is gone is not believed."""
    import socket
    import warnings

    from ckptstore.repo import lock

    monkeypatch.setattr(lock, "LOCK_NOTICE_S", 0.2)
    Repository.init(tmp_path).close()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    let_go, holder = _gate_held_until_let_go(tmp_path)  # the holder after it, which records nothing
    (tmp_path / ".ckpt" / "lock.gate").write_text(f"{dead}@{socket.gethostname()} ckpt gc")
    threading.Timer(1.0, let_go.set).start()
    with warnings.catch_warnings(record=True) as caught, Repository.open(tmp_path) as repo:
        warnings.simplefilter("always")
        repo.commit({"w": torch.ones(4)}, message="behind a gc")
    holder.join(timeout=60)
    said = _lock_warnings(caught)
    assert len(said) == 1, [str(w.message) for w in caught]
    line = str(said[0].message)
    assert f"pid {dead}" not in line and "a ckpt gc or prune (it did not record which process) holds it" in line, line
