"""`ckpt`: each command parses its arguments and calls one library function."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptstore.errors import (
    INTERRUPTED,
    CkptError,
    OutputError,
    ReadOnlyRepoError,
    RepoLockedError,
    RetentionError,
    explain,
    listing,
    shown_controls,
    shown_name,
)
from ckptstore.repo import LOSSY_LEVELS, EncodingSettings, Repository, fsck, gc, named_root, subject

LEVEL_NAMES = list(LOSSY_LEVELS)


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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# CPython drops the rest of a write over 64 KiB that the OS takes in part (a disk filling), unsaid: pieces of
# 16 Ki characters stay within it however many bytes (up to 4) UTF-8 spends on each
_PIECE = 1 << 14
# repr() of a surrogate os.fsdecode made of a byte: inside a quoted name, not after an escaped backslash (a
# name typed with the text \udc80 in it reads as \\udc80 there)
_REPR_OF_A_BYTE = re.compile(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])")
_QUOTED = re.compile(r"'[^']*'")


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


def _emit_json(data: Any) -> None:
    echo(json.dumps(_finite(data), indent=2, default=str, allow_nan=False))


class Seconds(click.FloatRange):
    """A number of seconds from `low` up to about 30 years: NaN, which slips through every range, and inf refused."""

    def __init__(self, low: float = 0.0, min_open: bool = False) -> None:
        super().__init__(low, 1e9, min_open=min_open)  # past ~9e9 s the waits' timeouts overflow

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail("nan is not a number of seconds", param, ctx)
        return seconds


class PathGiven(click.Path):
    """A path that is not empty: Path("") is ".", so `ckpt commit "$UNSET"` committed the whole folder."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("is empty (a variable not set?): pass a path", param, ctx)
        return super().convert(value, param, ctx)


