"""A warm `ckpt` process for one repository, so that `ckpt commit` after each save skips the start-up.

A fresh `ckpt commit` process pays, before and around its real work, for importing the package
and numpy, for decoding the parent's chains from the store (a long-lived process keeps the
parent's planes from its last commit: repo/planecache.py) and for faulting in fresh memory: on
the MiniLM fine-tune's 271 MB checkpoints that was half its time (docs/benchmarks.md). `ckpt
daemon start` leaves one process serving the repository on a Unix socket that only this user can
reach; while it runs, `ckpt commit` (ckptstore/launch.py) sends its arguments, working directory
and environment there and prints what comes back. The daemon runs the same CLI code, one command
at a time, opening the repository afresh for each (so config changes and other writers are seen)
and keeping only the parent's planes and the encoding threads between them (repo/warm.py). It
stops after `idle` seconds without a command, on `ckpt daemon stop`, or when the installed code
changes under it (every request carries the code's fingerprint, and a stale daemon steps aside).

The daemon takes `.ckpt/daemon.lock` (one daemon per repository) and writes where it listens to
`.ckpt/daemon.json`; its socket lives in a private folder of the user's (a Unix socket's path is
limited to 107 bytes, and a repository's is not). Clients check both ends: the folder is the
user's own with mode 0700, and the process listening runs as the same user. The daemon checks the
client: every request carries the random token daemon.json holds (mode 0600), so only a process that
can read the repository's .ckpt folder, in the daemon's file system, is served; the same uid in
another container sharing /tmp is not. And it runs only what the launcher forwards (`forwardable`).

This module is the client's side and the wire format; the launcher imports it in every `ckpt
commit` process, so it imports only what a client needs. The serving process is daemon_server.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.machinery
import json
import os
import re
import socket
import stat
import struct
import sys
import time
from pathlib import Path
from typing import Any

from ckptstore.errors import CkptError, OutputError

DEFAULT_IDLE_SECONDS = 900.0
START_TIMEOUT_SECONDS = 60.0
_HEADER = struct.Struct("!cI")  # one frame: a channel byte and the payload's length
# Channels: a request (client to daemon, JSON), output to stdout or stderr, an interrupt (the
# user pressed Ctrl-C at the client), and the end of a reply (JSON: the exit code, or `here`:
# run the command in the client, the daemon is stopping or runs other code).
REQUEST, STDOUT, STDERR, INTERRUPT, END = b"q", b"o", b"e", b"i", b"x"
_SOURCES = (".py", *importlib.machinery.EXTENSION_SUFFIXES)


class DaemonGone(CkptError):
    """The daemon's connection broke in the middle of a command."""


