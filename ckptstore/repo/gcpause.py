"""Holding off Python's cyclic garbage collector while a commit or a checkout runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Pause cyclic collections for the block; they resume afterwards.

    Commits and checkouts allocate tens of thousands of short-lived containers and create no
    reference cycles, so the collections they would trigger only pause them (a full collection
    could land inside a commit; see docs/design-notes.md).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
