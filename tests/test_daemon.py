"""`ckpt daemon`: commits handed to a warm process give what the same commands give without it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Repository, daemon
from ckptstore.repo import find_root
from tests.conftest import ckpt_env, ckpt_here
from tests.test_cli import ROOT


def ckpt(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptstore", *args], cwd=cwd, env=ckpt_env(**env),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def served(tmp_path: Path):
    """A repository in tmp_path/repo with a daemon serving it (stopped afterwards)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    started = ckpt(root, "daemon", "start", "--idle", "120")
    assert started.returncode == 0 and "serves" in started.stdout, started.stderr
    yield root
    ckpt(root, "daemon", "stop")


def _served_count(root: Path) -> int:
    state = daemon.status(root.resolve())
    assert state is not None, "the daemon is not running"
    return state["served"]


def _save(path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    torch.save({"model": {"w": torch.randn(64, 64, generator=generator), "b": torch.zeros(64)}, "step": seed},
               path)


def test_commits_run_in_the_daemon_with_the_clients_folder_and_environment(served):
    (served / "run").mkdir()
    for seed in (1, 2):
        _save(served / "run" / f"ckpt-{seed}.pt", seed)
        result = ckpt(served / "run", "commit", f"ckpt-{seed}.pt", "-m", f"step {seed}", "--step", str(seed),
                      CKPT_AUTHOR="someone-else")
        assert result.returncode == 0 and f"step {seed}" in result.stdout, result.stderr
    assert _served_count(served) == 2
    log = json.loads(ckpt_here(served, "log", "--json").stdout)
    assert [(c["message"], c["author"], c["source_path"]) for c in log] == [
        (f"step {seed}", "someone-else", f"run/ckpt-{seed}.pt") for seed in (2, 1)]
    out = served / "restored"
    assert ckpt_here(served, "checkout", "HEAD~1", "-o", str(out)).returncode == 0
    assert out.read_bytes() == (served / "run" / "ckpt-1.pt").read_bytes()  # byte for byte, as without a daemon
    assert "ok" in ckpt_here(served, "fsck").stdout


def test_the_console_script_hands_its_commit_to_a_daemon_started_with_python_m(served):
    """`ckpt` (its shebang names the venv's python3) and `python -m ckptstore` run the same code."""
    _save(served / "c.pt", 6)
    script = Path(sys.executable).with_name("ckpt")
    result = subprocess.run([str(script), "commit", "c.pt"], cwd=served, env=ckpt_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _served_count(served) == 1


def test_a_failing_commit_prints_the_same_one_line_error_and_exit_code_as_without_a_daemon(served, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    assert ckpt_here(alone, "init").returncode == 0
    here, there = ckpt(alone, "commit", "missing.pt"), ckpt(served, "commit", "missing.pt")
    assert _served_count(served) == 1
    assert there.returncode == here.returncode != 0
    assert there.stderr.replace(str(served), "") == here.stderr.replace(str(alone), "")
    assert there.stderr.startswith("error: ") and "Traceback" not in there.stderr


def test_ctrl_c_at_the_client_stops_the_commit_in_the_daemon_and_records_nothing(served, tmp_path):
    _save(served / "c.pt", 3)
    gate = tmp_path / "gate"
    client = subprocess.Popen([sys.executable, "-m", "ckptstore", "commit", "c.pt"], cwd=served,
                              env=ckpt_env(CKPT_WAIT_AT=f"commit:objects-written={gate}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(Path(f"{gate}.reached"))
    client.send_signal(signal.SIGINT)
    _, stderr = client.communicate(timeout=60)
    assert client.returncode == 130 and stderr.strip().startswith("error: interrupted"), stderr
    assert ckpt_here(served, "log").stdout.strip() == ""
    assert _served_count(served) == 1  # and the daemon serves on
    assert ckpt(served, "commit", "c.pt").returncode == 0


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_a_commit_whose_client_stopped_or_died_while_it_waited_its_turn_never_runs(served, tmp_path, how):
    """Ctrl-C (or a kill) at a client queued behind another command: its interrupt was seen before the command
    started and dropped, and the commit ran and was recorded, with exit 0 (auditor: 3 runs of 4)."""
    _save(served / "a.pt", 1)
    _save(served / "b.pt", 2)
    gate = tmp_path / "gate"
    first = subprocess.Popen([sys.executable, "-m", "ckptstore", "commit", "a.pt", "-m", "A"], cwd=served,
                             env=ckpt_env(CKPT_WAIT_AT=f"commit:read={gate}"), stdout=subprocess.PIPE, text=True)
    _wait_for(Path(f"{gate}.reached"))
    queued = subprocess.Popen([sys.executable, "-m", "ckptstore", "commit", "b.pt", "-m", "B"], cwd=served,
                              env=ckpt_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_until(lambda: len(list(Path("/proc").glob(f"{queued.pid}/fd/*"))) > 0 and _connected(queued.pid))
    queued.send_signal(how)
    time.sleep(1)  # its client sends its Ctrl-C on (or its end of the connection closes) before the first ends
    gate.touch()
    _, stderr = queued.communicate(timeout=60)  # the queued one is answered once its turn comes
    first.communicate(timeout=60)
    assert first.returncode == 0
    if how == signal.SIGINT:
        assert queued.returncode == 130 and stderr.strip().startswith("error: interrupted"), stderr
    assert [c.message for c in Repository.open(served).log()] == ["A"]


def _connected(pid: int) -> bool:
    """Whether process `pid` holds a Unix socket (the client's connection to the daemon)."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd).startswith("socket:") for fd in fds.iterdir() if fd.is_symlink())


def test_a_daemon_killed_mid_commit_is_reported_and_loses_nothing(served):
    _save(served / "a.pt", 4)
    assert ckpt(served, "commit", "a.pt", "-m", "kept").returncode == 0
    _save(served / "b.pt", 5)
    dead_socket = Path(json.loads(daemon.address_path(served).read_text())["socket"])
    result = ckpt(served, "commit", "b.pt", CKPT_CRASH_AT="commit:manifest-written")
    assert result.returncode == 1 and result.stderr.startswith("error: the ckpt daemon stopped"), result.stderr
    assert daemon.status(served.resolve()) is None
    assert ckpt_here(served, "log").stdout.count("commit ") == 1 and "ok" in ckpt_here(served, "fsck").stdout
    assert ckpt(served, "commit", "b.pt").returncode == 0  # here, in a process of its own
    assert dead_socket.exists() and ckpt(served, "daemon", "start").returncode == 0
    assert not dead_socket.exists()  # a new daemon sweeps the sockets of dead ones


def test_a_client_running_other_code_runs_its_command_itself_and_the_daemon_serves_on(served, monkeypatch, capsys):
    """Another venv's `ckpt` on the same repository: its command runs in its own process."""
    monkeypatch.setattr(daemon, "code_fingerprint", lambda: "another installation's code")
    assert daemon.forward(find_root(served), ["commit", "x.pt"]) is None
    assert capsys.readouterr().err == ""
    assert _served_count(served) == 0


def test_a_daemon_whose_code_changed_on_disk_steps_aside(served, capsys):
    source = Path(daemon.__file__).with_name("daemon_server.py")
    before = source.stat()
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))  # as an upgrade would
        assert daemon.forward(find_root(served), ["commit", "x.pt"]) is None
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert capsys.readouterr().err.startswith("note: the ckpt daemon ran older code")
    _wait_until(lambda: daemon.status(served.resolve()) is None)


def test_status_and_stop_answer_during_a_commit_and_commands_queued_behind_run_in_their_clients(served, tmp_path):
    """Status and stop waited for the whole commit in progress (and so did `daemon start`).

    What comes after a stop still waits for that commit: a commit to its branch (run at once, it
    conflicted with it) and a start (at once, the new daemon gave up on the lock after 10 s).
    """
    for seed, name in enumerate("abcd"):
        _save(served / f"{name}.pt", seed)
    gate = tmp_path / "gate"
    run = lambda *args, **env: subprocess.Popen([sys.executable, "-m", "ckptstore", *args], cwd=served,
                                                env=ckpt_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)
    control = lambda op: subprocess.run([sys.executable, "-m", "ckptstore", "daemon", op], cwd=served, env=ckpt_env(),
                                        capture_output=True, text=True, timeout=30)
    held = run("commit", "a.pt", CKPT_WAIT_AT=f"commit:objects-written={gate}")
    _wait_for(Path(f"{gate}.reached"))
    old = daemon.status(served.resolve())["pid"]
    assert "serves" in control("status").stdout
    queued = run("commit", "b.pt", "--branch", "b")  # waits in the daemon's queue behind the held commit
    time.sleep(1.0)
    assert control("stop").stdout.startswith("stopped ckpt daemon")
    assert "stopping once its command in progress ends" in control("status").stdout
    after = run("commit", "c.pt")  # the held commit's branch
    restart = run("daemon", "start", "--idle", "120")
    given_up = run("commit", "d.pt", "--branch", "d")
    time.sleep(1.0)
    assert after.poll() is None and restart.poll() is None  # both wait for the held commit
    given_up.send_signal(signal.SIGINT)  # Ctrl-C while it waits: told to run in its client later, it must not
    gate.touch()
    assert given_up.wait(timeout=120) == 130 and "interrupted" in given_up.communicate()[1]
    for process in (held, queued, after, restart):
        assert process.wait(timeout=120) == 0, process.communicate()
    log = json.loads(ckpt_here(served, "log", "--all", "--json").stdout)
    assert sorted(c["source_path"] for c in log) == ["a.pt", "b.pt", "c.pt"]
    assert [c["source_path"] for c in json.loads(ckpt_here(served, "log", "--json").stdout)] == ["c.pt", "a.pt"]
    assert daemon.status(served.resolve())["pid"] != old


def test_a_request_no_client_sends_is_dropped_and_the_daemon_serves_on(served):
    """A JSON list, or a root that is no string: it killed the accepting thread, and every client hung."""
    where = json.loads((served / ".ckpt" / "daemon.json").read_text())["socket"]
    for junk in (b"[]", b'{"root": 5}', b"not json"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(where)
            daemon.send_frame(conn, daemon.REQUEST, junk)
            conn.settimeout(30)
            assert conn.recv(1) == b""  # closed without an answer
    assert "serves" in ckpt(served, "daemon", "status").stdout


def test_start_finds_the_running_daemon_and_an_idle_one_stops(served, tmp_path):
    first = daemon.status(served.resolve())
    assert ckpt(served, "daemon", "start").stdout.startswith(f"ckpt daemon {first['pid']} ")
    assert ckpt(served, "daemon", "stop").stdout == f"stopped ckpt daemon {first['pid']}\n"
    assert ckpt(served, "daemon", "start", "--idle", "3").returncode == 0
    _wait_until(lambda: daemon.status(served.resolve()) is None)
    assert ckpt(served, "daemon", "status").stdout == "no ckpt daemon is running\n"


def test_two_starts_at_once_leave_one_daemon_and_stop_stops_it(tmp_path):
    """The start that lost the race launched a daemon that waited for the lock, then served after `daemon stop`."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    starts = [subprocess.Popen([sys.executable, "-m", "ckptstore", "daemon", "start", "--idle", "60"], cwd=root,
                               env=ckpt_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    said = [start.communicate(timeout=120)[0] for start in starts]
    try:
        assert all(line.startswith("ckpt daemon ") for line in said), said
        assert ckpt(root, "daemon", "stop").returncode == 0
        time.sleep(2)  # a second daemon waited for the lock for up to 10 s: it would have taken over by now
        assert daemon.status(root.resolve()) is None
    finally:
        while daemon.status(root.resolve()) is not None:
            ckpt(root, "daemon", "stop")


def _wait_for(path: Path) -> None:
    _wait_until(path.exists)


def _wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_trust_pickle_commit_runs_in_its_client_with_the_clients_sys_path(served, tmp_path):
    """The classes it unpickles are the user's code: the daemon has neither their PYTHONPATH nor a fresh copy."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "mymod.py").write_text("class Box(dict):\n    pass\n")
    env = ckpt_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path / 'mods'}")
    save = "import torch, mymod; torch.save({'w': torch.ones(3), 'box': mymod.Box(a=5)}, 'boxed.pt')"
    subprocess.run([sys.executable, "-c", save], cwd=served, env=env, check=True, timeout=120)
    before = _served_count(served)
    result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "boxed.pt", "--trust-pickle"], cwd=served,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _served_count(served) == before  # not forwarded


def test_a_warning_is_one_line_each_time_through_the_daemon_as_without_it(served):
    """Python shows a warning once per place per process: a daemon's second command used to print none."""
    before = _served_count(served)
    for seed in (1, 2):
        state = {"w": torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))}
        state["w"][0, 0] = float("nan")
        torch.save(state, served / "nan.pt")
        result = ckpt(served, "commit", "nan.pt", "--lossy", "balanced")
        assert result.returncode == 0, result.stderr
        assert result.stderr.startswith("warning: the checkpoint holds NaN") and result.stderr.count("\n") == 1
    assert _served_count(served) == before + 2


def test_output_to_a_reader_that_went_away_is_dropped_and_the_commit_lands(served):
    """`ckpt commit x.pt | head` with head gone: no traceback, the commit recorded, 141 as without a daemon, and
    its id said on stderr (it said nothing: the id was lost; auditor helper 279)."""
    _save(served / "piped.pt", 7)
    before = _served_count(served)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    with os.fdopen(write, "w") as closed:
        result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "piped.pt", "-m", "piped"], cwd=served,
                                env=ckpt_env(), stdout=closed, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 141, result.stderr  # SIGPIPE's status, as git's
    assert _served_count(served) == before + 1
    recorded = json.loads(ckpt_here(served, "log", "--json").stdout)[0]
    assert recorded["message"] == "piped"
    assert result.stderr == f"error: commit {recorded['id'][:12]} was recorded; its summary could not be written " \
        "(Broken pipe)\n", result.stderr