def one_blas_thread() -> None:
    """Numpy's OpenBLAS runs one thread unless the user chose more; called by `ckpt` and the daemon before numpy loads.

    ckptstore threads its own work, and its numpy use is element-wise (1-D dots at most); and an
    OpenBLAS that cannot start its threads (a memory or thread limit) raises SIGINT, which the CLI
    would take for a Ctrl-C, or exits the process with no error line.
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def log_path(root: Path) -> Path:
    """The daemon's output (its own faults' tracebacks): `.ckpt/daemon.log`."""
    return root / ".ckpt" / "daemon.log"


def lock_path(root: Path) -> Path:
    """Held by the daemon serving `root` for as long as it runs."""
    return root / ".ckpt" / "daemon.lock"


def address_path(root: Path) -> Path:
    """Where the running daemon says it listens (JSON: socket, pid)."""
    return root / ".ckpt" / "daemon.json"


# A calibration function, and the classes --trust-pickle unpickles, are the user's code: they are imported in
# the user's own process, with its sys.path and fresh, never a daemon's old copy
_LOCAL_OPTIONS = ("--calibration", "--trust-pickle")


def command_of(argv: list[str]) -> tuple[str | None, str | None]:
    """The subcommand `argv` names and the repository folder its --repo gives, past the global options.

    None for the command where another option comes first (--read-only, --help): such a run stays here.
    """
    repo, index = None, 0
    while index < len(argv) and argv[index].startswith("-"):
        option, joined, value = argv[index].partition("=")
        if option == "--repo" and not joined and index + 1 < len(argv):
            repo, index = argv[index + 1], index + 2
        elif option == "--repo" and joined:  # --repo=PATH (--repo= is empty, as click reads it)
            repo, index = value or None, index + 1
        elif option == "--debug" and not joined:
            index += 1
        else:
            return None, repo
    return (argv[index] if index < len(argv) else None), repo


def forwardable(argv: Any) -> bool:
    """Whether `argv` is a command a daemon runs: a `commit` importing none of the user's code.

    The launcher forwards only these, and the daemon refuses the rest: a request is no proof that a launcher sent it.
    """
    return (isinstance(argv, list) and all(isinstance(arg, str) for arg in argv) and command_of(argv)[0] == "commit"
            and not any(arg.startswith(_LOCAL_OPTIONS) for arg in argv))


def open_own_file(path: Path, flags: int, mode: int = 0o666) -> int:
    """A descriptor of the regular file `path` (os.open's `flags`), never through a symbolic link; else one line.

    In a group's repository another member may write to .ckpt/ (repo/lock.py makes it so) and plant a link to a
    file of the owner's where the owner's daemon opens its lock or log: followed, the open truncated or appended
    to that file. Callers pass no O_TRUNC either: a hard link planted there loses nothing.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)  # non-blocking: a pipe there would hang it
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):  # a link (O_NOFOLLOW), a pipe without a reader
            raise
        fd = None
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        raise CkptError(f"{path} is {'a symbolic link' if os.path.islink(path) else 'no regular file'}, put there by "
                        "someone who may write to .ckpt/; the ckpt daemon will not use it (remove it and start again)")
    return fd


def read_address(root: Path) -> dict[str, Any]:
    """The address file's record; OSError or ValueError where it is missing, unreadable, no file or no such record.

    A pipe put there would hang the read, and JSON nested past the interpreter's depth would raise
    RecursionError, which is no daemon's either.
    """
    address = address_path(root)
    with open(address, "rb", opener=lambda path, flags: os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)) as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ValueError(f"{address} is no file")
        text = file.read()
    try:
        record = json.loads(text)
    except RecursionError:
        raise ValueError(f"{address} is nested past reading") from None
    if not isinstance(record, dict):
        raise ValueError(f"{address} holds no record")
    return record


SOCKET_PATH_BYTES = 107  # a Unix socket's path, at most (sun_path is 108 bytes with its NUL)
# A socket's name: its daemon's pid and a random nonce. Pids repeat across containers that share the folder (/tmp):
# by pid alone, one container's stale daemon.json named another's live socket, and a daemon could not bind its own.
SOCKET_NONCE_HEX = 12  # 48 bits: no secret (the token is), only unlike any other daemon's of that pid
LONGEST_SOCKET_NAME = f"4194304-{'0' * SOCKET_NONCE_HEX}.sock"


def private_folder() -> Path:
    """This user's folder for daemon sockets, mode 0700 (made if missing); refused if anyone else could enter it.

    In XDG_RUNTIME_DIR, else TMPDIR, else /tmp: the first that exists and leaves room for a socket's
    name (a batch node can inherit a login node's /run/user/UID, which it lacks; a deep TMPDIR is too long).
    """
    uid = os.getuid()
    for parent in (os.environ.get("XDG_RUNTIME_DIR"), os.environ.get("TMPDIR"), "/tmp"):
        base = Path(parent or "/tmp") / f"ckptstore-{uid}"
        if len(os.fsencode(base / LONGEST_SOCKET_NAME)) <= SOCKET_PATH_BYTES and base.parent.is_dir():
            break
    base.mkdir(mode=0o700, exist_ok=True)
    _check_private(base)
    return base


def _check_private(folder: Path) -> None:
    info = folder.lstat()  # not a symlink to someone else's folder
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CkptError(f"{folder} is not a private folder of this user's (owner uid {info.st_uid}, "
                        f"mode {info.st_mode & 0o777:o}); the ckpt daemon will not use it")


