"""An HTTP proxy on 127.0.0.1 that alters single S3 requests and answers, by rule, and logs the ones it altered.

fault_proxy.py plays a server that dies or stalls (TCP level); this one acts on one request at a
time: a reply of its own (a 503 SlowDown, a 403 ExpiredToken), one bit of an object's body
flipped in transit, a body cut short with a Content-Length that says so (a faulty gateway), a body
without any Content-Length, or an answer held back. Each rule is a dict:

    kind     "status" (with `code` and `s3code`, the S3 error code of the body), "flip", "short",
             "no_length" or "delay" (with `seconds`)
    method   a regular expression the request's method must match in full (any when absent)
    path     a regular expression searched for in the request's path (any when absent)
    times    how many requests it alters at most (without end when absent)

Every request a rule altered is appended to `log` as (method, path, kind), so a test can count them.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_REASONS = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}
_DROPPED = ("transfer-encoding", "content-length", "connection", "server", "date")  # set again, or not forwarded


class _QuietServer(ThreadingHTTPServer):
    """A client that drops a connection mid-answer (as it does on a missing Content-Length) is no test's failure."""

    def handle_error(self, request: object, client_address: object) -> None:
        pass


def error_body(code: str) -> bytes:
    """An S3 error document with the error code `code`."""
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the test proxy'
            f'</Message><RequestId>0</RequestId></Error>').encode()


class HttpFaultProxy:
    """Forwards HTTP requests on 127.0.0.1 to 127.0.0.1:`upstream`, altering those `rules` match (module docstring)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.rules: list[dict] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def handle_request(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_request

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HttpFaultProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _rule_for(self, method: str, path: str) -> dict | None:
        """The first rule matching the request, its count taken; None where none does."""
        with self._lock:
            for rule in self.rules:
                if rule.get("method") and not re.fullmatch(rule["method"], method):
                    continue
                if rule.get("path") and not re.search(rule["path"], path):
                    continue
                if rule.get("times") is not None:
                    if rule["times"] <= 0:
                        continue
                    rule["times"] -= 1
                self.log.append((method, path, rule["kind"]))
                return rule
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method, body = handler.command, _request_body(handler)
        rule = self._rule_for(method, handler.path.partition("?")[0])
        kind = rule["kind"] if rule else None
        if kind == "delay":
            time.sleep(rule["seconds"])
        if kind == "status":
            _answer(handler, rule["code"], _REASONS.get(rule["code"], "Error"), [], error_body(rule["s3code"]))
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=120)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
        headers["Content-Length"] = str(len(body))
        upstream.request(method, handler.path, body=body or None, headers=headers)
        response = upstream.getresponse()
        data = response.read() if method != "HEAD" else b""
        length = int(response.getheader("Content-Length") or 0) if method == "HEAD" else -1  # -1: the body's
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _DROPPED]
        upstream.close()
        if method == "GET" and response.status in (200, 206) and data:
            if kind == "flip":
                data = data[:-1] + bytes([data[-1] ^ 1])
            elif kind == "short":
                data = data[:len(data) * 2 // 3]
            elif kind == "no_length":  # a close-delimited body: no Content-Length, the connection's end ends it
                _answer(handler, response.status, response.reason, kept, data, length=None)
                return
        _answer(handler, response.status, response.reason, kept, data, length)


def _request_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request's body, sent whole or in chunks (obstore streams a part's body chunked)."""
    if handler.headers.get("Transfer-Encoding", "").lower() != "chunked":
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    parts = []
    while size := int(handler.rfile.readline().strip().split(b";")[0], 16):
        parts.append(handler.rfile.read(size))
        handler.rfile.readline()
    handler.rfile.readline()
    return b"".join(parts)


def _answer(handler: BaseHTTPRequestHandler, status: int, reason: str, headers: list, body: bytes,
            length: int | None = -1) -> None:
    """Send an answer; `length` None sends no Content-Length and closes the connection after the body."""
    handler.send_response(status, reason)
    for key, value in headers:
        handler.send_header(key, value)
    if length is None:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    else:
        handler.send_header("Content-Length", str(len(body) if length == -1 else length))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