class UrlGiven(click.types.StringParamType):
    """A URL or folder that is not empty, and nothing more checked here (a folder may be one the user cannot list)."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("is empty (a variable not set?): pass a URL or a folder", param, ctx)
        return super().convert(value, param, ctx)


def _remotes() -> Any:
    """The remote verbs, imported by the commands that use them (every other command starts faster)."""
    from ckptstore.repo import remote

    return remote


def _open(ctx: click.Context) -> Repository:
    repo = Repository.open(_named_root(ctx), read_only=True if ctx.obj.get("read_only") else None)
    ctx.call_on_close(repo.close)
    return repo


def _knobs(values: tuple[str, ...]) -> dict[str, Any]:
    """--knob NAME=VALUE pairs, for `knobs=` (as **knobs, a name such as step or blocking was commit's own argument)."""
    knobs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--knob")
        if key in knobs:  # the last one won without a word
            raise click.BadParameter(f"{key!r} is given twice", param_hint="--knob")
        try:
            knobs[key] = json.loads(value)
        except json.JSONDecodeError:
            knobs[key] = value
    return knobs


def _percentage(text: str | None) -> float | None:
    """"0.1%" as 0.001; a bare number is refused: 0.1 read as a fraction was 100 times the 0.1% a user meant."""
    if text is None:
        return None
    try:
        value = float(text.removesuffix("%")) / 100
    except ValueError:
        raise CkptError(f"--max-loss-change {text!r}: expected a percentage such as 0.1%") from None
    if not text.endswith("%"):
        raise CkptError(f"--max-loss-change {text!r}: write it as a percentage, {text}% or {float(text) * 100:g}%, "
                        "so it cannot be read 100 times too loose or too tight")
    if not value >= 0:
        raise CkptError(f"--max-loss-change {text!r}: must be zero or more")
    return value


def _metrics(values: tuple[str, ...]) -> dict[str, float]:
    metrics = {}
    for item in values:
        key, sep, value = item.partition("=")
        key = key.strip()  # ' loss = 1' names the metric `--keep-best loss` looks for
        if key in metrics:  # the last one won without a word
            raise click.BadParameter(f"{key!r} is given twice", param_hint="--metric")
        try:
            metrics[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=NUMBER", param_hint="--metric")
    return metrics


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
@click.option("--repo", envvar="CKPT_REPO", help="Repository folder (that folder itself; default: the one at or above "
                                                 "the current folder).")
@click.option("--read-only", is_flag=True, help="Open the repository without writing to it.")
@click.option("--debug", is_flag=True, help="Print the traceback of an error.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and exit.")
@click.pass_context
def cli(ctx: click.Context, repo: str | None, read_only: bool, debug: bool) -> None:
    """A git-like store for training checkpoints (read-only where its folder cannot be written)."""
    from_env = ctx.get_parameter_source("repo") is click.core.ParameterSource.ENVIRONMENT
    ctx.obj = {"repo": repo or None, "named_by": "CKPT_REPO=" if from_env else "--repo ", "read_only": read_only}


def _named_root(ctx: click.Context) -> Path | None:
    """The repository folder --repo or CKPT_REPO names (never one above it), or None: search up from here."""
    folder = ctx.obj.get("repo")
    return named_root(folder, ctx.obj["named_by"]) if folder else None


@cli.command()
@click.argument("path", required=False, type=PathGiven(file_okay=False))
@click.option("--max-chain", metavar="N|auto",
              help="Longest delta chain before a keyframe (default auto: as long as checkout stays faster "
                   "than torch.load, by measured decode costs).")
@click.option("--lossy", "lossy", type=click.Choice([*LEVEL_NAMES, "none"]), help="Default lossy level for commits.")
@click.option("--objects", "objects_url", default="",
              help="Where objects live: s3://BUCKET/PREFIX, file:///ABSOLUTE/FOLDER or a folder relative to .ckpt/ "
                   "(default: .ckpt/objects).")
@click.option("--metadata", "metadata_url", default="", metavar="URL",
              help="Where the DAG lives: postgresql://USER@HOST:PORT/DB (default: SQLite); one that holds a "
                   "repository already is joined.")
@click.pass_context
def init(ctx: click.Context, path: str | None, max_chain: str | None, lossy: str | None, objects_url: str,
         metadata_url: str) -> None:
    """Create a repository in PATH (default: --repo, CKPT_REPO or here), or join one named by --objects, --metadata."""
    if ctx.obj.get("read_only"):
        raise ReadOnlyRepoError("`ckpt init` writes a repository, and --read-only refuses every write; run it without")
    settings = EncodingSettings() if max_chain is None else EncodingSettings(max_chain=max_chain)
    where = path or ctx.obj.get("repo") or "."
    with Repository.init(where, encoding=settings, lossy=lossy or "", objects_url=objects_url,
                         metadata_url=metadata_url) as repo:
        joined = bool(metadata_url) and bool(repo.branches())
        echo(f"{'Joined the' if joined else 'Initialized empty'} ckptstore repository in {repo.dir}"
             + (f" (objects in {repo.store.url})" if objects_url else "")
             + (f" (metadata in {repo.db.where})" if metadata_url else "")
             + (f" (commits are lossy: {lossy})" if lossy and lossy != "none" else ""))


@cli.command()
@click.argument("path", type=PathGiven())
@click.option("-m", "--message", "messages", multiple=True, help="Commit message (given twice or more: paragraphs).")
@click.option("--step", type=click.IntRange(-(1 << 63), (1 << 63) - 1), help="Training step of this checkpoint.")
@click.option("--metric", "metrics", multiple=True, help="KEY=NUMBER, repeatable.")
@click.option("--branch", help="Commit to this branch (created at HEAD if new); HEAD stays.")
@click.option("--allow-empty", is_flag=True, help="Record a commit even if nothing changed.")
@click.option("--trust-pickle", is_flag=True, help="Unpickle arbitrary objects in PATH (only for files you trust).")
@click.option("--lossy", type=click.Choice([*LEVEL_NAMES, "none"]),
              help="Lossy level (default: the repository's, normally lossless).")
@click.option("--knob", "knobs", multiple=True, help="Override one setting of the lossy level, NAME=VALUE.")
@click.option("--calibration", help="MODULE:FUNCTION (or file.py:FUNCTION) returning the loss of a restored "
                                    "checkpoint's state; the lossy commit keeps its change within --max-loss-change.")
@click.option("--max-loss-change", help="Largest relative loss change on the calibration data, e.g. 0.1% "
                                        "(default: the level's promise).")
@click.pass_context
def commit(ctx, path, messages, step, metrics, branch, allow_empty, trust_pickle, lossy, knobs, calibration,
           max_loss_change) -> None:
    """Store the checkpoint at PATH (torch.save file, safetensors file, Trainer folder or DCP directory)."""
    from ckptstore.repo import function_named  # only here: it loads the encoding layers

    message = "\n\n".join(messages)  # as git joins -m's: the second one kept the first out of the commit
    repo = _open(ctx)
    try:
        cid = repo.commit(path, message=message, step=step, metrics=_metrics(metrics), branch=branch,
                          allow_empty=allow_empty, trust_pickle=trust_pickle, progress=BarProgress(),
                          lossy=lossy, calibration=function_named(calibration) if calibration is not None else None,
                          max_loss_change=_percentage(max_loss_change), knobs=_knobs(knobs))
    except RetentionError as exc:  # recorded: a script reading the id from stdout gets it, then the error
        _say_committed(repo, exc.commit_id, message, branch)
        raise
    _say_committed(repo, cid, message, branch)


def _say_committed(repo: Repository, cid: str, message: str | None, branch: str | None) -> None:
    """Print a recorded commit's summary (id, level, subject, sizes) and whether it is on no branch.

    The commit is recorded: a database that stops answering now (a server gone) costs the sizes
    and the note, never the id, nor an error that would say the commit failed.
    """
    try:
        info = repo.commit_info(cid)
        detached = branch is None and repo.head()[0] is None
    except Exception:  # noqa: BLE001 - whatever the database says, what matters was recorded
        echo(f"[{cid[:12]}] {subject(message)}  (its sizes could not be read)")
        return
    mode = f" lossy:{info.lossy}" if info.lossy else ""
    echo(f"[{cid[:12]}]{mode} {subject(message)}  ({_size(info.raw_bytes)} -> {_size(info.stored_bytes)} new)")
    if detached:
        echo(f"note: HEAD is detached, so this commit is on no branch; to keep it: ckpt branch NAME {cid[:12]}")


@cli.command()
@click.argument("ref")
@click.option("-o", "--output", type=PathGiven(), help="Write the checkpoint here; HEAD does not move.")
@click.option("--force", is_flag=True, help="Overwrite files whose content is not in the store.")
@click.option("--only", "only", multiple=True, metavar="PATTERN",
              help="Write only the values whose paths match (glob, e.g. 'model.*'; repeatable; needs -o).")
@click.option("--trust-pickle", is_flag=True,
              help="Write a sharded commit's pickled non-tensor items as stored (committed with --trust-pickle).")
@click.pass_context
def checkout(ctx, ref, output, force, only, trust_pickle) -> None:
    """Restore the checkpoint at REF and move HEAD to it (a lossless commit: files byte for byte, except below)."""
    repo = _open(ctx)
    info = repo.commit_info(ref)  # before HEAD moves: a ref like HEAD~1 names another commit afterwards
    dest = repo.checkout_to(ref, output, force=force, progress=BarProgress(), keys=list(only) or None,
                            trust_pickle=trust_pickle)
    if output is None and info.sharded:
        echo(f"HEAD is now at {info.id[:12]}, a sharded (DCP) commit: nothing is written in place; write it as a "
             f"DCP directory with `ckpt checkout {info.id[:12]} -o DIR`, or load it with CkptStorageReader")
        return
    if only:
        echo(f"Wrote the part of {info.id[:12]} matching {', '.join(only)} to {dest}; HEAD did not move")
    else:
        echo(f"Restored {info.id[:12]} to {dest}")
    rewritten = [] if only else repo.manifest(info.id).rewritten_files()
    if info.source_path is not None and not info.lossy and not only:
        echo("Files are byte for byte as committed" + (", except below." if rewritten else "."))
    if info.source_path is not None and rewritten:
        names = ", ".join(shown_name(name or str(dest)) for name in rewritten)
        echo(f"note: {names} written with torch.save (a legacy-format or unusual file, or a commit by an "
             "older ckptstore): state exact, bytes not byte for byte the committed file's")
    if info.lossy:
        echo(f"note: {info.id[:12]} is a lossy commit (level {info.lossy}): weights and optimizer "
             "state are close to, not equal to, the original; `ckpt show` lists each tensor's error")


@cli.command()
@click.argument("folder", type=PathGiven(exists=True, file_okay=False))
@click.option("--interval", type=Seconds(), default=10.0, show_default=True,
              help="Seconds between scans; a checkpoint is committed once unchanged across two.")
@click.option("--branch", help="Commit to this branch (created at HEAD if new); HEAD stays.")
@click.option("--lossy", type=click.Choice([*LEVEL_NAMES, "none"]), help="Lossy level of the commits.")
@click.option("--once", is_flag=True, help="Scan twice, --interval apart, commit what is complete, and exit.")
@click.pass_context
def watch(ctx, folder, interval, branch, lossy, once) -> None:
    """Commit checkpoint files and checkpoint-N folders appearing in FOLDER, each once complete (Ctrl-C stops)."""
    import threading

    from ckptstore.repo import WatchOptions, watch_folder

    stop = threading.Event()

    def on_interrupt(signum, frame) -> None:  # finish the commit in progress; a second Ctrl-C interrupts it
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        report = watch_folder(_open(ctx), folder, WatchOptions(interval, branch, lossy, once), stop, echo)
    finally:
        signal.signal(signal.SIGINT, previous)
    for name, why in sorted(report.waiting.items()):
        echo(f"waiting: {name}: {why}")
    how = "stopped on Ctrl-C" if report.stopped else "done"
    echo(f"{how}: {len(report.committed)} checkpoint(s) committed")


@cli.command("export")
@click.argument("ref")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "torch"]),
              help="Default: torch for FILE named .pt, .pth, .bin or .ckpt, else safetensors.")