def code_fingerprint() -> str:
    """What the running code is: this interpreter, ckptstore's sources and extensions, the installed packages.

    The interpreter by its real path and prefix: `ckpt` and `python -m ckptstore` of one venv name
    it differently (python3.11, python) but run the same code.
    """
    digest = hashlib.sha256(f"{os.path.realpath(sys.executable)}\0{sys.prefix}\0".encode())
    for path in sorted(p for p in Path(__file__).parent.rglob("*") if p.name.endswith(_SOURCES)):
        info = path.stat()
        digest.update(f"{path}\0{info.st_mtime_ns}\0{info.st_size}\0".encode())
    for folder in sorted({p for p in sys.path if p.endswith("-packages")}):
        with contextlib.suppress(OSError):  # a package installed or removed changes its folder's mtime
            digest.update(f"{folder}\0{os.stat(folder).st_mtime_ns}\0".encode())
    return digest.hexdigest()[:32]


def send_frame(conn: socket.socket, channel: bytes, payload: bytes) -> None:
    """Send one frame: `channel`, then the payload's length and the payload."""
    conn.sendall(_HEADER.pack(channel, len(payload)) + payload)


def receive_frame(conn: socket.socket) -> tuple[bytes, bytes]:
    """The next frame; (b"", b"") when the other side closed the connection."""
    header = _exactly(conn, _HEADER.size)
    if len(header) != _HEADER.size:
        return b"", b""
    channel, length = _HEADER.unpack(header)
    payload = _exactly(conn, length)
    if len(payload) != length:
        return b"", b""
    return channel, payload


def _exactly(conn: socket.socket, n: int) -> bytes:
    parts, have = [], 0
    while have < n:
        part = conn.recv(n - have)
        if not part:
            break
        parts.append(part)
        have += len(part)
    return b"".join(parts)


