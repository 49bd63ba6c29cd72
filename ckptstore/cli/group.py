"""The `ckpt` group, its options, and what every command uses: the repository it names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from ckptstore.cli.output import echo
from ckptstore.cli.params import PathGiven
from ckptstore.repo import Repository, named_root


def _show_help(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        echo(ctx.get_help())
        ctx.exit()


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from importlib.metadata import version

        echo(f"ckpt, version {version('ckptstore')}")
        ctx.exit()


class _Command(click.Command):
    """A command whose --help is written as all output is: a stdout that refuses it fails as `ckpt log`'s does."""

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        option = super().get_help_option(ctx)
        if option is not None:
            option.callback = _show_help
        return option


class _Group(_Command, click.Group):
    command_class = _Command
    group_class = type  # its groups are _Groups too


@click.group(cls=_Group)
@click.option("--repo", envvar="CKPT_REPO", type=PathGiven(),
              help="Repository folder (that folder itself; default: the one at or above the current folder).")
@click.option("--read-only", is_flag=True, help="Open the repository without writing to it.")
@click.option("--debug", is_flag=True, help="Print the traceback of an error.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
@click.pass_context
def cli(ctx: click.Context, repo: str | None, read_only: bool, debug: bool) -> None:
    """A git-like store for training checkpoints (read-only where its folder cannot be written)."""
    from_env = ctx.get_parameter_source("repo") is click.core.ParameterSource.ENVIRONMENT
    ctx.obj = {"repo": repo, "named_by": "CKPT_REPO=" if from_env else "--repo ", "read_only": read_only}


def folder_named(ctx: click.Context) -> Path | None:
    """The repository folder --repo or CKPT_REPO names (never one above it), or None: search up from here.

    An empty --repo is refused as typed (PathGiven); an empty CKPT_REPO, which click reads as unset, here, by the
    commands that open a repository (not `init PATH`, not --help): `CKPT_REPO="$UNSET" ckpt prune` worked on
    whichever repository sat above the current folder.
    """
    folder = repo_given(ctx)
    return named_root(folder, ctx.obj["named_by"]) if folder else None


def repo_given(ctx: click.Context) -> str | None:
    """--repo or CKPT_REPO as given, or None; an empty CKPT_REPO (click reads it as unset) is refused."""
    folder = ctx.obj.get("repo")
    if folder is None and os.environ.get("CKPT_REPO") == "":
        raise click.BadParameter("is empty (a variable not set?): set it to a path, or unset it",
                                 param_hint="CKPT_REPO")
    return folder


def open_repo(ctx: click.Context) -> Repository:
    """The repository the command works on, read-only where --read-only says so; closed when the command ends."""
    repo = Repository.open(folder_named(ctx), read_only=True if ctx.obj.get("read_only") else None)
    ctx.call_on_close(repo.close)
    return repo


def remote_verbs() -> Any:
    """The remote verbs, imported by the commands that use them (every other command starts faster)."""
    from ckptstore.repo import remote

    return remote
