"""Injected crashes for the crash-point tests: `point(name)` kills this process when CKPT_CRASH_AT names it.

Called at each durable step of commit and gc (objects written, pack written, manifest written,
metadata transaction committed, an object deleted), so a test can stop the process exactly there
and check that nothing is lost. CKPT_CRASH_AT=NAME kills at the first time NAME is reached,
NAME@N at the N-th. Unset (always, outside tests), a point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "CKPT_CRASH_AT"
_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Die by SIGKILL here if CKPT_CRASH_AT names this point (and this is its N-th visit)."""
    wanted = os.environ.get(ENV)
    if not wanted or not wanted.startswith(name):
        return
    target, _, nth = wanted.partition("@")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
