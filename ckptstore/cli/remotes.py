"""`ckpt remote`, `push`, `fetch`, `pull`, `clone`: other repositories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ckptstore.cli.group import cli, open_repo, remote_verbs
from ckptstore.cli.output import echo, size
from ckptstore.cli.params import PathGiven, UrlGiven
from ckptstore.errors import ReadOnlyRepoError, shown_name


@cli.group()
def remote() -> None:
    """Name other repositories to push to and fetch from."""


@remote.command("add")
@click.argument("name")
@click.argument("url")
@click.option("--metadata", "metadata_url", default="",
              help="The remote's database, for an s3:// or file:// URL (a repository folder names its own).")
@click.pass_context
def remote_add(ctx, name: str, url: str, metadata_url: str) -> None:
    """Add remote NAME at URL (a repository folder, or s3://BUCKET/PREFIX with --metadata)."""
    added = remote_verbs().add(open_repo(ctx), name, url, _metadata_of(url, metadata_url), typed_in=Path.cwd())
    echo(f"remote {name}: {shown_name(added.url)}")


@remote.command("set-url")
@click.argument("name")
@click.argument("url")
@click.option("--metadata", "metadata_url", default="",
              help="The remote's database, for an s3:// or file:// URL (a repository folder names its own).")
@click.pass_context
def remote_set_url(ctx, name: str, url: str, metadata_url: str) -> None:
    """Point remote NAME at URL (its repository moved); its tracking refs stay."""
    moved = remote_verbs().set_url(open_repo(ctx), name, url, _metadata_of(url, metadata_url), typed_in=Path.cwd())
    echo(f"remote {name}: {shown_name(moved.url)}")


@remote.command("remove")
@click.argument("name")
@click.pass_context
def remote_remove(ctx, name: str) -> None:
    """Forget remote NAME and its remote-tracking refs."""
    remote_verbs().remove(open_repo(ctx), name)


@remote.command("list")
@click.pass_context
def remote_list(ctx) -> None:
    """List remotes and their URLs."""
    verbs = remote_verbs()
    for name, where in sorted(open_repo(ctx).config.remotes.items()):  # never a password (a config may hold one)
        echo(f"{shown_name(name)}\t{shown_name(verbs.without_credentials(where.url))}"
             + (f" (metadata {shown_name(verbs.shown_url(where.metadata_url))})" if where.metadata_url else ""))


def _metadata_of(url: str, metadata_url: str) -> str:
    """--metadata as given, refused (exit 2) for a folder remote: it was recorded and never read.

    A repository folder names its own database in its .ckpt/config.toml; only objects at a URL need one.
    """
    if metadata_url and "://" not in url:
        raise click.UsageError(f"--metadata names the database of a remote whose objects are at a URL (s3://, "
                               f"file://); {shown_name(url)} is a repository folder, which names its own: leave "
                               "--metadata out")
    return metadata_url


def _moved(report: Any, verb: str = "received") -> None:
    echo(f"{report.commits} commits, {report.objects} objects ({size(report.object_bytes)}) {verb}")
    for ref, old, new in report.refs_moved or []:
        echo(f"  {ref}: {old[:12] + '..' if old else '(new) '}{new[:12] if new else '(deleted: gone there)'}")


@cli.command()
@click.argument("name", default="origin")
@click.argument("branch", required=False)
@click.option("--force", is_flag=True, help="Move the remote's branch even when it drops commits there.")
@click.pass_context
def push(ctx, name: str, branch: str | None, force: bool) -> None:
    """Send BRANCH (default: HEAD's) to remote NAME (default: origin); only what it lacks travels."""
    _moved(remote_verbs().push(open_repo(ctx), name, branch, force), "sent")


@cli.command()
@click.argument("name", default="origin")
@click.pass_context
def fetch(ctx, name: str) -> None:
    """Bring remote NAME's branches here as NAME/BRANCH."""
    _moved(remote_verbs().fetch(open_repo(ctx), name))


@cli.command()
@click.argument("name", default="origin")
@click.argument("branch", required=False)
@click.pass_context
def pull(ctx, name: str, branch: str | None) -> None:
    """Fetch from NAME, then fast-forward BRANCH (default: HEAD's) to NAME/BRANCH."""
    repo = open_repo(ctx)
    head = repo.head()[0]  # before: once the branch moved, a failed read exited 1 saying nothing was changed
    report, moved = remote_verbs().pull(repo, name, branch)
    _moved(report)
    pulled = branch or head
    elsewhere = f"; HEAD stays on {head or 'its commit'}: `ckpt checkout {pulled}` writes its files" if (
        moved and pulled != head) else ""
    echo((f"fast-forwarded {pulled} to {moved[:12]}" if moved else f"{pulled} is already up to date") + elsewhere)


@cli.command()
@click.argument("url", type=UrlGiven())
@click.argument("path", required=False, type=PathGiven())
@click.option("--metadata", "metadata_url", default="",
              help="The remote's database, for an s3:// or file:// URL (a repository folder names its own).")
@click.option("--lazy", is_flag=True, help="Fetch commit records now and objects when a checkout needs them.")
@click.pass_context
def clone(ctx: click.Context, url: str, path: str | None, metadata_url: str, lazy: bool) -> None:
    """Make a repository in PATH with remote origin at URL and its branches."""
    if ctx.obj.get("read_only"):
        raise ReadOnlyRepoError("`ckpt clone` writes a repository, and --read-only refuses every write; run it without")
    metadata_url = _metadata_of(url, metadata_url)
    target = path or _clone_folder(url)
    with remote_verbs().clone(url, target, metadata_url, lazy) as repo:
        echo(f"Cloned {shown_name(url)} into {shown_name(str(repo.root))}"
             + (" (lazily: objects come on first checkout)" if lazy else ""))


def _clone_folder(url: str) -> str:
    """The folder a clone makes where none is given: the remote's own name, as git names it (`hub` for ../hub/.).

    The URL's last part alone was "." for ../hub/., and the clone went into the current folder.
    """
    if url.startswith("s3://"):
        parts = [part for part in url.removeprefix("s3://").split("/") if part not in ("", ".")]
        return parts[-1] if parts else "clone"
    return Path(url).resolve().name or "clone"
