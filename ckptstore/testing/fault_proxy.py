"""A TCP proxy on 127.0.0.1 that injects a server's failures between a client and a real server.

The S3 test server keeps its buckets in memory, so killing it would also lose what it stored;
a real server that dies comes back with its data. The proxy plays the dying server instead:
`go_down()` drops every connection and refuses new ones (the port closes), `come_up()` listens
again on the same port, `down_after(n)` dies once `n` bytes have gone upstream (mid-upload) or,
with `downloads=True`, come back from the server (mid-download),
`delay` adds latency to every chunk forwarded, `corrupt_uploads = True` flips the last byte of each
chunk of 4 KiB or more on its way to the server (an upload's body altered in transit; the test
server does not check payload signatures), `stalled = True` holds every byte (connections stay
open and nothing answers: a hung server or a network partition), and `reply_with(status)` answers each request
with an HTTP error of its own (a 500, or a 403 with S3's AccessDenied body) without forwarding it.
It counts the bytes it forwarded each way, so a test can measure what a retry sent again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from ckptstore.testing.net import free_port

_BODIES = {403: b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>"
                b"<Message>Access Denied</Message></Error>",
           500: b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InternalError</Code>"
                b"<Message>We encountered an internal error. Please try again.</Message></Error>"}
_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}


class FaultProxy:
    """Forwards 127.0.0.1:`port` to 127.0.0.1:`upstream`; see the module docstring for the faults."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.delay = 0.0
        self.stalled = False
        self.corrupt_uploads = False
        self.status: int | None = None
        self.sent = 0  # bytes forwarded client -> server
        self.received = 0  # bytes forwarded server -> client
        self._budget: int | None = None
        self._budget_downstream = False  # whether the budget counts downloads instead of uploads
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None

    # ----------------------------------------------------------------- control
    def come_up(self) -> FaultProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def go_down(self) -> None:
        """Close the port and cut every open connection, as a crashed server does."""
        with self._lock:
            listener, self._listener = self._listener, None
            open_sockets, self._sockets = list(self._sockets), set()
            self._budget = None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in open_sockets:  # shutdown wakes the pumps blocked in recv(); close alone would not
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def down_after(self, nbytes: int, downloads: bool = False) -> None:
        """Go down once `nbytes` more bytes have been forwarded to the server (from it, with `downloads`)."""
        with self._lock:
            self._budget, self._budget_downstream = nbytes, downloads

    def reply_with(self, status: int | None) -> None:
        """Answer every request with HTTP `status` (None: forward again)."""
        self.status = status

    def __enter__(self) -> FaultProxy:
        return self.come_up()

    def __exit__(self, *exc: object) -> None:
        self.go_down()

    # ----------------------------------------------------------------- plumbing
    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._listener is None:
                return False
            self._sockets.update(socks)
            return True

    def _serve(self, client: socket.socket) -> None:
        if self.status is not None:
            self._refuse(client, self.status)
            return
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            client.close()
            return
        if not self._track(client, server):
            client.close()
            server.close()
            return
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
        self._pump(client, server, True)

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if self.delay:
                    time.sleep(self.delay)
                while self.stalled and self._listener is not None:  # held until the stall ends or the proxy goes
                    time.sleep(0.05)
                if self._spend(len(chunk), upstream):
                    self.go_down()
                    return
                if upstream and self.corrupt_uploads and len(chunk) >= 4096:
                    chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])
                sink.sendall(chunk)
                with self._lock:
                    if upstream:
                        self.sent += len(chunk)
                    else:
                        self.received += len(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _spend(self, amount: int, upstream: bool) -> bool:
        """Take `amount` bytes going this way from the budget; True when it ran out (the server dies now)."""
        with self._lock:
            if self._budget is None or upstream == self._budget_downstream:
                return False
            self._budget -= amount
            return self._budget < 0

    def _refuse(self, client: socket.socket, status: int) -> None:
        """Read one request's head and answer it with `status`, closing the connection."""
        with contextlib.suppress(OSError), client:
            client.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 1 << 16:
                part = client.recv(1 << 14)
                if not part:
                    return
                head += part
            body = _BODIES.get(status, b"")
            client.sendall(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
                           f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
