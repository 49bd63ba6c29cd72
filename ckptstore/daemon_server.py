"""The serving side of `ckpt daemon` (ckptstore/daemon.py): one repository's commands, run one at a time.

Each command runs as the client's own process would run it: in its working directory, with its
environment and an empty stdin, its output and exit code going back over the socket, and the
client's Ctrl-C raised here as KeyboardInterrupt. Only the parent's planes and the encoding
threads outlive a command (repo/warm.py).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptstore.daemon import (
    DEFAULT_IDLE_SECONDS,
    END,
    REQUEST,
    STDERR,
    STDOUT,
    code_fingerprint,
    log_path,
    receive_frame,
    send_frame,
    socket_path,
)
from ckptstore.errors import CkptError


class _Output(io.TextIOBase):
    """sys.stdout or sys.stderr of one request: each write a frame to the client; dropped once it left."""

    def __init__(self, conn: socket.socket, channel: bytes) -> None:
        self.conn, self.channel, self.gone = conn, channel, False

    def write(self, text: str | bytes) -> int:  # click writes bytes where it finds no terminal
        if text and not self.gone:
            try:
                send_frame(self.conn, self.channel, text if isinstance(text, bytes) else text.encode())
            except OSError:
                self.gone = True
        return len(text)

    def isatty(self) -> bool:
        return False


class _Daemon:
    """The serving loop of one repository's daemon (see the module's docstring)."""

    def __init__(self, root: Path, idle: float) -> None:
        self.root, self.idle = root.resolve(), idle
        self.code = code_fingerprint()
        self.started, self.served, self.last_command = time.time(), 0, time.monotonic()
        self.running = True

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "root": str(self.root), "started": self.started, "idle": self.idle,
                "served": self.served}

    def serve(self) -> None:
        """Warm up, then listen: `ckpt daemon start` returns once the first command will find it warm."""
        import ckptstore.cli  # noqa: F401 (the CLI and the repository layer, loaded before the first command)
        from ckptstore.repo import keep_warm

        keep_warm(self.root)
        self.last_command = time.monotonic()  # idle time counts from here, not from before the warm-up
        path = socket_path(self.root)
        with open(f"{path}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CkptError(f"another ckpt daemon serves {self.root}") from None
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # left by a daemon that was killed: the lock says none listens now
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(path))
                listener.listen(8)
                while self.running and (left := self.last_command + self.idle - time.monotonic()) > 0:
                    listener.settimeout(left)  # status requests do not count: only commands keep it alive
                    try:
                        conn, _ = listener.accept()
                    except TimeoutError:
                        break
                    with conn:
                        conn.settimeout(None)
                        self._handle(conn)
                        with contextlib.suppress(OSError):
                            conn.shutdown(socket.SHUT_RDWR)  # wakes the request's interrupt watcher
            finally:
                listener.close()
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _handle(self, conn: socket.socket) -> None:
        if not _same_user(conn):
            return
        try:
            channel, payload = receive_frame(conn)
            if channel != REQUEST:
                return
            request = json.loads(payload)
            if request.get("op") in ("status", "stop"):
                self.running = request["op"] != "stop"
                send_frame(conn, END, json.dumps(self.status()).encode())
            elif request.get("code") != self.code:
                self.running = False  # the code changed: this process is stale, the client runs the command
                send_frame(conn, END, json.dumps({"stale": True}).encode())
            else:
                code = self._run(conn, request)
                self.served, self.last_command = self.served + 1, time.monotonic()
                send_frame(conn, END, json.dumps({"code": code}).encode())
        except (OSError, ValueError):  # the client left, or sent what no client sends: serve the next one
            pass
        except KeyboardInterrupt:  # a client's Ctrl-C that came as its command was ending
            pass
        except Exception as exc:  # a fault of the daemon's own: the client hears of it, the daemon goes on
            traceback.print_exc()
            with contextlib.suppress(OSError):
                send_frame(conn, STDERR, f"error: the ckpt daemon failed ({type(exc).__name__}: {exc}); "
                                    f"see {log_path(self.root)}\n".encode())
                send_frame(conn, END, json.dumps({"code": 1}).encode())

    def _run(self, conn: socket.socket, request: dict[str, Any]) -> int:
        """Run one `ckpt` command as the client's process would, its output going back on `conn`."""
        import ckptstore.cli as cli

        with _client_context(request), _interrupt_on_request(conn):
            stdout, stderr = _Output(conn, STDOUT), _Output(conn, STDERR)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    cli.main(request["argv"])
                except SystemExit as exc:
                    return exc.code if isinstance(exc.code, int) else 1
            return 0


@contextlib.contextmanager
def _client_context(request: dict[str, Any]) -> Iterator[None]:
    """The client's working directory, environment and an empty stdin, for one command."""
    cwd, env, stdin = os.getcwd(), dict(os.environ), sys.stdin
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = io.StringIO()  # a prompt reads end-of-file: the command fails instead of waiting
    try:
        yield
    finally:
        sys.stdin = stdin
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)


@contextlib.contextmanager
def _interrupt_on_request(conn: socket.socket) -> Iterator[None]:
    """Raise KeyboardInterrupt in this (the main) thread when the client sends Ctrl-C or goes away."""
    done = threading.Event()
    lock = threading.Lock()
    main = threading.main_thread().ident

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            receive_frame(conn)  # an INTERRUPT frame, or the connection closing: either stops the command
        with lock:
            if not done.is_set():
                signal.pthread_kill(main, signal.SIGINT)

    watcher = threading.Thread(target=watch, name="ckpt-daemon-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()


def _same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end runs as this user (the folder's mode already says so; Linux checks)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return True
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def main() -> None:
    """`python -m ckptstore.daemon_server ROOT [--idle SECONDS]`: serve until idle, stopped or stale."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_SECONDS)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _Daemon(args.root, args.idle).serve()
    except CkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
