"""The program's signal handlers held while a commit call runs, and run after it, once per arrival.

Python runs a handler on the main thread wherever that thread is: one that commits (a SIGTERM's last
save) inside a commit call waited on a lock the call held, until SIGKILL, or found the commit
machinery half-imported. Standard library only: signals are held before the commit machinery is
imported (`loading_held`, repo/warm.py's `load_machinery`).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any


class SignalHold:
    """The signals a commit call holds on the main thread: while it holds its repository's lane, or a whole call."""

    def __init__(self, options: Any, until: str) -> None:  # repo.commit's CommitOptions, what else runs, or None
        # each signal held, with the handler it came to, in arrival order: run by the caller holding no lock (run_held)
        self.held: list[tuple[int, Callable[..., Any]]] = []
        self.everything = False  # while a commit is put in flight: Ctrl-C's and ckptstore's own handlers wait too
        self.options = options  # the commit (or what else runs) stderr names at the first signal held
        self.until = until
        self.told = False

    def keep(self, signum: int, handler: Callable[..., Any]) -> None:
        """Hold this arrival of `signum` for `handler`: a second Ctrl-C to a handler that counts them is no first.

        Arrivals past _ARRIVALS_KEPT of one signal are merged, as the kernel merges a pending one: a timer's during a
        minutes-long commit would otherwise run its handler thousands of times in a row.
        """
        if sum(1 for held, _ in self.held if held == signum) < _ARRIVALS_KEPT:
            self.held.append((signum, handler))
        if signum not in _INFORMING:  # one that only informs waits only a moment (hold.everything): nothing to say
            self.tell(signum)

    def tell(self, signum: int) -> None:
        """Say once on stderr that a signal waits: a blocking commit of a large state takes minutes."""
        if self.told or sys.stderr is None:  # none (fd 2 closed at start): print() would write to stdout, the data
            return
        self.told = True
        try:
            name = signal.Signals(signum).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {signum}"
        what = (f"{self.options}: its handler runs once {self.until}" if isinstance(self.options, str) else
                f"the commit {describe(self.options)}: its handler runs once {self.until}; kill -9 abandons the "
                "commit (nothing of it is recorded then)")
        try:
            print(f"{name} came during {what}", file=sys.stderr, flush=True)
        except Exception:  # stderr closed, or the signal landed inside a write to it: held all the same
            pass


_ARRIVALS_KEPT = 3  # of one signal: a person's presses (a second Ctrl-C, a third) each reach the handler
# Signals that only inform (a child ended, the terminal resized, a profiler's tick): held without a word. torch sets
# one for SIGCHLD with DataLoader workers: every commit during which a child ended said that kill -9 abandons it.
_INFORMING = frozenset(getattr(signal, name) for name in ("SIGCHLD", "SIGWINCH", "SIGPROF", "SIGVTALRM", "SIGURG",
                                                          "SIGCONT") if hasattr(signal, name))
_SIGNUMS = tuple(signal.valid_signals())  # once: the call makes an enum member of each (0.1 ms a commit)


def _waits(signum: int, handler: Callable[..., Any]) -> bool:
    """Whether `handler` of `signum` waits for the commit call: all but those that only interrupt.

    One that only informs waits too, unsaid (`keep`): torch's SIGCHLD handler raises when a DataLoader
    worker died, and run at once inside a blocking commit it threw that commit away.
    """
    return not _only_interrupts(signum, handler)


def _only_interrupts(signum: int, handler: Callable[..., Any]) -> bool:
    """Whether `handler` of `signum` only raises or takes note (Ctrl-C's default, ckptstore's own): it never commits.

    Such a handler runs at once inside a commit call, as it always did: Ctrl-C stops a blocking commit
    (nothing recorded), the daemon's client's Ctrl-C too, and `ckpt watch`'s second Ctrl-C. Ours by its
    file: the daemon runs its module as __main__. A held_back (another block's, or one the program kept and
    set again) is judged by the handler it runs: by its file it is ours, and a saving handler ran inside a commit.
    """
    while hasattr(handler, "holding_for"):
        handler = handler.holding_for[signum]
    if handler is signal.default_int_handler:
        return True
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    return code is not None and os.path.realpath(code.co_filename).startswith(_PACKAGE)


_PACKAGE = os.path.realpath(Path(__file__).parent) + os.sep  # ckptstore/


