"""The serving side of `ckpt daemon` (ckptstore/daemon.py): one repository's commands, run one at a time.

A thread accepts connections and answers `status` and `stop` at once, even while a command runs;
commands queue for the main thread, which runs them.

Each command runs as the client's own process would run it: in its working directory, with its
environment and an empty stdin, its output and exit code going back over the socket, and the
client's Ctrl-C raised here as KeyboardInterrupt, only while the command runs. Only the parent's
planes and the encoding threads outlive a command (repo/warm.py), and the threads are idle again
before its reply ends. When the daemon stops, the commands already queued on its socket are told
to run in their clients.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hmac
import io
import json
import os
import queue
import secrets
import signal
import socket
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
    SOCKET_NONCE_HEX,
    STDERR,
    STDOUT,
    address_path,
    code_fingerprint,
    forwardable,
    lock_path,
    log_path,
    one_blas_thread,
    open_own_file,
    private_folder,
    read_address,
    receive_frame,
    same_user,
    send_frame,
)
from ckptstore.errors import INTERRUPTED, CkptError


class _Output(io.TextIOBase):
    """sys.stdout or sys.stderr of one request: each write a frame to the client; dropped once it left."""

    def __init__(self, conn: socket.socket, channel: bytes) -> None:
        self.conn, self.channel, self.gone = conn, channel, False

    def write(self, text: str | bytes) -> int:  # click writes bytes where it finds no terminal
        if text and not self.gone:
            try:
                data = text if isinstance(text, bytes) else text.encode(errors="backslashreplace")  # as cli.main
                send_frame(self.conn, self.channel, data)
            except OSError:
                self.gone = True
        return len(text)

    def isatty(self) -> bool:
        return False


REQUEST_TIMEOUT_SECONDS = 5.0  # a connection that sends no request in this long is dropped
ACCEPT_POLL_SECONDS = 0.2  # how often the accepting thread looks whether the daemon stops
LOCK_WAIT_SECONDS = 10.0  # a daemon that is stopping holds the lock until its command in progress ends


class _Daemon:
    """The serving loop of one repository's daemon (see the module's docstring)."""

    def __init__(self, root: Path, idle: float) -> None:
        self.root, self.idle = root.resolve(), idle
        self.identity = _identity(self.root)  # the repository's .ckpt folder: the same one however it is named
        self.code = code_fingerprint()
        self.token = secrets.token_hex(32)  # in daemon.json, mode 0600: a request that lacks it is no client of ours
        self.started, self.served, self.last_command = time.time(), 0, time.monotonic()
        self.running = True  # taking commands; once False, a stop is under way
        self.closing = False  # the accepting thread ends
        self.commands: queue.Queue[tuple[socket.socket, dict[str, Any]] | None] = queue.Queue()
        self.interruptible = False  # a client's Ctrl-C raises KeyboardInterrupt only while a command runs
        self.terminated = False  # a SIGTERM came: a command dequeued meanwhile is interrupted as it starts

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "root": str(self.root), "started": self.started, "idle": self.idle,
                "served": self.served, "stopping": not self.running}

    def serve(self) -> None:
        """Warm up, then listen: `ckpt daemon start` returns once the first command will find it warm."""
        import ckptstore.cli  # noqa: F401 (the CLI and the repository layer, loaded before the first command)
        from ckptstore.repo import keep_warm

        keep_warm(self.root)
        os.chdir("/")  # its start folder may be deleted (the repository restored from a copy): not needed here
        signal.signal(signal.SIGINT, self._on_interrupt)
        signal.signal(signal.SIGTERM, self._on_terminate)  # a clean stop: its address file and socket removed
        # neither truncated (it held a link's target's data) nor through a link: daemon.py's open_own_file says why
        with open(open_own_file(lock_path(self.root), os.O_RDWR | os.O_CREAT), "rb", buffering=0) as lock:
            _lock_or_refuse(lock, self.root)
            folder = private_folder()
            _sweep(folder)
            path = folder / f"{os.getpid()}-{secrets.token_hex(SOCKET_NONCE_HEX // 2)}.sock"  # daemon.py says why
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            accepting = threading.Thread(target=self._accept, args=(listener,), name="ckpt-daemon-accept",
                                         daemon=True)
            try:
                listener.bind(str(path))
                listener.listen(16)
                _write_address(self.root, path, self.token)
                self.last_command = time.monotonic()  # idle time counts from here, not from before the warm-up
                accepting.start()
                self._run_commands()
            finally:
                _remove_address(self.root, path)  # new clients run their commands themselves from now on
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                self.running, self.closing = False, True
                if accepting.is_alive():
                    accepting.join()
                _turn_away(listener, self.commands)
                listener.close()

    def _run_commands(self) -> None:
        """Run the commands the accepting thread queues, in order, until stopped or idle for `idle` seconds."""
        while self.running and (left := self.last_command + self.idle - time.monotonic()) > 0:
            try:  # status requests do not count: only commands keep it alive; polled, so a SIGTERM's stop is seen
                item = self.commands.get(timeout=min(left, TERMINATE_POLL_SECONDS))
            except queue.Empty:
                continue
            if item is None:  # woken to stop
                continue
            conn, request = item
            with conn:
                if self.running:
                    self._command(conn, request)
                else:  # stopped while it waited: its client runs it
                    with contextlib.suppress(OSError):
                        _run_in_client(conn)
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the request's interrupt watcher

    def _accept(self, listener: socket.socket) -> None:
        """Take each connection until the daemon closes; queue commands, answer the rest at once.

        Status and stop are answered even while a command runs. Commands queue during a stop too:
        they are told to run in their clients once the command in progress has ended, so that two
        commits to one branch still run one after the other.
        """
        listener.settimeout(ACCEPT_POLL_SECONDS)
        while not self.closing:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # no connection can be taken (no file descriptors left): clients run their commands
                traceback.print_exc()
                self.stop()
                return
            try:
                request = self._screen(conn)
            except Exception:  # a fault of the daemon's own: logged, and the next client is served
                traceback.print_exc()
                request = None
            if request is None:
                conn.close()
            else:
                self.commands.put((conn, request))

    def stop(self) -> None:
        self.running = False
        self.commands.put(None)  # wakes the commands' thread

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        if self.interruptible:
            raise KeyboardInterrupt

    def _on_terminate(self, signum: int, frame: Any) -> None:
        """Stop serving: a command in progress ends as on Ctrl-C, then the loop (it polls its queue).

        serve's finally removes the address file and socket; clients run their commands themselves. Nothing is
        raised outside a command, nor queued: the main thread may be inside the queue, holding its lock.
        """
        self.running, self.terminated = False, True
        if self.interruptible:
            raise KeyboardInterrupt

    def _screen(self, conn: socket.socket) -> dict[str, Any] | None:
        """The command `conn` asks for, or None once a request that is not one is answered (or none came)."""
        try:
            if not same_user(conn):
                return None
            conn.settimeout(REQUEST_TIMEOUT_SECONDS)
            channel, payload = receive_frame(conn)
            conn.settimeout(None)
            request = json.loads(payload) if channel == REQUEST else None
            if not isinstance(request, dict) or not isinstance(request.get("root"), str):
                return None  # sent what no client sends
            root, token = request["root"], request.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(errors="surrogatepass"),
                                                                     self.token.encode()):
                # an older ckptstore's client (another venv) sends none: it runs its command itself, as does
                # one who did not read our address file: the same uid in another container sharing the socket folder
                # (its own repository's stale daemon.json naming a socket this one reuses), or worse. It learns
                # nothing of ours, and runs its command itself, with its own rights.
                _run_in_client(conn)
            elif root != str(self.root) or _identity(Path(root)) != self.identity:
                # a stale address file led another repository's client here (a reused pid, or one made anew where
                # this one was): not its daemon. Its own repository moved (the same .ckpt, named anew) or went:
                # it steps aside, so that a daemon can start for it where it is now.
                if _identity(Path(root)) == self.identity or _identity(self.root) != self.identity:
                    self.stop()
                _run_in_client(conn)
            elif request.get("op") in ("status", "stop"):
                if request["op"] == "stop":
                    self.stop()
                send_frame(conn, END, json.dumps(self.status()).encode())
            elif not forwardable(request.get("argv")):  # what the launcher runs in its own process, or no command
                _run_in_client(conn)
            else:
                return request
        except (OSError, ValueError):  # the client left, or sent what no client sends: serve the next one
            pass
        return None

    def _command(self, conn: socket.socket, request: dict[str, Any]) -> None:
        try:
            if request.get("code") != self.code:
                # Other code than this process runs: the client's (another venv: serve on) or ours, changed on disk
                stale = code_fingerprint() != self.code
                if stale:
                    self.stop()
                send_frame(conn, END, json.dumps({"here": True, "stale": stale}).encode())
            else:
                code = self._run(conn, request)
                if code is _HERE:
                    _run_in_client(conn)
                    return
                self.served, self.last_command = self.served + 1, time.monotonic()
                send_frame(conn, END, json.dumps({"code": code}).encode())
        except (OSError, ValueError):  # the client left: serve the next one
            pass
        except Exception as exc:  # a fault of the daemon's own: the client hears of it, the daemon goes on
            traceback.print_exc()
            with contextlib.suppress(OSError):
                send_frame(conn, STDERR, f"error: the ckpt daemon failed ({type(exc).__name__}: {exc}); "
                                         f"see {log_path(self.root)}\n".encode())
                send_frame(conn, END, json.dumps({"code": 1}).encode())

    def _run(self, conn: socket.socket, request: dict[str, Any]) -> int | object:
        """Run one `ckpt` command as the client's process would, its output going back on `conn`; its exit code.

        _HERE when it cannot run here: its client runs it.
        """
        import ckptstore.cli as cli
        from ckptstore.repo import warm

        if not os.path.isdir(request["cwd"]):  # the client's folder is not there for this process (a container's)
            return _HERE
        if self.terminated:  # dequeued as a SIGTERM came: its client runs it, as those still queued
            return _HERE
        if _stopped_while_queued(conn):  # Ctrl-C, or the client gone, while it waited its turn: never started
            _Output(conn, STDERR).write(f"error: {INTERRUPTED}\n")
            return 130
        try:
            with _client_context(request), _interrupt_on_request(conn) as asked:
                stdout, stderr = _Output(conn, STDOUT), _Output(conn, STDERR)
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    try:
                        self.interruptible = True
                        # Ctrl-C, or the client gone, while it waited its turn: its SIGINT fell before it could
                        # count, and the command ran and was recorded; or the daemon's SIGTERM came this instant
                        if asked.is_set() or self.terminated:
                            raise KeyboardInterrupt
                        cli.main(request["argv"])
                    except SystemExit as exc:
                        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                    except KeyboardInterrupt:  # in the instant before cli.main's own handler: as it would say
                        print(f"error: {INTERRUPTED}", file=sys.stderr)
                        return 130
                    finally:
                        self.interruptible = False
                return 0
        finally:
            warm.settle(self.root)  # what a failed command left on the threads ends before the reply does


TERMINATE_POLL_SECONDS = 0.2  # how soon a waiting daemon sees a SIGTERM's stop
_HERE = object()  # what _run returns when the command must run in its client


def _run_in_client(conn: socket.socket) -> None:
    """Reply that the client runs its command itself (this daemon stops, or is not its repository's)."""
    send_frame(conn, END, json.dumps({"here": True}).encode())


def _identity(root: Path) -> tuple[int, int] | None:
    """Device and inode of the repository's .ckpt folder (None if it is gone)."""
    try:
        info = os.stat(root / ".ckpt")
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _remove_address(root: Path, path: Path) -> None:
    """Remove `root`'s address file if it still names this daemon's socket (a repository made anew has its own)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        if read_address(root)["socket"] == str(path):  # read through no link, nor hung on a pipe
            address_path(root).unlink()


def _lock_or_refuse(lock: Any, root: Path) -> None:
    """Hold `root`'s daemon lock, waiting a little for a daemon that is stopping; refuse if one serves."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CkptError(f"another ckpt daemon serves {root}") from None
            time.sleep(0.05)


def _sweep(folder: Path) -> None:
    """Remove the sockets of daemons that died without cleaning up (SIGKILL): nothing listens on them.

    Asked by connecting, not by pid: a killed daemon's pid can live on as a zombie, or be reused.
    """
    for socket_file in folder.glob("*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(socket_file))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                socket_file.unlink()
        except OSError:
            pass
        finally:
            probe.close()


def _write_address(root: Path, path: Path, token: str) -> None:
    """Say where this daemon listens and the token its clients send, all at once (a client never reads half of it).

    Readable by its owner only (the token admits a client), written to a new file of a random name: in a group's
    repository another member can plant a link at any name there is to guess, and a write would follow it.
    """
    target = address_path(root)
    partial = target.with_name(f"{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "w") as file:
            file.write(json.dumps({"socket": str(path), "pid": os.getpid(), "token": token}))
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _turn_away(listener: socket.socket, commands: queue.Queue) -> None:
    """Answer the commands still waiting on a daemon that stops: their clients run them themselves."""
    while True:
        try:
            item = commands.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            with item[0] as conn, contextlib.suppress(OSError):
                _run_in_client(conn)
    listener.setblocking(False)
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError, ValueError):
            conn.settimeout(REQUEST_TIMEOUT_SECONDS)
            receive_frame(conn)
            _run_in_client(conn)


@contextlib.contextmanager
def _client_context(request: dict[str, Any]) -> Iterator[None]:
    """The client's working directory, environment, umask and an empty stdin, for one command."""
    cwd, env, stdin = os.getcwd(), dict(os.environ), sys.stdin
    os.chdir(request["cwd"])
    umask = os.umask(int(request.get("umask", 0o022)))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = io.StringIO()  # a prompt reads end-of-file: the command fails instead of waiting
    try:
        yield
    finally:
        sys.stdin = stdin
        os.environ.clear()
        os.environ.update(env)
        os.umask(umask)
        os.chdir(cwd)


def _stopped_while_queued(conn: socket.socket) -> bool:
    """Whether the client sent Ctrl-C (an INTERRUPT frame waits) or went away (end of stream) before its turn.

    Looked at before the command starts: the watcher's SIGINT for a frame already there fell before the
    command could count it, and a queued commit ran and was recorded though its client said stop, or died.
    """
    try:
        return len(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) <= 1
    except (BlockingIOError, InterruptedError):
        return False  # nothing from the client: it waits for its command
    except OSError:
        return True


@contextlib.contextmanager
def _interrupt_on_request(conn: socket.socket) -> Iterator[threading.Event]:
    """Signal SIGINT to this (the main) thread when the client sends Ctrl-C or goes away mid-command.

    The event it gives is set first: one sent before the command started (queued) is seen by the command.
    """
    done, asked = threading.Event(), threading.Event()
    lock = threading.Lock()
    main = threading.main_thread().ident

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            receive_frame(conn)  # an INTERRUPT frame, or the connection closing: either stops the command
        with lock:
            if not done.is_set():
                asked.set()
                signal.pthread_kill(main, signal.SIGINT)

    watcher = threading.Thread(target=watch, name="ckpt-daemon-interrupt", daemon=True)
    watcher.start()
    try:
        yield asked
    finally:
        with lock:
            done.set()


def main() -> None:
    """`python -m ckptstore.daemon_server ROOT [--idle SECONDS]`: serve until idle, stopped or stale."""
    one_blas_thread()  # the commits it serves load numpy
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("--idle", type=float, default=DEFAULT_IDLE_SECONDS)
    args = parser.parse_args()
    try:
        _Daemon(args.root, args.idle).serve()
    except CkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
