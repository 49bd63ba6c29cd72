"""The `ckpt` command: `ckpt commit` runs in the repository's daemon when one is running, all else here.

Only the standard library and two small ckptstore modules load before that choice, so a
forwarded commit starts in milliseconds (ckptstore/daemon.py).
"""

from __future__ import annotations

import sys


def main() -> None:
    """Console entry point of `ckpt` and `python -m ckptstore`."""
    try:
        _launch(sys.argv[1:])
    except KeyboardInterrupt:  # Ctrl-C while modules load, before the CLI's own handler is in place
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


def _launch(argv: list[str]) -> None:
    # A calibration function, and the classes --trust-pickle unpickles, are the user's code: they are
    # imported here, with the caller's sys.path and fresh, never a daemon's old copy
    if argv[:1] == ["commit"] and not any(arg.startswith(("--calibration", "--trust-pickle")) for arg in argv):
        code = _in_daemon(argv)
        if code is not None:
            sys.exit(code)
    from ckptstore.cli import main as run_here

    run_here(argv)


def _in_daemon(argv: list[str]) -> int | None:
    """The exit code of `argv` run by the repository's daemon; None when none runs (or it is stale)."""
    import ckptstore.daemon as daemon
    from ckptstore.errors import INTERRUPTED, CkptError
    from ckptstore.repo import find_root

    try:
        root = find_root()
    except (CkptError, OSError):
        return None  # run here: the CLI says what is missing (no repository, the folder gone)
    try:
        return daemon.forward(root, argv)
    except CkptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: the daemon is already stopping the command
        print(f"error: {INTERRUPTED}", file=sys.stderr)
        return 130
