"""Injected crashes for the crash-point tests: `point(name)` kills this process when CKPT_CRASH_AT names it.

Called at each durable step of commit and gc (objects written, pack written, manifest written,
metadata transaction committed, an object deleted), so a test can stop the process exactly there
and check that nothing is lost. CKPT_CRASH_AT=NAME kills at the first time NAME is reached,
NAME@N at the N-th. CKPT_WAIT_AT=NAME=PATH instead holds the process at NAME until the file
PATH exists, having created PATH.reached, so a test can run another process in between.
CKPT_FAIL_AT=NAME raises DiskFullError there instead: a full disk, for tests of what a failed
write leaves behind in a process that lives on (a background commit).
Unset (always, outside tests), a point costs three dictionary lookups.
"""

from __future__ import annotations

import os
import signal

ENV = "CKPT_CRASH_AT"
WAIT_ENV = "CKPT_WAIT_AT"
FAIL_ENV = "CKPT_FAIL_AT"
_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Die by SIGKILL here if CKPT_CRASH_AT names this point (and this is its N-th visit); wait if CKPT_WAIT_AT does."""
    waiting = os.environ.get(WAIT_ENV)
    if waiting and waiting.startswith(name + "="):
        _wait(waiting[len(name) + 1:])
    if os.environ.get(FAIL_ENV) == name:
        from ckptstore.errors import disk_full

        raise disk_full(f"injected at {name} by {FAIL_ENV}")
    wanted = os.environ.get(ENV)
    if not wanted or not wanted.startswith(name):
        return
    target, _, nth = wanted.partition("@")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _wait(path: str) -> None:
    import time
    from pathlib import Path

    Path(path + ".reached").touch()
    while not Path(path).exists():
        time.sleep(0.02)
