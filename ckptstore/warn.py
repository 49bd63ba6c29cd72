"""Warnings that point at the user's line, however deep in ckptstore (or torch, or a background thread) they arise.

A fixed stacklevel fits one way in: Repository.commit, ckptstore.save, a DCP save and a
background commit reach the same warning at different depths, and a filter by module should
name the user's.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
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


LOCK_NOTICE_S = 2.0  # a wait for the repository lock says so after this long; one that ends sooner says nothing


def process_tag() -> str:
    """This process as a lock's holder records it, `PID@HOST COMMAND`: a waiter elsewhere names who it waits for."""
    argv = sys.argv or [""]
    name = os.path.basename(argv[0])
    if name == "ckpt" or argv[0].endswith(os.path.join("ckptstore", "__main__.py")):
        command = f"ckpt {_verb(argv[1:])}".strip()
    else:
        command = name if name not in ("", "-c", "-") else "python"
    return f"{os.getpid()}@{socket.gethostname()} {command}"


def _verb(args: list[str]) -> str:
    """The ckpt command `args` name, past the group's options (--repo takes a value); "" where none."""
    words = iter(args)
    for word in words:
        if word == "--repo":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


def holder_named(tag: str) -> str:
    """A lock holder's `process_tag` as a warning names it, `` `ckpt gc` (pid 12 on host) ``; anything else quoted.

    The tag comes from a file or a server others may write: control characters would garble the one line.
    """
    tag = "".join(char if char.isprintable() else "?" for char in tag.strip())[:160]
    found = re.fullmatch(r"(\d+)@(\S+) ?(.*)", tag)
    if found is None:
        return repr(tag)
    pid, host, command = found.groups()
    return f"`{command or '?'}` (pid {pid} on {host})"
