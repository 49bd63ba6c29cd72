"""Who holds the repository lock, as a holder records itself and a waiter names it (repo/lock.py, PostgreSQL).

A command waiting for the lock says so after LOCK_NOTICE_S, naming the holder: its pid, host and
command, written by the holder into the lock's gate file or its PostgreSQL session's application_name.
"""

from __future__ import annotations

import os
import re
import socket
import sys

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
