"""A throwaway S3-compatible server on 127.0.0.1 (moto's standalone server) for tests and benchmarks.

Real HTTP, real signatures on the client side, real multipart uploads; nothing leaves the
machine. Buckets live in the server's memory, so they vanish when it stops: fault tests that
need the data to survive an outage cut the connection in front of it (`FaultProxy`) instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

from ckptstore.testing.net import free_port, wait_for_http

# what the test server accepts; moto checks that requests are signed, not with which key
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "ckpt-test", "AWS_SECRET_ACCESS_KEY": "ckpt-test-secret",
                    "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's server as a subprocess on a free port of 127.0.0.1; `with S3Server() as s3:` stops it at exit."""

    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self) -> S3Server:
        log = open(os.devnull, "wb")  # noqa: SIM115 - the child owns it for its life
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=log, env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
        try:
            wait_for_http(self.endpoint + "/moto-api/", self._process, what="moto's S3 server")
        except BaseException:
            self.stop()
            raise
        return self

    def environment(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {**TEST_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    def new_bucket(self, prefix: str = "ckpt") -> str:
        """Create an empty bucket with a fresh name and return the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise RuntimeError(f"creating bucket {name} on {self.endpoint}: HTTP {response.status}")
        return name

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system, Linux): what a benchmark on the same cores shares."""
        if self._process is None:
            return 0.0
        fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
