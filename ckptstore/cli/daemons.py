"""`ckpt daemon`: a warm process that runs the commits."""

from __future__ import annotations

import datetime
from typing import Any

import click

from ckptstore.cli.group import cli, folder_named, open_repo
from ckptstore.cli.output import echo
from ckptstore.cli.params import Seconds
from ckptstore.errors import CkptError


@cli.group()
def daemon() -> None:
    """A warm process that runs this repository's `ckpt commit`s (no start-up per commit)."""


def _daemons() -> Any:
    """The daemon's client side, imported by the commands that use it."""
    import ckptstore.daemon as client

    return client


def _daemon_root(ctx: click.Context) -> Any:
    from ckptstore.repo import find_root

    return folder_named(ctx) or find_root()


def _daemon_line(state: dict[str, Any]) -> str:
    since = datetime.datetime.fromtimestamp(state["started"]).isoformat(sep=" ", timespec="seconds")
    if state.get("stopping"):
        return f"ckpt daemon {state['pid']} serves {state['root']}, stopping once its command in progress ends"
    return (f"ckpt daemon {state['pid']} serves {state['root']} since {since} "
            f"({state['served']} commands; stops after {state['idle']:g} s idle)")


@daemon.command("start")
@click.option("--idle", type=Seconds(min_open=True),
              help="Stop after this many seconds without a command (default 900).")
@click.pass_context
def daemon_start(ctx, idle: float | None) -> None:
    """Start the daemon (or report the running one); `ckpt commit` uses it while it runs."""
    open_repo(ctx).db.refuse_writes("daemon start (its commits write)")  # up front, as every writing command
    echo(_daemon_line(_daemons().start(_daemon_root(ctx), idle)))


@daemon.command("stop")
@click.pass_context
def daemon_stop(ctx) -> None:
    """Stop the daemon once its current command is done."""
    client, root = _daemons(), _daemon_root(ctx)
    state = client.stop(root)
    other = None if state else client.anothers(root)
    if other is not None and not other.get("damaged"):
        raise CkptError(f"{client.anothers_line(other)}; only that user can stop it")
    echo(f"stopped ckpt daemon {state['pid']}" if state else client.anothers_line(other) if other else
         "no ckpt daemon was running")


@daemon.command("status")
@click.pass_context
def daemon_status(ctx) -> None:
    """Say whether a daemon serves this repository."""
    client, root = _daemons(), _daemon_root(ctx)
    state = client.status(root)
    other = None if state else client.anothers(root)
    echo(_daemon_line(state) if state else client.anothers_line(other) if other else "no ckpt daemon is running")
