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
    command, repo = _command_of(argv)
    # A calibration function, and the classes --trust-pickle unpickles, are the user's code: they are
    # imported here, with the caller's sys.path and fresh, never a daemon's old copy
    if command == "commit" and not any(arg.startswith(("--calibration", "--trust-pickle")) for arg in argv):
        code = _in_daemon(argv, repo)
        if code is not None:
            sys.exit(code)
    from ckptstore.cli import main as run_here

    run_here(argv)


def _command_of(argv: list[str]) -> tuple[str | None, str | None]:
    """The subcommand `argv` names and the repository folder its --repo gives, past the global options.

    None for the command where another option comes first (--read-only, --help): such a run stays here.
    """
    repo, index = None, 0
    while index < len(argv) and argv[index].startswith("-"):
        option, joined, value = argv[index].partition("=")
        if option == "--repo" and not joined and index + 1 < len(argv):
            repo, index = argv[index + 1], index + 2
        elif option == "--repo" and joined:  # --repo=PATH (--repo= is empty, as click reads it)
            repo, index = value or None, index + 1
        elif option == "--debug" and not joined:
            index += 1
        else:
            return None, repo
    return (argv[index] if index < len(argv) else None), repo


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