def same_user(conn: socket.socket) -> bool:
    """Whether the other end of a Unix socket runs as this user (Linux says; elsewhere the folder's mode vouches)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


def _connect(root: Path) -> tuple[socket.socket, str | None] | None:
    """A connection to `root`'s daemon and the token its requests carry; None when none listens, or not safely.

    Not safely: its socket is not this user's. An older daemon's address file holds no token: it is asked
    anyway, and steps aside as stale.
    """
    try:
        where = read_address(root)
        path, token = Path(where["socket"]), where.get("token")
        _check_private(path.parent)
    except (OSError, ValueError, KeyError, TypeError, CkptError):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        if not same_user(conn):
            raise OSError("the process listening there is another user's")
    except OSError:
        conn.close()
        return None
    return conn, token if isinstance(token, str) else None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def forward(root: Path, argv: list[str]) -> int | None:
    """Run the `ckpt` command `argv` in `root`'s daemon, echoing its output; its exit code.

    None when no daemon is running, or the daemon did not take the command (it is stopping, or
    runs other code): run it here. Raises DaemonGone when the daemon disappears mid-command.
    """
    connected = _connect(root)
    if connected is None:
        return None
    conn, token = connected
    with conn:
        request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
                   "code": code_fingerprint(), "root": str(root.resolve()), "token": token}
        try:
            send_frame(conn, REQUEST, json.dumps(request).encode())
        except OSError:
            return None
        try:
            return _echo_reply(conn)
        except KeyboardInterrupt:  # the daemon stops the command as Ctrl-C would here, and says so
            with contextlib.suppress(OSError):
                send_frame(conn, INTERRUPT, b"")
            code = _echo_reply(conn)
            if code is None:  # it never started there (queued behind a stop): not to be run here either
                raise
            return code


def _echo_reply(conn: socket.socket) -> int | None:
    # stdout refused the output: its reader left (`ckpt commit | true`, 141) or it failed (a full disk, closed):
    # the command ends as it would here
    refused: OutputError | None = None
    while True:
        try:
            channel, payload = receive_frame(conn)
        except OSError:
            channel, payload = b"", b""
        if channel in (STDOUT, STDERR):
            failed = _echo(sys.stdout if channel == STDOUT else sys.stderr, payload)
            refused = refused or (_summary_refused(failed, payload) if channel == STDOUT and failed else None)
        elif channel == END:
            reply = json.loads(payload)
            if reply.get("stale"):
                print("note: the ckpt daemon ran older code than this ckpt (an upgrade?) and has stopped; "
                      "this command runs here (`ckpt daemon start` starts a current one)", file=sys.stderr)
            code = None if "code" not in reply else int(reply["code"])
            return code if code != 0 or refused is None else _refused_output(refused)
        else:
            raise DaemonGone("the ckpt daemon stopped in the middle of the command; earlier commits are "
                             "intact (`ckpt log` shows whether this one was recorded)")


def _summary_refused(error: OutputError, payload: bytes) -> OutputError:
    """The refusal of a commit's summary (only commits are forwarded): the recorded commit's id said, as the CLI does.

    Said as "cannot write the output", a recorded commit read as failed and its retry found nothing changed.
    """
    summary = re.match(rb"\[([0-9a-f]{12})\]", payload)  # its first line: [ID] SUBJECT (sizes)
    return OutputError(error.cause, recorded=f"commit {summary.group(1).decode()}") if summary else error


def _refused_output(error: OutputError) -> int:
    """The exit code of a command whose stdout refused its output, said as the CLI says it."""
    if not error.quiet and sys.stderr is not None:
        with contextlib.suppress(OSError):
            print(f"error: {error}", file=sys.stderr)
    return error.exit_code


def _echo(stream: Any, payload: bytes) -> OutputError | None:
    """Write the command's output here; a stream that refuses it (`ckpt commit | head`) drops it, the command runs on.

    Returns what refused it, if anything.

    The bytes as the daemon encoded them (UTF-8), as click writes where the stream's encoding cannot
    hold the text (an ASCII locale): decoded and written as text, they raised UnicodeEncodeError.
    """
    if stream is None:  # started with it closed (`>&-`)
        return OutputError.closed()
    try:
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            stream.write(payload.decode(errors="replace"))
        else:
            stream.flush()
            buffer.write(payload)
        (buffer or stream).flush()
    except OSError as exc:  # and no BrokenPipeError at exit either: what is left goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return OutputError(exc)
    return None


def _ask(root: Path, op: str) -> dict[str, Any] | None:
    """A control request's reply (`status`, `stop`), or None when no daemon listens."""
    connected = _connect(root)
    if connected is None:
        return None
    conn, token = connected
    with conn:
        try:
            send_frame(conn, REQUEST, json.dumps({"op": op, "root": str(root.resolve()), "token": token}).encode())
            channel, payload = receive_frame(conn)
        except OSError:
            return None
    reply = json.loads(payload) if channel == END else {}
    return reply if "pid" in reply else None  # a stopping daemon answers without one


def anothers(root: Path) -> dict[str, Any] | None:
    """The daemon serving `root` for another user, where one runs (its pid, uid, address file), else None.

    `certain` is False where its lock could not be checked (a lock this user may not open); `damaged` says what
    stands at the lock's path where that is a symbolic link or no regular file (no daemon can hold it).

    A daemon serves only the user who started it (its socket is in that user's private folder), and
    one runs per repository: another user's `status` saw none and their `start` failed on its log.
    """
    import fcntl

    address = address_path(root)
    try:  # the address file is the daemon's, in .ckpt/: its owner is told by a stat, whatever its mode
        info = address.lstat()
    except OSError:
        return None
    if info.st_uid == os.getuid() or not stat.S_ISREG(info.st_mode):  # a pipe there would hang the read
        return None
    owner = info.st_uid
    try:
        where = read_address(root)
    except (OSError, ValueError):  # made under umask 077 (its pid is its owner's to read), or forged
        where = {}
    other = {"pid": where.get("pid"), "uid": owner, "certain": True, "address": str(address)}
    lock_file = lock_path(root)
    try:  # never through a link, never waiting on a pipe: another user who may write to .ckpt/ can plant either
        with open(lock_file, "rb", opener=_unfollowed) as lock:
            if not stat.S_ISREG(os.fstat(lock.fileno()).st_mode):
                return {**other, "damaged": f"{lock_file} is no regular file"}
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held: its daemon runs
        return other
    except PermissionError:  # a lock this user may not open: cannot tell, and a daemon of this user's could not take it
        return {**other, "certain": False}
    except OSError as exc:  # no lock file: no daemon holds it; nor a link (ELOOP under O_NOFOLLOW)
        return {**other, "damaged": f"{lock_file} is a symbolic link"} if exc.errno == errno.ELOOP else None
    return None  # its lock is free: that daemon is gone


