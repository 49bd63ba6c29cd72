"""`ckpt`'s entry point: every failure one `error:` line and an exit code."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import click

from ckptstore.cli.group import cli
from ckptstore.cli.habits import git_habit, typed_command
from ckptstore.errors import INTERRUPTED, OutputError, explain, shown_controls
from ckptstore.repo import warm

# repr() of a surrogate os.fsdecode made of a byte: inside a quoted name, not after an escaped backslash (a
# name typed with the text \udc80 in it reads as \\udc80 there)
_REPR_OF_A_BYTE = re.compile(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])")


_QUOTED = re.compile(r"'[^']*'")


def _warning_line(message: Warning | str, *_: Any, **__: Any) -> None:
    click.echo("warning: " + _one_line(str(message)), err=True)


def _fail(message: str, code: int) -> None:
    click.echo("error: " + _one_line(message), err=True)
    sys.exit(code)


def _one_line(message: str) -> str:
    r"""`message` as one line, its control characters and a name's bytes that are not UTF-8 written out as \xNN.

    A message quoting a name with repr() shows such a byte as \udcNN (as Python decodes it), one quoting it
    bare holds the surrogate itself: both are written as the reference says names print.
    """
    text = _QUOTED.sub(lambda quoted: _REPR_OF_A_BYTE.sub(r"\1\\x\2", quoted.group()), " ".join(message.split()))
    try:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate no byte stands for: the stream writes it escaped
        pass
    return shown_controls(text)


def _output_gone(exc: OutputError) -> None:
    """Exit as git does when stdout's reader left (quietly, 141: killed by SIGPIPE); else say stdout failed."""
    # what stdout still buffers goes nowhere, not into "Exception ignored ... BrokenPipeError" at exit; a
    # stdout without a descriptor (a daemon's) or closed from the start (None) has nothing to redirect
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if exc.quiet:
        sys.exit(exc.exit_code)
    _fail(str(exc), exc.exit_code)


def _asks_debug(argv: list[str]) -> bool:
    """Whether --debug is among the group's options, before the command's name: not a word a command was given."""
    words = iter(argv)
    for word in words:
        if word == "--debug":
            return True
        if word == "--repo":
            next(words, None)  # its value
        elif word == "--" or not word.startswith("-"):
            return False
    return False


class Terminated(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt is: what the command half-wrote is undone."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _ended_as_ctrl_c_does() -> Iterator[None]:
    """While a command runs, SIGTERM (timeout, systemd, SLURM's scancel) and SIGHUP end it as Ctrl-C does.

    Their default left a checkout's temporary file, as large as the checkpoint, where no gc looks. A handler
    the program set already is kept (the daemon's, which stops it), and the default is back once the command
    ends (a program calling `main` goes on); off the main thread no handler can be set.
    """
    mine = [signum for signum in (signal.SIGTERM, signal.SIGHUP) if threading.current_thread() is
            threading.main_thread() and signal.getsignal(signum) is signal.SIG_DFL]
    for signum in mine:
        signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum in mine:
            signal.signal(signum, signal.SIG_DFL)


def _interrupted(exc: BaseException) -> None:
    """Say the command was interrupted; end as Ctrl-C ends it (130), or die of the SIGTERM or SIGHUP that came.

    Dying of it, not exiting 143, is what a supervisor counts as stopped (systemd calls exit 143 a failure).
    """
    terminated = next((e for e in (exc, exc.__context__) if isinstance(e, Terminated)), None)
    if terminated is None:
        _fail(INTERRUPTED, 130)
    click.echo("error: " + _one_line(INTERRUPTED), err=True)
    signal.signal(terminated.signum, signal.SIG_DFL)
    os.kill(os.getpid(), terminated.signum)
    sys.exit(128 + terminated.signum)  # where the signal is blocked


def main(argv: list[str] | None = None) -> None:
    """Run `ckpt` with `argv` (default: this process's arguments).

    Every failure prints one `error:` line (a traceback too with --debug) and exits with its code.
    """
    argv = sys.argv[1:] if argv is None else argv
    debug = _asks_debug(argv)  # the group's flag; read here, where the traceback is printed
    for stream in (sys.stdout, sys.stderr):  # a name that is no valid text (a lone surrogate) prints escaped
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        # per command: a warning is one line, and a daemon's earlier commands leave no "shown once" behind
        # and opening a repository loads no more than the command uses: `ckpt status` loads neither numpy nor torch
        with _ended_as_ctrl_c_does(), warnings.catch_warnings(), warm.machinery_as_needed():
            warnings.showwarning = _warning_line
            cli(args=argv, prog_name="ckpt", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:  # click raises Abort from a KeyboardInterrupt
        _interrupted(exc)
    except OutputError as exc:
        _output_gone(exc)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `ckpt`, `ckpt remote`: the help, as typed lines
        exc.show()
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        usage = isinstance(exc, click.UsageError) and exc.ctx is not None
        where = exc.ctx.command_path if usage else typed_command(argv)
        hint = f" (see `{where} --help`)" if isinstance(exc, click.UsageError) else ""  # the command's own options
        _fail(git_habit(exc) + hint, exc.exit_code)
    except Exception as exc:  # every failure reaches the user as one line; --debug shows where it came from
        if debug:
            import traceback

            traceback.print_exc()
        known = explain(exc)
        if known is None:
            _fail(f"unexpected {type(exc).__name__}: {exc}. Run again with --debug for the traceback and "
                  "please report it", 1)
        _fail(str(known), known.exit_code)
