"""Warnings that point at the user's line, however deep in ckptstore (or torch, or a background thread) they arise.

A fixed stacklevel fits one way in: Repository.commit, ckptstore.save, a DCP save and a
background commit reach the same warning at different depths, and a filter by module should
name the user's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_origin = threading.local()  # in a background commit's thread: where the user's call that started it is


# @contextmanager's __enter__ and __exit__, between a `with` in ckptstore (or the user's) and ckptstore's generator:
# a warning there pointed at contextlib.py, not at the user's save or commit
_CONTEXTLIB = contextlib.__file__


def _outside(frame: FrameType | None, level: int) -> tuple[FrameType | None, int]:
    """The first frame from `frame` outward that is neither ckptstore's, torch's (DCP calls ours) nor contextlib's."""
    torch = sys.modules.get("torch")
    inside = (_PACKAGE, os.path.dirname(torch.__file__) + os.sep) if getattr(torch, "__file__", None) else (_PACKAGE,)
    while frame is not None and (frame.f_code.co_filename.startswith(inside)
                                 or frame.f_code.co_filename == _CONTEXTLIB):
        frame, level = frame.f_back, level + 1
    return frame, level


def _thread_origin(frame: FrameType | None) -> tuple[str, int, dict[str, Any]] | None:
    """A background thread's saved origin where `frame`, the first outside ckptstore, is the thread's own start."""
    where = getattr(_origin, "where", None)
    if where is not None and (frame is None or frame.f_globals.get("__name__") == "threading"):
        return where
    return None


def caller_origin() -> tuple[str, int, dict[str, Any]] | None:
    """Where the user's call that reached here is (file, line, module globals): a thread started here warns there.

    Called in a background commit's thread, that is the call that started the commit (its saved origin).
    """
    frame, _ = _outside(sys._getframe(1), 0)
    if (where := _thread_origin(frame)) is not None:
        return where
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


@contextlib.contextmanager
def warnings_at(origin: tuple[str, int, dict[str, Any]] | None) -> Iterator[None]:
    """In this (background) thread, `warn_caller` points at `origin`, the call that started the thread's work."""
    _origin.where = origin
    try:
        yield
    finally:
        _origin.where = None


def warn_caller(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn at the user's line: the first frame outside ckptstore and torch, or a background thread's origin."""
    frame, level = _outside(sys._getframe(1), 2)
    where = _thread_origin(frame)
    if where is not None:
        filename, lineno, module_globals = where
        # code from `python -c`, stdin or a REPL has no source to show: asking its loader for it raises
        source_of = None if filename.startswith("<") else module_globals
        registry = module_globals.setdefault("__warningregistry__", {})
        try:
            warnings.warn_explicit(message, category, filename, lineno, module=module_globals.get("__name__"),
                                   registry=registry, module_globals=source_of)
        except (ImportError, OSError):  # the script gone meanwhile, or no descriptor left to read it: no line shown
            warnings.warn_explicit(message, category, filename, lineno, module=module_globals.get("__name__"),
                                   registry=registry)
        return
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)