def test_a_full_or_closed_stdout_fails_as_without_a_daemon_and_repo_names_the_daemons_repository(served, tmp_path):
    """`--repo R commit` typed elsewhere reaches R's daemon; a stdout that refuses the output is exit 1, one line
    naming the recorded commit (it said "cannot write the output", read as a failed commit)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _save(elsewhere / "a.pt", 8)
    before = _served_count(served)
    base = [sys.executable, "-m", "ckptstore", "--repo", str(served), "commit", "a.pt"]
    with open("/dev/full", "w") as full:
        filled = subprocess.run([*base, "-m", "full"], cwd=elsewhere, env=ckpt_env(), stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    _save(elsewhere / "a.pt", 9)
    closed = subprocess.run(f"{' '.join(base)} -m closed >&-", shell=True, cwd=elsewhere, env=ckpt_env(),
                            stderr=subprocess.PIPE, text=True, timeout=120)
    assert _served_count(served) == before + 2  # both ran there, and both commits landed
    log = json.loads(ckpt_here(served, "log", "--json").stdout)
    assert [c["message"] for c in log][:2] == ["closed", "full"]
    for result, made in ((filled, log[1]), (closed, log[0])):
        assert result.returncode == 1 and result.stderr.startswith(
            f"error: commit {made['id'][:12]} was recorded; its summary could not be written ("), result.stderr
        assert result.stderr.count("\n") == 1


def test_another_repositorys_daemon_found_through_a_stale_address_is_not_used(served, tmp_path):
    """A daemon.json left by a killed daemon whose pid another repository's daemon now has (pid reuse)."""
    other = tmp_path / "other"
    other.mkdir()
    assert ckpt_here(other, "init").returncode == 0
    shutil.copy(served / ".ckpt" / "daemon.json", other / ".ckpt" / "daemon.json")
    assert ckpt(other, "daemon", "status").stdout.strip() == "no ckpt daemon is running"
    assert ckpt(other, "daemon", "stop").stdout.strip() == "no ckpt daemon was running"  # not served's
    _save(other / "c.pt", 3)
    before = _served_count(served)
    assert ckpt(other, "commit", "c.pt").returncode == 0
    assert _served_count(served) == before and len(json.loads(ckpt_here(other, "log", "--json").stdout)) == 1


