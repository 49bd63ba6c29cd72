"""A forked child (a DataLoader worker) holds none of its parent's locks: neither thread locks nor the repository's."""

import os
import signal
import threading
import time

from ckptstore import Repository
from ckptstore.errors import RepoLockedError
from ckptstore.repo import chaincost, planecache, warm
from ckptstore.repo.forked import ProcessLock


def test_a_lock_another_thread_holds_at_the_fork_is_free_in_the_child():
    lock, held, release = ProcessLock(), threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the holder thread does not exist here: a plain Lock would stay held for good
        os._exit(0 if lock._lock.acquire(timeout=5) else 1)
    release.set()
    holder.join()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    # the module locks a background commit holds for long (chain costs: a 2 s measurement) are such locks
    assert all(isinstance(x, ProcessLock) for x in (chaincost._lock, planecache._CACHES_LOCK, warm._LOCK))


def test_a_child_forked_while_a_commit_held_the_repository_lock_does_not_keep_it(tmp_path):
    """Its copies of the flock's descriptor kept the lock for the child's life: gc waited, retention was skipped."""
    with Repository.init(tmp_path) as repo:
        with repo.lock():  # what a background commit holds while it writes
            pid = os.fork()
            if pid == 0:
                time.sleep(30)  # a persistent DataLoader worker
                os._exit(0)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with repo.lock(exclusive=True, wait=False):  # what gc and the retention prune take
                        break
                except RepoLockedError:
                    assert time.monotonic() < deadline, "the child still holds the repository lock"
                    time.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_fork_during_another_threads_metadata_write_waits_for_it_so_the_child_can_write(tmp_path, monkeypatch):
    """SQLite keeps lock bookkeeping per process: forked mid-write, every write of the child waited out its timeout."""
    import torch

    from ckptstore.metadata import sqlite

    monkeypatch.setattr(sqlite, "BUSY_TIMEOUT_MS", 5_000)  # the same failure as at 120 s, sooner
    with Repository.init(tmp_path) as repo:
        repo.commit({"w": torch.zeros(8)})
        inside = threading.Event()

        def record_briefly():  # what a background commit's thread does last
            with repo.db.write():
                inside.set()
                time.sleep(0.5)

        writer = threading.Thread(target=record_briefly)
        writer.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            try:
                repo.commit({"w": torch.ones(8)}, "from the worker", branch="main")
            except BaseException:
                os._exit(1)
            os._exit(0)
        writer.join()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert torch.equal(repo.checkout("HEAD")["w"], torch.ones(8))


HOLDER = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(3)
connection.execute("COMMIT")
"""


def test_a_fork_does_not_wait_for_a_thread_whose_write_waits_on_another_process(tmp_path):
    """Counted before BEGIN, a write queued behind another process made every fork meanwhile wait (up to 30 s)."""
    import subprocess
    import sys

    with Repository.init(tmp_path) as repo:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(repo.db.path)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"  # another process's commit, say
        def write():
            with repo.db.write() as tx:
                tx.execute("SELECT 1")

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)  # the writer waits in BEGIN now
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        took = time.monotonic() - start
        os.waitpid(pid, 0)
        writer.join()
        holder.wait()
    assert took < 1.5


INTERRUPTED_FORK = """
import os, signal, sys, threading, time
from ckptstore import Repository
from ckptstore.metadata import db

repo = Repository.init(sys.argv[1])
os.register_at_fork(after_in_parent=lambda: time.sleep(0.3))  # a library's hook, run after ckptstore's
inside, done = threading.Event(), threading.Event()

def write():  # another thread's write, held for long: a fork waits for it
    with repo.db.write() as tx:
        tx.execute("SELECT 1")
        inside.set()
        done.wait(20)

threading.Thread(target=write, daemon=True).start()
inside.wait()
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the fork waits
start = time.monotonic()
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    for _ in range(100):  # the parent goes on; the Ctrl-C must reach it here, not be lost in the hook
        time.sleep(0.05)
    print("not interrupted", round(time.monotonic() - start, 1))
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - start, 1))
os.waitpid(pid, 0)
done.set()
"""


def test_a_ctrl_c_while_a_fork_waits_for_another_threads_write_reaches_the_parent(tmp_path):
    """CPython prints what an at-fork hook raises and forks anyway: the KeyboardInterrupt was lost (reader), and
    then again when raised in another library's hook that ran after ckptstore's (reader)."""
    import subprocess
    import sys

    from tests.conftest import ckpt_env

    done = subprocess.run([sys.executable, "-c", INTERRUPTED_FORK, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=ckpt_env())
    verdict, took = done.stdout.rsplit(maxsplit=1)
    assert verdict == "interrupted" and float(took) < 3, done.stdout + done.stderr