def _unfollowed(path: str, flags: int) -> int:
    """os.open of `path` neither through a symbolic link nor blocking (a pipe with no writer would hang a read)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def anothers_line(other: dict[str, Any]) -> str:
    """What to tell a user about another user's daemon serving the repository (or perhaps serving it)."""
    pid = f" {other['pid']}" if other.get("pid") else ""
    if other.get("damaged"):  # no daemon can hold such a lock (daemon_server opens it through open_own_file)
        return (f"no ckpt daemon is running: its lock file {other['damaged']}, put there by someone who may write to "
                f".ckpt/; remove it and {other['address']}")
    if not other.get("certain", True):
        return (f"ckpt daemon{pid} of another user (uid {other['uid']}) may serve this repository: its lock cannot "
                f"be checked by you. If it is gone (killed, rebooted), remove {other['address']}; your commands run "
                "without a daemon, as usual")
    return (f"ckpt daemon{pid} serves this repository for another user (uid {other['uid']}): it runs only their "
            "commands; yours run without a daemon, as usual")


def status(root: Path) -> dict[str, Any] | None:
    """The running daemon's pid, start time, idle limit and commands served; None when none runs."""
    return _ask(root, "status")


def stop(root: Path) -> dict[str, Any] | None:
    """Stop `root`'s daemon once its current command is done; its last status, or None when none ran."""
    return _ask(root, "stop")


def start(root: Path, idle: float | None = None) -> dict[str, Any]:
    """Start a daemon for the repository at `root` (or find the one running); its status.

    It stops after `idle` seconds without a command (default DEFAULT_IDLE_SECONDS).
    """
    import subprocess

    running = status(root)
    other = anothers(root) if running is None else None
    if other is not None:
        raise CkptError(anothers_line(other) if other.get("damaged") else
                        f"{anothers_line(other)}; one daemon serves a repository at a time")
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while running is not None and running.get("stopping") and time.monotonic() < deadline:
        time.sleep(0.05)  # stopped, and ending the command in progress: a new one starts once it is gone
        running = status(root)
    if running is not None:
        if running.get("stopping"):
            raise CkptError(f"the ckpt daemon {running['pid']} is stopping once its command in progress ends; start "
                            "again then")
        return running
    private_folder()  # refused here, with its reason, rather than in the daemon's log
    log = log_path(root)
    idle = DEFAULT_IDLE_SECONDS if idle is None else idle
    with open(open_own_file(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as output:
        process = subprocess.Popen([sys.executable, "-m", "ckptstore.daemon_server", str(root), "--idle", str(idle)],
                                   cwd=root, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                   start_new_session=True)  # the terminal's Ctrl-C is for the client only
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        running = status(root)
        if running is not None:
            if running.get("pid") != process.pid:  # another start's daemon took the lock: ours would wait, then serve
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
            return running
        if process.poll() is not None and status(root) is None:
            with open(open_own_file(log, os.O_RDONLY), "rb") as written:
                tail = written.read().decode(errors="replace").strip().splitlines()[-3:]
            raise CkptError(f"the ckpt daemon exited at start ({' / '.join(tail) or 'no output'}; see {log})")
        time.sleep(0.02)
    process.kill()
    raise CkptError(f"the ckpt daemon did not answer within {START_TIMEOUT_SECONDS:.0f} s; see {log}")