def test_output_the_clients_terminal_cannot_encode_comes_through_as_without_a_daemon(served):
    """An ASCII stdout: the client decoded the daemon's UTF-8 and failed to write it (a traceback, exit 1)."""
    _save(served / "c.pt", 1)
    result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "c.pt", "-m", "früh"], cwd=served,
                            env=ckpt_env(PYTHONIOENCODING="ascii"), capture_output=True, timeout=120)
    assert result.returncode == 0 and "früh".encode() in result.stdout and not result.stderr, result.stderr
    assert _served_count(served) == 1


def test_a_moved_or_restored_repository_gets_a_daemon_where_it_is_now(served, tmp_path):
    """Moved, its daemon was out of reach yet held the lock; restored from a copy, every commit failed."""
    moved = tmp_path / "moved"
    served.rename(moved)
    assert ckpt(moved, "daemon", "status").stdout == "no ckpt daemon is running\n"  # the old one steps aside
    started = ckpt(moved, "daemon", "start", "--idle", "120")
    assert started.returncode == 0 and f"serves {moved}" in started.stdout, started.stderr
    _save(moved / "c.pt", 1)
    assert ckpt(moved, "commit", "c.pt").returncode == 0 and _served_count(moved) == 1
    shutil.copytree(moved, tmp_path / "copy", symlinks=True)  # a backup put back: cp -a, rm -rf, mv
    shutil.rmtree(moved)
    (tmp_path / "copy").rename(moved)
    _save(moved / "c.pt", 2)
    committed = ckpt(moved, "commit", "c.pt")
    assert committed.returncode == 0, committed.stderr  # in the client: that daemon's repository is gone
    assert len(json.loads(ckpt_here(moved, "log", "--json").stdout)) == 2 and "ok" in ckpt_here(moved, "fsck").stdout
    moved.rename(served)  # for the fixture's stop


