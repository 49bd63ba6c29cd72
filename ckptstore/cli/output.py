"""How `ckpt` writes: lines that fail as OutputError, sizes, JSON, progress bars."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ckptstore.errors import CkptError, OutputError, shown_controls

T = TypeVar("T")


class BarProgress:
    """A click progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar = None

    def start(self, label: str, total: int) -> None:
        if sys.stderr.isatty() and total > 64 << 20:
            self.bar = click.progressbar(length=total, label=label, file=sys.stderr)
            self.bar.__enter__()

    def advance(self, amount: int) -> None:
        if self.bar is not None:
            self.bar.update(amount)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# CPython drops the rest of a write over 64 KiB that the OS takes in part (a disk filling), unsaid: pieces of
# 16 Ki characters stay within it however many bytes (up to 4) UTF-8 spends on each
_PIECE = 1 << 14


def echo(text: str = "") -> None:
    """Write one line of the command's output; a stdout that refuses it raises OutputError, not an OSError.

    So a reader gone (`ckpt log | head -1`) or a full /dev/full is told apart from the repository's own disk.
    """
    if sys.stdout is None:  # started with stdout closed (`>&-`): click would drop the text without a word
        raise OutputError.closed()
    shown = shown_controls(text)
    pieces = [shown[start : start + _PIECE] for start in range(0, len(shown), _PIECE)] or [""]
    try:
        for piece in pieces[:-1]:
            click.echo(piece, nl=False)
        click.echo(pieces[-1])
    except OSError as exc:
        raise OutputError(exc) from exc


def _finite(data: Any) -> Any:
    """`data` with NaN and infinities as null: JSON has no spelling for them (strict parsers refuse `NaN`)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def emit_json(data: Any) -> None:
    echo(json.dumps(_finite(data), indent=2, default=str, allow_nan=False))


def indented(message: str) -> str:
    """A commit message under its header, every line indented as git indents it."""
    return "\n".join("    " + line for line in message.split("\n"))


def read_after_work(read: Callable[[], T], done: str, missing: str, then: str) -> T | None:
    """`read()` for a command's report once its work is `done`; None, with a warning saying so, where it fails.

    The work stands (HEAD moved, files written): the read's error exited 1 saying that nothing was changed.
    """
    try:
        return read()
    except CkptError:  # the database or store failed after the work, not during it
        warnings.warn(f"{done} is done, but {missing} could not be read: {then}", RuntimeWarning, stacklevel=2)
        return None
