"""The `ckpt` command: `ckpt commit` runs in the repository's daemon when one is running, all else here.

Only the standard library and a few small ckptstore modules load before that choice, so a
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
    from ckptstore.daemon import command_of, forwardable, one_blas_thread  # the standard library only: stays fast

    one_blas_thread()  # before numpy loads: here, or in a daemon this command starts

    if forwardable(argv):  # a commit that imports none of the user's code (daemon.py)
        code = _in_daemon(argv, command_of(argv)[1])
        if code is not None:
            sys.exit(code)
    from ckptstore.cli import main as run_here

    run_here(argv)


def _in_daemon(argv: list[str], repo: str | None) -> int | None:
    """The exit code of `argv` run by its repository's daemon (`repo`, else found from here); None if none runs."""
    import ckptstore.daemon as daemon
    from ckptstore.errors import INTERRUPTED, CkptError
    from ckptstore.repo import find_root, named_root

    try:
        root = named_root(repo, "--repo ") if repo else find_root()
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
