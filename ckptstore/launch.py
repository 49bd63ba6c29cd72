"""The `ckpt` command: `ckpt commit` runs in the repository's daemon when one is running, all else here.

Only the standard library and two small ckptstore modules load before that choice, so a
forwarded commit starts in milliseconds (ckptstore/daemon.py).
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point of `ckpt` and `python -m ckptstore`."""
    argv = sys.argv[1:]
    if argv[:1] == ["commit"]:
        code = _in_daemon(argv)
        if code is not None:
            sys.exit(code)
    from ckptstore.cli import main as run_here

    run_here(argv)


def _in_daemon(argv: list[str]) -> int | None:
    """The exit code of `argv` run by the repository's daemon; None when none runs (or it is stale)."""
    import ckptstore.daemon as daemon
    from ckptstore.errors import CkptError
    from ckptstore.repo import find_root

    try:
        root = find_root()
    except CkptError:
        return None  # run here: the CLI says what is missing
    try:
        return daemon.forward(root, argv)
    except CkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