@contextmanager
def signals_held(hold: SignalHold) -> Iterator[None]:
    """Hold the signals a Python handler answers until the block ends; each arrival goes to `hold.held`.

    Those that only inform, or whose handler only interrupts, run at once, unless `hold.everything`: a handler's
    exception (Ctrl-C's, SIGTERM's from _on_sigterm, a program's alarm, torch's SIGCHLD's) raised while a commit
    was put in flight left a handle no thread would resolve (the next commit call and the exit waited forever),
    or a thread its caller believed called off, writing from buffers the next snapshot reuses. Every signal, not
    a set: any handler may raise or commit (a grid engine's SIGXCPU, a profiler's timer). Python runs handlers in
    the main thread only. (A C-level handler installed over a Python one, faulthandler's, is lost.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers: dict[int, Callable[..., Any]] = {}
    holding = [True]

    def held_back(signum: int, frame: Any) -> None:
        handler = handlers[signum]
        if holding[0] and (hold.everything or _waits(signum, handler)):
            hold.keep(signum, handler)
        else:  # one that informs or only interrupts, or the block is over and this handler was kept (the program's)
            handler(signum, frame)

    held_back.holding_for = handlers  # type: ignore[attr-defined]  # for _only_interrupts: not ckptstore's own
    try:
        for signum in _SIGNUMS:
            handler = signal.getsignal(signum)
            if callable(handler):
                handlers[signum] = handler
                signal.signal(signum, held_back)
        yield
    finally:
        try:
            _put_back(handlers, held_back)  # still holding: a signal meanwhile waits with the others
        finally:
            holding[0] = False


@contextmanager
def signals_waiting(during: str = "", until: str = "") -> Iterator[None]:
    """The program's signal handlers wait while the block runs, and run after it: for a lock a saving handler takes.

    `ckptstore.save` by path holds the lock of its kept repositories a moment: a SIGTERM handler that saved
    took it again, on the same thread, and waited on itself until SIGKILL. Too short to say anything of,
    unless `during` names what runs (a download may take minutes): stderr then says so at the first signal.
    """
    hold = SignalHold(during or None, until)
    hold.told = not during
    try:
        with signals_held(hold):
            yield
    finally:
        run_held(hold.held)


def _put_back(handlers: dict[int, Callable[..., Any]], held_back: Callable[..., Any]) -> None:
    """Put each of `handlers` back where `held_back` still stands, every one though a handler raises meanwhile.

    A handler the program set during the block (a calibration function's, `ckpt watch`'s second Ctrl-C) is the
    program's choice: it stays. signal.signal runs pending handlers before it sets one: an alarm's Timeout there
    stopped the loop, and a handler left held_back ran inside the next commit (its save refused). Each is tried
    again; the first exception is raised once all are back, a later one noted on it.
    """
    error: BaseException | None = None
    for signum, handler in handlers.items():
        for _ in range(_PUT_BACK_TRIES):
            try:
                if signal.getsignal(signum) is held_back:
                    signal.signal(signum, handler)
                break
            except BaseException as exc:  # from a pending handler, this one not set yet: try it again
                error = _first_kept(error, exc)
    if error is not None:
        raise error


_PUT_BACK_TRIES = 16  # each failed try ran a handler that raised: 16 in a row would take a signal storm


def _first_kept(error: BaseException | None, exc: BaseException) -> BaseException:
    """The first of the exceptions handlers raised in a row (it propagates); a later one is noted on it, not lost."""
    if error is None:
        return exc
    if exc is not error:
        error.add_note(f"then, in another signal handler: {type(exc).__name__}: {exc}")
    return error


def run_held(held: list[tuple[int, Callable[..., Any]]]) -> None:
    """Run each held signal's handler, once per arrival in arrival order: each runs though an earlier one raises.

    Called, not raised again: a raised signal wrote set_wakeup_fd's descriptor a second time (asyncio ran its
    callback twice), and pending ones came merged, by number. Each goes to the handler it came to: a handler set
    since (`ckpt watch`'s Ctrl-C default) came after it. The frame is the commit call's, where it runs now. The
    first exception propagates once all have run (as the first would have, had it run then), a later one noted on it.
    """
    frame = sys._getframe(1)
    error: BaseException | None = None
    for signum, handler in held:
        try:
            handler(signum, frame)
        except BaseException as exc:
            error = _first_kept(error, exc)
    if error is not None:
        raise error


def describe(options: Any) -> str:
    """How a failure names the commit: its step and message where it has them."""
    parts = ([f"at step {options.step}"] if options.step is not None else []) + (
        [repr(options.message)] if options.message else [])
    return " ".join(parts) or "(no step, no message)"


def loaded(name: str) -> bool:
    """Whether module `name` is imported whole: not missing, nor half-imported (its import under way)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


@contextmanager
def loading_held(name: str) -> Iterator[ModuleType]:
    """Module `name` for the block; where it is not loaded yet, the block runs with the program's handlers held.

    `ckptstore.save`, looked up as the SIGTERM a handler saves on landed, found ckptstore.api half-imported.
    """
    if loaded(name):
        yield sys.modules[name]
        return
    with signals_waiting():
        yield importlib.import_module(name)
