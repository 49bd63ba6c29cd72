"""Small helpers for servers that tests start on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    """Return once `url` answers any HTTP status; raise if `process` exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} before it answered at {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f} s")