@click.option("-o", "--output", type=PathGiven(), required=True, help="The file to write.")
@click.option("--all", "everything", is_flag=True,
              help="Every tensor by path, not only a Hugging Face checkpoint folder's weights.")
@click.pass_context
def export_command(ctx, ref, fmt, output, everything) -> None:
    """Write the commit at REF as one full state dict file (a sharded commit's shards gathered).

    A Hugging Face checkpoint folder gives its model weights under their own names, so
    `from_pretrained` of a folder with that file and the run's config.json loads it.
    """
    from ckptstore.repo import export, export_format  # numpy and the formats: only for this command

    fmt = export_format(output, fmt)
    report = export(_open(ctx), ref, fmt, output, everything)
    echo(f"Wrote {report.commit[:12]} to {output}: {report.tensors} tensors ({fmt})")
    if report.skipped:
        count = len(report.skipped)
        names = listing([shown_name(name) for name in report.skipped], 5)
        echo(f"note: left out {count} item{'s' if count != 1 else ''} ({names}): {report.why_skipped}")


@cli.command()
@click.option("--graph", is_flag=True, help="Draw the history as a graph.")
@click.option("--all", "all_refs", is_flag=True, help="Every branch and tag, not only HEAD.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def log(ctx, graph, all_refs, as_json) -> None:
    """Show the history."""
    if graph and as_json:  # --graph was dropped without a word
        raise click.UsageError("--graph draws text; --json lists the commits: choose one")
    repo = _open(ctx)
    if as_json:
        return _emit_json([dict(c.to_json(), **({"pruned": True} if c.pruned else {}))
                           for c in repo.log(all_refs=all_refs)])
    if graph:
        for line in repo.log_graph(all_refs=all_refs) or _unborn_head(repo):
            echo(line)
        return None
    labels = repo.decorations()
    commits = repo.log(all_refs=all_refs)
    for line in [] if commits else _unborn_head(repo):
        echo(line)
    for info in commits:
        deco = f" ({', '.join(labels[info.id])})" if info.id in labels else ""
        when = _when(info.created_at)
        lossy = f"\nLossy:  {info.lossy}" if info.lossy else ""
        lossy += "\nPruned: its tensors were removed by `ckpt prune`" if info.pruned else ""
        echo(f"commit {info.id}{deco}\nDate:   {when}\nStep:   {info.step}{lossy}")
        if info.metrics:
            echo("Metrics: " + ", ".join(f"{shown_name(k)}={v:g}" for k, v in info.metrics.items()))
        echo(f"\n{_indented(info.message)}\n")
    return None


def _when(seconds: float) -> str:
    """A commit's time in this machine's zone with its UTC offset, as git shows it; a time no date holds as @SECONDS.

    Without the offset two machines' logs of one shared repository disagreed unsaid; a time past
    year 9999 (a machine's clock, a remote's record) stopped the whole log.
    """
    try:
        return datetime.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return f"@{seconds}"


def _unborn_head(repo) -> list[str]:
    """A line where HEAD's branch has no commits but others have (a sharded save to its own branch).

    An empty log said nothing of them.
    """
    branch, head = repo.head()
    others = sorted(repo.branches())
    if head is not None or not others:
        return []
    return [f"note: HEAD's branch {branch!r} has no commits yet; {listing(others, 5)} "
            f"{'has' if len(others) == 1 else 'have'}: `ckpt log --all` lists them"]


@cli.command()
@click.argument("name", required=False)
@click.argument("start", required=False, default="HEAD")
@click.option("-d", "delete", help="Delete branch NAME.")
@click.pass_context
def branch(ctx, name, start, delete) -> None:
    """List branches, create NAME at START, or delete one with -d."""
    repo = _open(ctx)
    _create_or_delete(name, delete)
    if delete is not None:
        cid = repo.delete_branch(delete)
        echo(f"Deleted branch {delete} (was {cid[:12]})")
    elif name is not None:  # "" is a (bad) name, not a request for the listing
        cid = repo.branch(name, start)
        echo(f"Created branch {name} at {cid[:12]}")
    else:
        current, _ = repo.head()
        for branch_name, cid in repo.branches().items():
            echo(f"{'*' if branch_name == current else ' '} {shown_name(branch_name)} {cid[:12]}")


@cli.command()
@click.argument("name", required=False)
@click.argument("ref", required=False, default="HEAD")
@click.option("-d", "delete", help="Delete tag NAME.")
@click.pass_context
def tag(ctx, name, ref, delete) -> None:
    """List tags, tag REF (default HEAD) as NAME, or delete one with -d."""
    repo = _open(ctx)
    _create_or_delete(name, delete)
    if delete is not None:
        echo(f"Deleted tag {delete} (was {repo.delete_tag(delete)[:12]})")
    elif name is not None:
        echo(f"Tagged {repo.tag(name, ref)[:12]} as {name}")
    else:
        for tag_name, cid in repo.tags().items():
            echo(f"{shown_name(tag_name)} {cid[:12]}")


@cli.command()
@click.argument("ref", default="HEAD")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx, ref, as_json) -> None:
    """Show one commit: metadata, files and tensors."""
    data = _open(ctx).show(ref)
    if as_json:
        return _emit_json(data)
    echo(f"commit {data['id']}\nparents {' '.join(p[:12] for p in data['parents']) or '-'}")
    echo(f"step {data['step']}  metrics {data['metrics']}  source {shown_name(str(data['source_path']))}")
    if data.get("pruned"):  # its row stays for the history; its tensors and their bytes are gone
        echo(f"pruned by `ckpt prune`: its tensors are gone{' (it was lossy)' if data.get('lossy') else ''}")
    elif data.get("lossy"):
        echo(f"lossy commit, level {data['lossy']}; optimizer pairing: {data.get('pairing')}; "
             f"importance: {data.get('importance')}")
    stored = "- (pruned)" if data.get("pruned") else _size(data["stored_bytes"])
    echo(f"raw {_size(data['raw_bytes'])}  stored {stored}\n\n{_indented(data['message'])}\n")
    for f in data["files"] if data["kind"] != "state" else []:  # an in-memory state's only record has no file
        echo(f"file {shown_name(f['name']) or '.'} [{f['format']}] {_size(f['size'])} {f['note']}".rstrip())
    for row in data.get("fidelity", []):
        bound = (f", at most {row['worst_of_bound']:.0%} of its bound" if row["worst_of_bound"] is not None
                 else " (no bound)")
        echo(f"measured {row['quantity']}: worst {row['worst']:.2e} over {row['tensors']} tensors{bound}")
    if "sharded" in data:  # a DCP commit: its logical tensors, not every shard
        for t in data["sharded"]:
            echo(f"  {shown_name(t['fqn'])}  {t['dtype']} {tuple(t['shape'])}  {t['shards']} shard"
                 f"{'s' if t['shards'] != 1 else ''}")
        echo(f"({len(data['tensors'])} stored shards; --json lists them)")
        return None
    for t in data["tensors"]:
        error = f"  rel.err {t['rel_error']:.2e}" if "rel_error" in t else ""
        error += f" (bound {t['max_error']:.2e})" if "max_error" in t else ""
        echo(f"  {shown_name(t['path'])}  {t['dtype']} {tuple(t['shape'])}  {_size(t['stored_bytes'])} "
             f"depth {t['depth']}{error}")
    return None