def test_a_daemon_of_a_repository_made_anew_leaves_the_new_daemons_address(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    assert ckpt(root, "init").returncode == 0 and ckpt(root, "daemon", "start", "--idle", "60").returncode == 0
    old = daemon.status(root.resolve())["pid"]
    old_address = json.loads((root / ".ckpt" / "daemon.json").read_text())
    shutil.rmtree(root / ".ckpt")
    assert ckpt(root, "init").returncode == 0 and ckpt(root, "daemon", "start", "--idle", "60").returncode == 0
    new = daemon.status(root.resolve())["pid"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # any request: its repository is gone
        conn.connect(old_address["socket"])
        request = {"op": "status", "root": str(root.resolve()), "token": old_address["token"]}
        daemon.send_frame(conn, daemon.REQUEST, json.dumps(request).encode())
        assert json.loads(daemon.receive_frame(conn)[1]) == {"here": True}
    _wait_until(lambda: not Path(f"/proc/{old}").exists() or "zombie" in Path(f"/proc/{old}/status").read_text())
    assert (daemon.status(root.resolve()) or {}).get("pid") == new  # its address file was removed by the old one
    ckpt(root, "daemon", "stop")


def test_the_socket_folder_is_the_first_that_exists_and_leaves_room_for_a_socket(monkeypatch):
    """A batch node inheriting the login node's XDG_RUNTIME_DIR, or a deep one: 'unexpected FileNotFoundError'."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))  # short: pytest's own (under xdist) leaves no room
    try:
        monkeypatch.setenv("TMPDIR", str(base))
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "no" / "such"))
        assert daemon.private_folder() == base / f"ckptstore-{os.getuid()}"
        deep = base / ("d" * 100)
        deep.mkdir()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
        assert daemon.private_folder() == base / f"ckptstore-{os.getuid()}"
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "s"))  # room for a pid and a nonce
        (base / "s").mkdir()
        assert daemon.private_folder() == base / "s" / f"ckptstore-{os.getuid()}"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_checkpoint_cut_short_while_the_daemon_commits_it_is_refused_and_the_daemon_serves_on(served):
    """A SIGBUS from reading the cut file's map used to kill the daemon itself (formats/filemap.py)."""
    from tests.repo.test_commit_truncated import commit_while_cut_short

    _save(served / "a.pt", 6)
    whole = (served / "a.pt").read_bytes()
    result = commit_while_cut_short(served, "a.pt", served / "a.pt")
    assert result.returncode == 1 and "changed while it was being committed" in result.stderr, result.stderr
    assert _served_count(served) == 1  # the same daemon, alive
    assert ckpt_here(served, "log").stdout.strip() == "" and "ok" in ckpt_here(served, "fsck").stdout
    (served / "a.pt").write_bytes(whole)
    assert ckpt(served, "commit", "a.pt").returncode == 0 and _served_count(served) == 2


def test_the_launcher_reads_the_command_and_its_repository_past_the_global_options():
    from ckptstore.daemon import command_of as _command_of

    assert _command_of(["--repo", "r", "--debug", "commit", "a.pt"]) == ("commit", "r")
    assert _command_of(["--repo=r", "commit"]) == ("commit", "r")
    assert _command_of(["--repo=", "commit", "a.pt"]) == ("commit", None)  # empty, as click reads it: not "commit"
    assert _command_of(["--read-only", "commit"]) == (None, None)  # refused here, never in a daemon


def test_another_users_daemon_is_named_by_status_start_and_stop(tmp_path):
    """Bob's `daemon status` said none ran while Alice's served the repository, and his `start` failed writing to
    her log (multi-user auditor). Her daemon: its address file hers (its socket in her /run/user/UID, which he may
    not look into: reader 11), its lock held."""
    import fcntl

    Repository.init(tmp_path / "repo").close()
    address = daemon.address_path(tmp_path / "repo")
    address.write_text(json.dumps({"socket": "/run/user/65534/ckpt/4242.sock", "pid": 4242}))
    os.chown(address, 65534, 65534)
    said = "ckpt daemon 4242 serves this repository for another user (uid 65534): it runs only their commands"
    with open(daemon.lock_path(tmp_path / "repo"), "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as her running daemon holds it
        status = ckpt_here(tmp_path / "repo", "daemon", "status")
        assert status.returncode == 0 and status.stdout.startswith(said), status.stdout
        for command in ("start", "stop"):
            refused = ckpt_here(tmp_path / "repo", "daemon", command)
            assert refused.returncode == 1 and refused.stderr.startswith(f"error: {said}"), refused.stderr
    assert ckpt_here(tmp_path / "repo", "daemon", "status").stdout == "no ckpt daemon is running\n"  # hers is gone


def test_another_users_daemon_under_umask_077_or_gone_is_said_as_far_as_can_be_told(tmp_path, monkeypatch):
    """Under umask 077 her address file could not be read and her daemon went unseen again; a lock file gone, or
    one that cannot be opened beside a killed daemon's address file, was called a running daemon (reader 12)."""
    import builtins
    import errno

    Repository.init(tmp_path / "repo").close()
    address, lock = daemon.address_path(tmp_path / "repo"), daemon.lock_path(tmp_path / "repo")
    address.write_text(json.dumps({"socket": "/run/user/65534/ckpt/4242.sock", "pid": 4242}))
    os.chown(address, 65534, 65534)
    real_open = builtins.open

    def closed(path, *args, **kwargs):  # root reads everything: hers, 0600, as another user sees them
        if os.fspath(path) in (str(lock), str(address)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(daemon, "open", closed, raising=False)
    status = ckpt_here(tmp_path / "repo", "daemon", "status")
    assert status.stdout.startswith("ckpt daemon of another user (uid 65534) may serve this repository: its lock "
                                    f"cannot be checked by you. If it is gone (killed, rebooted), remove {address}")
    monkeypatch.undo()
    lock.unlink(missing_ok=True)  # no lock file: no daemon can hold it
    assert ckpt_here(tmp_path / "repo", "daemon", "status").stdout == "no ckpt daemon is running\n"


def test_an_address_file_that_is_no_file_or_nested_past_reading_is_no_daemon(tmp_path):
    """A pipe at .ckpt/daemon.json hung `daemon status` for ever; JSON nested 5,000 deep was called folders nested
    too deeply (hostile-input auditor)."""
    Repository.init(tmp_path / "repo").close()
    address = daemon.address_path(tmp_path / "repo")
    os.mkfifo(address)
    os.chown(address, 65534, 65534)
    result = ckpt_here(tmp_path / "repo", "daemon", "status", timeout=60)
    assert result.stdout == "no ckpt daemon is running\n", result
    address.unlink()
    address.write_text("[" * 5_000 + "]" * 5_000)
    os.chown(address, 65534, 65534)
    with open(daemon.lock_path(tmp_path / "repo"), "wb") as lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        result = ckpt_here(tmp_path / "repo", "daemon", "status")
    assert result.returncode == 0 and "for another user (uid 65534)" in result.stdout, result


def test_a_pipe_or_link_at_another_users_daemon_lock_is_said_in_one_line_without_hanging(tmp_path):
    """A pipe planted at .ckpt/daemon.lock (or a link to one) beside another user's address file hung every other
    user's `daemon status`: the lock was opened following links and blocking (fixer helper 329)."""
    Repository.init(tmp_path / "repo").close()
    address, lock = daemon.address_path(tmp_path / "repo"), daemon.lock_path(tmp_path / "repo")
    address.write_text(json.dumps({"socket": "/run/user/65534/ckpt/4242.sock", "pid": 4242}))
    os.chown(address, 65534, 65534)
    os.mkfifo(tmp_path / "pipe")
    for planted, what in ((lambda: os.mkfifo(lock), "no regular file"),
                          (lambda: lock.symlink_to(tmp_path / "pipe"), "a symbolic link")):
        lock.unlink(missing_ok=True)
        planted()
        status = ckpt_here(tmp_path / "repo", "daemon", "status", timeout=10)
        assert status.returncode == 0 and status.stdout == (
            f"no ckpt daemon is running: its lock file {lock} is {what}, put there by someone who may write to "
            f".ckpt/; remove it and {address}\n"), status
        stopped = ckpt_here(tmp_path / "repo", "daemon", "stop", timeout=10)
        assert stopped.returncode == 0 and stopped.stdout == status.stdout, stopped
        started = ckpt_here(tmp_path / "repo", "daemon", "start", timeout=10)
        assert started.returncode == 1 and started.stderr == f"error: {status.stdout}", started


def test_a_socket_folder_others_may_enter_is_refused(tmp_path):
    """A 0755 folder for the socket was used: another user could reach the socket (mutation audit round 10)."""
    from ckptstore.errors import CkptError

    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(CkptError, match="not a private folder"):
        daemon._check_private(folder)
    folder.chmod(0o700)
    daemon._check_private(folder)


def test_a_peer_of_another_uid_is_not_the_same_user(monkeypatch):
    """The peer-credential check, the daemon's only guard against another user's process on its socket, said yes to
    any uid; another uid is faked by changing ours (mutation audit round 10)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert daemon.same_user(a)
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 12345)
        assert not daemon.same_user(a)


def test_a_frame_cut_short_by_a_closed_connection_reads_as_closed():
    """Half a header let struct.error escape; a payload cut short was returned as whole (mutation audit round 10)."""
    for cut in (b"o\x00", daemon._HEADER.pack(b"o", 10) + b"abc"):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            a.sendall(cut)
            a.close()
            assert daemon.receive_frame(b) == (b"", b""), cut


def test_a_ctrl_c_whose_command_never_started_in_the_daemon_is_not_run_in_the_client(monkeypatch, tmp_path):
    """The daemon answered `here` after the user's Ctrl-C: forward returned None, which ran the commit in the client,
    instead of raising KeyboardInterrupt again (mutation audit round 10)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    calls = []

    def echo(conn):
        calls.append(conn)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return None  # the daemon's `here`: it never ran the command

    monkeypatch.setattr(daemon, "_connect", lambda root: (b, "token"))
    monkeypatch.setattr(daemon, "_echo_reply", echo)
    with a, pytest.raises(KeyboardInterrupt):
        daemon.forward(tmp_path, ["commit", "x.pt"])
    assert len(calls) == 2  # the reply after the Ctrl-C was read: the daemon's answer decided


class _Refusing:
    """A stdout whose reader left: every write raises EPIPE."""

    def __init__(self) -> None:
        self.fd = os.open(os.devnull, os.O_WRONLY)

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        import errno

        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        pass


def test_stdout_refused_then_stderr_output_still_ends_with_the_refusals_exit_code(monkeypatch):
    """`ckpt commit | head` then a warning ended 0: the stderr frame forgot the refusal, or a refusal counted only
    with a nonzero code (mutation audit round 10)."""
    import io

    refusing = _Refusing()
    monkeypatch.setattr(sys, "stdout", refusing)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            daemon.send_frame(a, daemon.STDOUT, b"committed abc\n")
            daemon.send_frame(a, daemon.STDERR, b"warning: something\n")
            daemon.send_frame(a, daemon.END, json.dumps({"code": 0}).encode())
            assert daemon._echo_reply(b) == 141
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with a, b:
            daemon.send_frame(a, daemon.END, json.dumps({"code": 0}).encode())
            assert daemon._echo_reply(b) == 0
    finally:
        os.close(refusing.fd)


def test_a_daemon_that_answers_here_to_status_is_no_running_daemon(monkeypatch, tmp_path):
    """A daemon that stepped aside (another repository's, found through a stale address) answers {"here": true}:
    status returned that record instead of None (mutation audit round 10)."""
    import threading

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def serve():
        daemon.receive_frame(a)
        daemon.send_frame(a, daemon.END, json.dumps({"here": True}).encode())

    server = threading.Thread(target=serve)
    server.start()
    monkeypatch.setattr(daemon, "_connect", lambda root: (b, "token"))
    try:
        assert daemon.status(tmp_path) is None
    finally:
        server.join(5)
        a.close()
        b.close()


def test_this_users_own_daemon_is_never_called_another_users(tmp_path):
    """An address file of this user's with its lock held (our own daemon whose socket this shell cannot reach, e.g.
    under another XDG_RUNTIME_DIR) was named "another user's" (mutation audit round 10)."""
    import fcntl

    (tmp_path / ".ckpt").mkdir()
    daemon.address_path(tmp_path).write_text(json.dumps({"socket": "/nonexistent/1.sock", "pid": 1}))
    with open(daemon.lock_path(tmp_path), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(daemon.lock_path(tmp_path), "rb") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # flock is per open file: the lock is held
        assert daemon.anothers(tmp_path) is None


def test_each_command_restarts_the_idle_clock(tmp_path):
    """A daemon used every second stopped `--idle` seconds after its start (mutation audit round 10)."""
    Repository.init(tmp_path).close()
    started = ckpt(tmp_path, "daemon", "start", "--idle", "4")
    assert started.returncode == 0, started.stderr
    try:
        began, n = time.monotonic(), 0
        while time.monotonic() - began < 7:
            _save(tmp_path / "c.pt", n)
            result = ckpt(tmp_path, "commit", "c.pt")
            assert result.returncode == 0, result.stderr
            n += 1
            time.sleep(1)
        assert _served_count(tmp_path) == n
    finally:
        ckpt(tmp_path, "daemon", "stop")


def test_a_connection_that_sends_nothing_is_dropped_and_the_daemon_serves_on(served):
    """Without the request's time limit, one silent connection held the accepting thread for good: every later
    client, `ckpt daemon status` included, waited on it (mutation audit round 10, S16)."""
    where = json.loads((served / ".ckpt" / "daemon.json").read_text())["socket"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(where)
        silent.settimeout(30)
        assert silent.recv(1) == b""  # closed by the daemon after its time limit, not left open
    assert "serves" in ckpt(served, "daemon", "status").stdout


def test_objects_a_commit_writes_in_the_daemon_get_the_clients_umask(served):
    """The daemon runs under the umask it started with; a client's 077 must still keep the objects its commit
    writes to their owner (mutation audit round 10, S18: without it they came out 0644)."""
    objects = served / ".ckpt" / "objects"
    before = {p for p in objects.rglob("*") if p.is_file()}
    _save(served / "c.pt", 1)
    result = subprocess.run([sys.executable, "-m", "ckptstore", "commit", "c.pt"], cwd=served, env=ckpt_env(),
                            capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o077))
    assert result.returncode == 0, result.stderr
    assert _served_count(served) == 1
    written = [p for p in objects.rglob("*") if p.is_file() and p not in before]
    assert written and all(p.stat().st_mode & 0o077 == 0 for p in written), [oct(p.stat().st_mode) for p in written]


def _ask_socket(where: str, request: dict) -> list[tuple[bytes, bytes]]:
    """The frames the daemon listening at `where` answers `request` with, up to its end or the connection's."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(where)
        conn.settimeout(60)
        daemon.send_frame(conn, daemon.REQUEST, json.dumps(request).encode())
        frames = []
        while not frames or frames[-1][0] not in (b"", daemon.END):
            frames.append(daemon.receive_frame(conn))
    return frames


def test_a_client_without_the_daemons_token_or_asking_what_no_launcher_forwards_is_not_served(served, tmp_path):
    """Any process of this uid that reached the socket was served: the same uid in another container sharing /tmp,
    which cannot see the repository, was told its path by `status` (no root: the daemon's own was filled in), and
    had the daemon commit a file it could not read, check it out to a shared folder, and run its code through
    --calibration (auditor helper 313). Now a request carries the token of daemon.json (0600), and only a forwarded
    `commit` runs."""
    address = json.loads(daemon.address_path(served).read_text())
    assert daemon.address_path(served).stat().st_mode & 0o777 == 0o600
    _save(tmp_path / "secret.pt", 1)
    (tmp_path / "evil.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n\ndef f(*args):\n    pass\n")
    root = str(served.resolve())
    base = {"cwd": str(tmp_path), "env": {"PATH": os.environ["PATH"]}, "umask": 0o022,
            "code": daemon.code_fingerprint(), "root": root}
    commit = ["--repo", root, "commit", "secret.pt", "-m", "stolen"]
    closed, here = [(b"", b"")], [(daemon.END, b'{"here": true}')]
    assert _ask_socket(address["socket"], {"op": "status"}) == closed  # no root, no token: not a client's request
    for token in ("0" * 64, address["token"][:-1] + "x", None):  # another daemon's, nearly ours, an older client's
        if token is None:  # a pre-token ckptstore (another venv) runs its commit itself: it was cut off mid-command
            assert _ask_socket(address["socket"], {**base, "argv": commit}) == here  # (reviewer helper 321)
            continue
        assert _ask_socket(address["socket"], {"op": "status", "root": root, "token": token}) == here
        assert _ask_socket(address["socket"], {**base, "argv": commit, "token": token}) == here
    assert _ask_socket(address["socket"], {**base, "argv": commit, "root": None, "token": address["token"]}) == closed
    assert _ask_socket(address["socket"], {**base, "argv": commit, "token": address["token"]})[-1] == (
        daemon.END, b'{"code": 0}')  # the client that read daemon.json is served
    for argv in (["--repo", root, "checkout", "HEAD", "-o", str(tmp_path / "out.pt")],
                 [*commit, "--lossy", "balanced", "--calibration", f"{tmp_path / 'evil.py'}:f", "--allow-empty"],
                 ["--repo", root, "commit", "secret.pt", "--trust-pickle"], "commit secret.pt"):
        assert _ask_socket(address["socket"], {**base, "argv": argv, "token": address["token"]}) == here, argv
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "ran").exists()
    assert [c.message for c in Repository.open(served).log()] == ["stolen"] and _served_count(served) == 1


def test_a_daemon_whose_pid_another_containers_live_daemon_has_listens_on_a_socket_of_its_own(tmp_path):
    """Sockets were named by pid alone, and pids repeat across containers sharing the socket folder (/tmp): a daemon
    whose pid another container's live daemon had could not bind, and where that one had died leaving its
    daemon.json, the other container's `ckpt commit` reached this daemon (auditor helper 313)."""
    root = tmp_path / "repo"
    Repository.init(root).close()
    taken = daemon.private_folder() / "4242.sock"
    serve = "import os; os.getpid = lambda: 4242; from ckptstore.daemon_server import main; main()"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:  # the other container's daemon, pid 4242 there
        other.bind(str(taken))
        other.listen()
        process = subprocess.Popen([sys.executable, "-c", serve, str(root), "--idle", "60"], env=ckpt_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_until(lambda: daemon.status(root.resolve()) is not None or process.poll() is not None, 60)
            assert (daemon.status(root.resolve()) or {}).get("pid") == 4242, process.poll() and process.stdout.read()
            where = Path(json.loads(daemon.address_path(root).read_text())["socket"])
            assert where.name.startswith("4242-") and where != taken
        finally:
            daemon.stop(root.resolve())
            process.wait(timeout=60)
            taken.unlink()


def test_daemon_start_follows_no_link_a_group_member_planted_in_ckpt(tmp_path, monkeypatch):
    """In a group's repository a member may write to .ckpt/: links planted at daemon.lock, daemon.log and the
    address file's temporary name (by pid, guessable) had the owner's `daemon start` truncate, append to and
    overwrite the owner's files they named (auditor helper 313). Now it refuses, in one line, and they are intact."""
    from ckptstore import daemon_server

    root = tmp_path / "repo"
    Repository.init(root).close()
    victims = {name: tmp_path / f"{name}.victim" for name in ("daemon.lock", "daemon.log", "tmp")}
    for name, victim in victims.items():
        victim.write_text(f"the owner's {name} data\n")
    for name in ("daemon.lock", "daemon.log"):  # one link at a time: the log is opened first
        for planted in ("daemon.lock", "daemon.log"):
            (root / ".ckpt" / planted).unlink(missing_ok=True)
        (root / ".ckpt" / name).symlink_to(victims[name])
        refused = ckpt(root, "daemon", "start", "--idle", "30")
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert f"{root / '.ckpt' / name} is a symbolic link" in refused.stderr and \
            refused.stderr.count("\n") == 1, refused.stderr
        assert daemon.status(root.resolve()) is None
    (root / ".ckpt" / f"daemon.json.{os.getpid()}.tmp").symlink_to(victims["tmp"])
    daemon_server._write_address(root, Path("/nowhere/1.sock"), "a token")
    assert json.loads(daemon.address_path(root).read_text())["token"] == "a token"
    assert {name: victim.read_text() for name, victim in victims.items()} == {
        name: f"the owner's {name} data\n" for name in victims}


def test_a_sigterm_stops_the_daemon_cleanly_and_commits_run_in_their_clients(served, tmp_path):
    """SIGTERM killed an idle daemon without its clean-up, leaving its address file and socket (reviewer 440)."""
    pid = daemon.status(served.resolve())["pid"]
    os.kill(pid, signal.SIGTERM)
    _wait_until(lambda: daemon.status(served.resolve()) is None)
    assert not (served / ".ckpt" / "daemon.json").exists()
    _save(tmp_path / "c.pt", 1)
    committed = ckpt(served, "commit", str(tmp_path / "c.pt"))
    assert committed.returncode == 0, committed.stderr