@cli.command()
@click.pass_context
def status(ctx) -> None:
    """Where HEAD is, and whether the checkpoint files still match it."""
    report = _open(ctx).status()
    where = f"On branch {report['branch']}" if report["branch"] else "HEAD detached"
    echo(where + (f" at {report['head'][:12]}" if report["head"] else " (no commits yet)"))
    for item in report["files"]:
        note = f" ({item['note']})" if item.get("note") else ""
        echo(f"  {item['state']:>10}: {shown_name(item['path'])}{note}")


@cli.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "show_all", is_flag=True, help="Also list unchanged tensors.")
@click.pass_context
def diff(ctx, a, b, as_json, show_all) -> None:
    """Per tensor: changed or not, relative L2 change, stored bytes in B; then the non-tensor values that differ."""
    rows = _open(ctx).diff(a, b)
    if as_json:
        return _emit_json([r.to_json() for r in rows])
    for row in rows:
        if row.status == "unchanged" and not show_all:
            continue
        if row.is_value:
            echo(f"{row.status:>9} {shown_name(row.path)} (a non-tensor value)")
            continue
        rel = "" if row.relative_l2 is None else f" rel_l2={row.relative_l2:.3e}"
        echo(f"{row.status:>9} {shown_name(row.path)} {row.dtype} {tuple(row.shape)}{rel} "
             f"stored={_size(row.stored_bytes)}")
    tensors = [r for r in rows if not r.is_value]
    values = len(rows) - len(tensors)
    unchanged = sum(r.status == "unchanged" for r in tensors)
    echo(f"{len(tensors) - unchanged} of {len(tensors)} tensors differ" + (f"; {values} non-tensor values differ"
                                                                         if values else ""))
    return None


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def stats(ctx, as_json) -> None:
    """Per commit raw bytes, newly stored bytes and ratio; totals."""
    data = _open(ctx).stats()
    if as_json:
        return _emit_json(data)
    echo(f"{'commit':<12} {'step':>8} {'raw':>12} {'stored':>12} {'ratio':>8}  message")
    for row in data["commits"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"  # "-": nothing new stored
        stored, ratio = ("pruned", "-") if row["pruned"] else (_size(row["stored_bytes"]), ratio)
        echo(f"{row['id'][:12]} {row['step'] if row['step'] is not None else '-':>8} "
             f"{_size(row['raw_bytes']):>12} {stored:>12} {ratio:>8}  {subject(row['message'])}")
    kept = sum(not row["pruned"] for row in data["commits"])
    pruned = f" ({len(data['commits']) - kept} more pruned)" if kept < len(data["commits"]) else ""
    echo(f"total: {kept} commits{pruned}, {_size(data['raw_bytes'])} of checkpoints in "
         f"{_size(data['stored_bytes'])} on disk ({_size(data['objects_bytes'])} objects, "
         f"{_size(data['metadata_bytes'])} metadata), {data['ratio']:.2f}x")
    return None


@cli.command("gc")
@click.option("--prune", is_flag=True, help="Also delete commits no branch, tag or HEAD reaches.")
@click.pass_context
def gc_command(ctx, prune) -> None:
    """Remove objects no commit needs (and leftovers of interrupted commits)."""
    repo = _open(ctx)
    report = _saying_it_waits(lambda wait: gc(repo, prune_unreachable=prune, wait=wait))
    echo(f"removed {report.objects_removed} objects ({_size(report.bytes_removed)}), "
         f"{report.tensors_removed} tensor records, {report.commits_removed} commits, "
         f"{report.temp_files_removed} temp files")


@cli.command("prune")
@click.option("--keep-last", type=click.IntRange(min=0), default=0, help="Keep each branch's N newest commits.")
@click.option("--keep-every", type=click.IntRange(min=0), default=0,
              help="Keep every K-th commit of each branch, counted from its first commit.")
@click.option("--keep-best", default="", metavar="METRIC[:min|max]", help="Keep each branch's best commit by METRIC.")
@click.option("--keep-tagged", is_flag=True, help="Keep tagged commits.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def prune_command(ctx, keep_last, keep_every, keep_best, keep_tagged, dry_run, as_json) -> None:
    """Remove the commits a retention policy does not keep (default: [retention] in config.toml); free their space."""
    from ckptstore.repo import RetentionPolicy, prune

    given = RetentionPolicy(keep_last, keep_every, keep_best, keep_tagged)
    repo = _open(ctx)
    report = _saying_it_waits(lambda wait: prune(repo, given if given.active else None, dry_run=dry_run, wait=wait))
    if as_json:
        return _emit_json(vars(report))
    if dry_run:
        echo(f"would remove {len(report.pruned)} commits, re-encoding up to {report.tensors_reencoded} "
             "tensors they were bases of")
    else:
        echo(f"removed {len(report.pruned)} commits, re-encoded {report.tensors_reencoded} tensors they were "
             "bases of")
    for cid in report.pruned:
        echo(f"  {cid[:12]}")
    if report.bytes_after is not None:
        # more after: survivors re-encoded whole outweigh what went (a lazy clone also read their chains from its
        # origin), or objects this user may not delete stayed (a warning said so)
        change = report.bytes_before - report.bytes_after
        lazy = any(remote.lazy for remote in repo.config.remotes.values())
        echo(f"objects held here: {_size(report.bytes_before)} before, {_size(report.bytes_after)} after "
             + (f"({_size(change)} freed)" if change >= 0 else f"({_size(-change)} more: the survivors re-encoded"
                                                                f"{', read from the origin' if lazy else ''})"))
    return None


@cli.command("fsck")
@click.option("--full", is_flag=True, help="Also decode every tensor and check it against its id.")
@click.option("--remote", "remote_name", help="Check remote NAME instead of this repository.")
@click.pass_context
def fsck_command(ctx, full, remote_name) -> None:
    """Verify every stored object; list damaged objects and the commits they break."""
    repo = _open(ctx)  # an empty --remote is a name like any other: no remote has it
    report = _remotes().fsck_remote(repo, remote_name, full) if remote_name is not None else fsck(repo, full=full)
    echo(f"checked {report.objects_checked} objects"
         + (f", verified {report.tensors_verified} tensors" if full else ""))
    for oid, problem in report.damaged_objects.items():
        echo(f"damaged object {oid}: {problem}")
    for what, problem in report.damaged_records.items():
        echo(f"damaged record {shown_name(what)}: {problem}")  # a forged ref row's name may hold a newline
    for cid, oids in report.broken_commits.items():
        needs = f"needs {', '.join(o[:12] for o in oids)}" if oids else "its records are damaged"
        echo(f"broken commit {cid[:12]} ({needs})")
    for tid in report.missing_records:
        echo(f"missing tensor record {tid}")
    if report.unchecked:
        echo(f"{len(report.unchecked)} objects not held here were not checked: {report.unchecked_why}")
    damaged = report.damaged_objects or report.missing_records or report.damaged_records
    if report.newer:
        echo(f"{len(report.newer)} commit(s) ({', '.join(c[:12] for c in report.newer[:3])}) were written by a newer "
             "ckptstore and not checked against their manifests: upgrade ckptstore to check them")
    if report.unreferenced_objects and damaged:
        echo(f"{report.unreferenced_objects} objects no intact record names (gc keeps them while there is damage: "
             "they may be what a damaged record lost track of)")
    elif report.unreferenced_objects:
        echo(f"{report.unreferenced_objects} unreferenced objects (run `ckpt gc` to remove them)")
    if not report.ok:
        raise SystemExit(1)
    echo("ok")


@cli.group()
def remote() -> None:
    """Name other repositories to push to and fetch from."""


@remote.command("add")
@click.argument("name")
@click.argument("url")
@click.option("--metadata", "metadata_url", default="", help="The remote's database, for an s3:// URL.")
@click.pass_context
def remote_add(ctx, name: str, url: str, metadata_url: str) -> None:
    """Add remote NAME at URL (a repository folder, or s3://BUCKET/PREFIX with --metadata)."""
    added = _remotes().add(_open(ctx), name, url, metadata_url, typed_in=Path.cwd())
    echo(f"remote {name}: {added.url}")


@remote.command("set-url")
@click.argument("name")
@click.argument("url")
@click.option("--metadata", "metadata_url", default="", help="The remote's database, for an s3:// URL.")
@click.pass_context
def remote_set_url(ctx, name: str, url: str, metadata_url: str) -> None:
    """Point remote NAME at URL (its repository moved); its tracking refs stay."""
    moved = _remotes().set_url(_open(ctx), name, url, metadata_url, typed_in=Path.cwd())
    echo(f"remote {name}: {moved.url}")


@remote.command("remove")
@click.argument("name")
@click.pass_context
def remote_remove(ctx, name: str) -> None:
    """Forget remote NAME and its remote-tracking refs."""
    _remotes().remove(_open(ctx), name)


@remote.command("list")
@click.pass_context
def remote_list(ctx) -> None:
    """List remotes and their URLs."""
    for name, where in sorted(_open(ctx).config.remotes.items()):
        echo(f"{name}\t{where.url}" + (f" (metadata {where.metadata_url})" if where.metadata_url else ""))


def _indented(message: str) -> str:
    """A commit message under its header, every line indented as git indents it."""
    return "\n".join("    " + line for line in message.split("\n"))


def _moved(report: Any, verb: str = "received") -> None:
    echo(f"{report.commits} commits, {report.objects} objects ({_size(report.object_bytes)}) {verb}")
    for ref, old, new in report.refs_moved or []:
        echo(f"  {ref}: {old[:12] + '..' if old else '(new) '}{new[:12] if new else '(deleted: gone there)'}")


@cli.command()
@click.argument("name", default="origin")
@click.argument("branch", required=False)
@click.option("--force", is_flag=True, help="Move the remote's branch even when it drops commits there.")
@click.pass_context
def push(ctx, name: str, branch: str | None, force: bool) -> None:
    """Send BRANCH (default: HEAD's) to remote NAME (default: origin); only what it lacks travels."""
    _moved(_remotes().push(_open(ctx), name, branch, force), "sent")


@cli.command()
@click.argument("name", default="origin")
@click.pass_context
def fetch(ctx, name: str) -> None:
    """Bring remote NAME's branches here as NAME/BRANCH."""
    _moved(_remotes().fetch(_open(ctx), name))


@cli.command()
@click.argument("name", default="origin")
@click.argument("branch", required=False)
@click.pass_context
def pull(ctx, name: str, branch: str | None) -> None:
    """Fetch from NAME, then fast-forward BRANCH (default: HEAD's) to NAME/BRANCH."""
    repo = _open(ctx)
    report, moved = _remotes().pull(repo, name, branch)
    _moved(report)
    head = repo.head()[0]
    pulled = branch or head
    elsewhere = f"; HEAD stays on {head or 'its commit'}: `ckpt checkout {pulled}` writes its files" if (
        moved and pulled != head) else ""
    echo((f"fast-forwarded {pulled} to {moved[:12]}" if moved else f"{pulled} is already up to date") + elsewhere)


@cli.command()
@click.argument("url", type=UrlGiven())
@click.argument("path", required=False, type=PathGiven())
@click.option("--metadata", "metadata_url", default="", help="The remote's database, for an s3:// URL.")
@click.option("--lazy", is_flag=True, help="Fetch commit records now and objects when a checkout needs them.")
@click.pass_context
def clone(ctx: click.Context, url: str, path: str | None, metadata_url: str, lazy: bool) -> None:
    """Make a repository in PATH with remote origin at URL and its branches."""
    if ctx.obj.get("read_only"):
        raise ReadOnlyRepoError("`ckpt clone` writes a repository, and --read-only refuses every write; run it without")
    target = path or (url.rstrip("/").rsplit("/", 1)[-1] or "clone")
    with _remotes().clone(url, target, metadata_url, lazy) as repo:
        echo(f"Cloned {url} into {repo.root}" + (" (lazily: objects come on first checkout)" if lazy else ""))


@cli.group()
def daemon() -> None:
    """A warm process that runs this repository's `ckpt commit`s (no start-up per commit)."""


def _daemons() -> Any:
    """The daemon's client side, imported by the commands that use it."""
    import ckptstore.daemon as client

    return client


def _daemon_root(ctx: click.Context) -> Any:
    from ckptstore.repo import find_root

    return _named_root(ctx) or find_root()


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
    _open(ctx).db.refuse_writes("daemon start (its commits write)")  # up front, as every writing command
    echo(_daemon_line(_daemons().start(_daemon_root(ctx), idle)))


@daemon.command("stop")
@click.pass_context
def daemon_stop(ctx) -> None:
    """Stop the daemon once its current command is done."""
    client, root = _daemons(), _daemon_root(ctx)
    state = client.stop(root)
    other = None if state else client.anothers(root)
    if other is not None:
        raise CkptError(f"{client.anothers_line(other)}; only that user can stop it")
    echo(f"stopped ckpt daemon {state['pid']}" if state else "no ckpt daemon was running")


@daemon.command("status")
@click.pass_context
def daemon_status(ctx) -> None:
    """Say whether a daemon serves this repository."""
    client, root = _daemons(), _daemon_root(ctx)
    state = client.status(root)
    other = None if state else client.anothers(root)
    echo(_daemon_line(state) if state else client.anothers_line(other) if other else "no ckpt daemon is running")


def _create_or_delete(name: str | None, delete: str | None) -> None:
    if delete is not None and name is not None:  # one of them would be ignored
        raise click.UsageError(f"give either NAME to create or -d NAME to delete, not both ({name!r} and {delete!r})")


def _saying_it_waits(run: Callable[[bool], Any]) -> Any:
    """`run(wait=False)`; when the repository lock is taken, say so on stderr, then wait for it: no silent hang."""
    try:
        return run(False)
    except RepoLockedError:
        click.echo("waiting for the repository lock: another ckpt process holds it (a commit, push, fetch, gc or "
                   "prune in flight; a sharded save whose ranks failed, until its process saves again or exits)",
                   err=True)
        return run(True)


def _typed(argv: list[str]) -> str:
    """The command `argv` names ("ckpt commit"), for an error click raised before it made the command's context."""
    words, command, tokens = ["ckpt"], cli, iter(argv)
    for token in tokens:
        if not isinstance(command, click.Group):
            break
        if token == "--repo":
            next(tokens, None)  # its value, which may read as a command's name
        elif token in command.commands:
            command = command.commands[token]
            words.append(token)
    return " ".join(words)


# git's words ckpt has no command for, and what does it here: click's nearest spelling sent `switch` to
# `watch`, `remote rename` to `remote remove` (which forgets the remote), `gc --dry-run` to `--prune`
_GIT_WORDS = {
    "switch": "`ckpt checkout BRANCH` switches branch and writes its files",
    "restore": "`ckpt checkout HEAD` writes HEAD's files back (`--only PATTERN` for some of them)",
    "reset": "`ckpt checkout REF` writes a commit's files; `ckpt branch NAME REF` starts a branch there",
    "rename": "`ckpt remote add NEW URL`, then `ckpt remote remove OLD`",
    "stash": "commit the files on a branch of their own (`ckpt branch wip`, `ckpt checkout wip`, then commit)",
    "merge": "checkpoints are not merged: `ckpt branch NAME REF` goes on from the one you choose",
    "rebase": "checkpoints are not rebased: `ckpt branch NAME REF` goes on from the one you choose",
}
_DESTRUCTIVE = {"--prune", "--force", "remove"}  # offered only for a word typed nearly so (a typo of it)


def _git_habit(exc: click.ClickException) -> str:
    """Click's message, with what ckpt offers for a git word, and no destructive command or option guessed."""
    if isinstance(exc, click.NoSuchOption):
        exc.possibilities = [p for p in exc.possibilities or [] if not _far_and_destructive(exc.option_name, p)]
        return exc.format_message()
    found = re.match(r"No such command '([^']*)'\.", exc.format_message())
    if found is None:
        return exc.format_message()
    word = found[1]
    if word in _GIT_WORDS:
        return f"No such command '{word}': {_GIT_WORDS[word]}"
    if any(f"'{d}'" in exc.format_message() and _far_and_destructive(word, d) for d in _DESTRUCTIVE):
        return f"No such command '{word}'."
    return exc.format_message()


def _far_and_destructive(typed: str, offered: str) -> bool:
    import difflib

    return offered in _DESTRUCTIVE and difflib.SequenceMatcher(None, typed, offered).ratio() < 0.8


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
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            cli(args=argv, prog_name="ckpt", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _fail(INTERRUPTED, 130)
    except OutputError as exc:
        _output_gone(exc)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `ckpt`, `ckpt remote`: the help, as typed lines
        exc.show()
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx is not None else _typed(argv)
        hint = f" (see `{where} --help`)" if isinstance(exc, click.UsageError) else ""  # the command's own options
        _fail(_git_habit(exc) + hint, exc.exit_code)
    except Exception as exc:  # every failure reaches the user as one line; --debug shows where it came from
        if debug:
            import traceback

            traceback.print_exc()
        known = explain(exc)
        if known is None:
            _fail(f"unexpected {type(exc).__name__}: {exc}. Run again with --debug for the traceback and "
                  "please report it", 1)
        _fail(str(known), known.exit_code)
