"""`ckpt init`, `commit`, `checkout`, `watch`, `export`, `status`: the commands of the working folder."""

from __future__ import annotations

import signal
from typing import Any

import click

from ckptstore.cli.group import cli, open_repo, repo_given
from ckptstore.cli.output import BarProgress, echo, read_after_work, size
from ckptstore.cli.params import (
    LEVEL_NAMES,
    PathGiven,
    Seconds,
    TextGiven,
    given_once,
    knob_values,
    max_chain_value,
    metric_values,
    percentage,
)
from ckptstore.errors import ConflictError, OutputError, ReadOnlyRepoError, RetentionError, listing, shown_name
from ckptstore.repo import EncodingSettings, Repository, subject


@cli.command()
@click.argument("path", required=False, type=PathGiven(file_okay=False))
@click.option("--max-chain", metavar="N|auto", callback=max_chain_value,
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
    where = path or repo_given(ctx) or "."
    with Repository.init(where, encoding=settings, lossy=lossy or "", objects_url=objects_url,
                         metadata_url=metadata_url) as repo:
        joined = repo.joined  # a teammate's repository without commits yet too
        echo(f"{'Joined the' if joined else 'Initialized empty'} ckptstore repository in "
             f"{shown_name(str(repo.dir))}"  # a folder's newline or bytes not UTF-8, as every name prints
             + (f" (objects in {shown_name(repo.store.url)})" if objects_url else "")
             + (f" (metadata in {shown_name(str(repo.db.where))})" if metadata_url else "")
             + (f" (commits are lossy: {lossy})" if lossy and lossy != "none" else ""))


@cli.command()
@click.argument("path", type=PathGiven())
@click.option("-m", "--message", "messages", multiple=True, help="Commit message (given twice or more: paragraphs).")
@click.option("--step", type=click.IntRange(-(1 << 63), (1 << 63) - 1), multiple=True, callback=given_once,
              help="Training step of this checkpoint.")
@click.option("--metric", "metrics", multiple=True, help="KEY=NUMBER, repeatable.")
@click.option("--branch", type=TextGiven("a branch name"), multiple=True, callback=given_once,
              help="Commit to this branch (created at HEAD if new); HEAD stays.")
@click.option("--allow-empty", is_flag=True, help="Record a commit even if nothing changed.")
@click.option("--trust-pickle", is_flag=True, help="Unpickle arbitrary objects in PATH (only for files you trust).")
@click.option("--lossy", type=click.Choice([*LEVEL_NAMES, "none"]), multiple=True, callback=given_once,
              help="Lossy level (default: the repository's, normally lossless).")
@click.option("--knob", "knobs", multiple=True, help="Override one setting of the lossy level, NAME=VALUE.")
@click.option("--calibration", multiple=True, callback=given_once,
              help="MODULE:FUNCTION (or file.py:FUNCTION) returning the loss of a restored checkpoint's state; the "
                   "lossy commit keeps its change within --max-loss-change.")
@click.option("--max-loss-change", multiple=True, callback=given_once,
              help="Largest relative loss change on the calibration data, e.g. 0.1% (default: the level's promise).")
@click.pass_context
def commit(ctx, path, messages, step, metrics, branch, allow_empty, trust_pickle, lossy, knobs, calibration,
           max_loss_change) -> None:
    """Store the checkpoint at PATH (torch.save file, safetensors file, Trainer folder or DCP directory)."""
    from ckptstore.repo import function_named  # only here: it loads the encoding layers

    message = "\n\n".join(messages)  # as git joins -m's: the second one kept the first out of the commit
    repo = open_repo(ctx)
    knob_settings, loss_change = knob_values(knobs), percentage(max_loss_change)  # a typo in them is named first
    _lossy_options_apply(lossy, repo.config.lossy, knob_settings, calibration, loss_change)
    try:
        cid = repo.commit(path, message=message, step=step, metrics=metric_values(metrics), branch=branch,
                          allow_empty=allow_empty, trust_pickle=trust_pickle, progress=BarProgress(),
                          lossy=lossy, calibration=function_named(calibration) if calibration is not None else None,
                          max_loss_change=loss_change, knobs=knob_settings)
    except RetentionError as exc:  # recorded: a script reading the id from stdout gets it, then the error
        _say_committed(repo, exc.commit_id, message, branch)
        raise
    _say_committed(repo, cid, message, branch)


def _lossy_options_apply(lossy: str | None, default: str, knobs: dict[str, Any], calibration: str | None,
                         max_loss_change: float | None) -> None:
    """Refuse as usage errors (exit 2, before anything is read or written) lossy options with nothing to act on.

    Without --lossy the repository's `default` level decides whether a knob applies: known once it is open.
    """
    if max_loss_change is not None and calibration is None:
        raise click.UsageError("--max-loss-change bounds the loss that --calibration measures: give --calibration "
                               "MODULE:FUNCTION too")
    given = [name for name, value in (("--knob", knobs), ("--max-loss-change", max_loss_change is not None))
             if value]
    if given and (default if lossy is None else lossy) in ("", "none", "lossless"):
        why = "--lossy none" if lossy is not None else "the repository's default level"
        raise click.UsageError(f"{' and '.join(given)} {'tune' if len(given) > 1 else 'tunes'} a lossy level, and "
                               f"this commit is lossless ({why}): give --lossy LEVEL")


def _say_committed(repo: Repository, cid: str, message: str | None, branch: str | None) -> None:
    """Print a recorded commit's summary (id, level, subject, sizes) and whether it is on no branch.

    The commit is recorded: a database that stops answering now (a server gone) costs the sizes
    and the note, never the id, nor an error that would say the commit failed; a stdout that
    refuses the summary (full, closed, its reader gone) gets the id said on stderr instead.
    """
    try:
        for line in _committed_lines(repo, cid, message, branch):
            echo(line)
    except OutputError as exc:  # read as "commit failed", a retry found nothing changed and the id was lost
        raise OutputError(exc.cause, recorded=f"commit {cid}") from None


def _committed_lines(repo: Repository, cid: str, message: str | None, branch: str | None) -> list[str]:
    """The lines of `_say_committed`: with the sizes and the note where the database still answers."""
    try:
        info = repo.commit_info(cid)
        detached = branch is None and repo.head()[0] is None
    except Exception:  # noqa: BLE001 - whatever the database says, what matters was recorded
        return [f"[{cid[:12]}] {subject(message)}  (its sizes could not be read)"]
    mode = f" lossy:{info.lossy}" if info.lossy else ""
    title = f" {subject(info.message)}" if info.message else ""  # as recorded (cleaned); none: no stray spaces
    lines = [f"[{cid[:12]}]{mode}{title}  ({size(info.raw_bytes)} -> {size(info.stored_bytes)} new)"]
    if detached:
        lines.append(f"note: HEAD is detached, so this commit is on no branch; to keep it: ckpt branch NAME "
                     f"{cid[:12]}")
    return lines


@cli.command()
@click.argument("ref")
@click.option("-o", "--output", type=PathGiven(), help="Write the checkpoint here; HEAD does not move.")
@click.option("--force", is_flag=True, help="Overwrite files whose content is not in the store.")
@click.option("--only", "only", type=TextGiven("a pattern such as 'model.*'"), multiple=True, metavar="PATTERN",
              help="Write only the values whose paths match (glob, e.g. 'model.*'; repeatable; needs -o).")
@click.option("--trust-pickle", is_flag=True,
              help="Write a sharded commit's pickled non-tensor items as stored (committed with --trust-pickle).")
@click.pass_context
def checkout(ctx, ref, output, force, only, trust_pickle) -> None:
    """Restore the checkpoint at REF and move HEAD to it.

    A lossless commit's files come back byte for byte, but for a legacy-format or unusual torch.save file,
    which is written again with torch.save (the checkout names it).
    """
    if only and output is None:  # a wrong pairing of options: exit 2, as a wrong option is
        raise click.UsageError("--only writes part of a commit, so it needs -o PATH (it never overwrites the files "
                               "the commit came from)")
    repo = open_repo(ctx)
    # the commit checkout_to resolved (a commit landing on the branch meanwhile is not it), and its rewritten files
    # from the manifest read then: a retention prune in another process may remove the commit once it is written
    resolved: list = []
    dest = repo.checkout_to(ref, output, force=force, progress=BarProgress(), keys=list(only) or None,
                            trust_pickle=trust_pickle, on_resolved=lambda *pair: resolved.extend(pair))
    info, manifest = resolved
    rewritten = None if only or info.source_path is None else manifest.rewritten_files()
    if output is None and info.sharded:
        echo(f"HEAD is now at {info.id[:12]}, a sharded (DCP) commit: nothing is written in place; write it as a "
             f"DCP directory with `ckpt checkout {info.id[:12]} -o DIR`, or load it with CkptStorageReader")
        return
    if only:
        echo(f"Wrote the part of {info.id[:12]} matching {', '.join(map(shown_name, only))} to "
             f"{shown_name(str(dest))}; HEAD did not move")
    else:  # the path a commit recorded (a remote's too) may hold a newline: written out, it cannot forge a line
        echo(f"Restored {info.id[:12]} to {shown_name(str(dest))}")
    # not as the checkout's failure: it is done
    detached = output is None and read_after_work(
        lambda: repo.head()[0] is None, "the checkout", "whether HEAD is detached",
        "`ckpt status` says so once the metadata answers")
    if detached:  # a tag or an id: said as git says it
        echo(f"HEAD is detached at {info.id[:12]}: `ckpt branch NAME` keeps what you commit from here on a branch")
    if info.source_path is not None and not info.lossy and not only and rewritten is not None:
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
@click.option("--interval", type=Seconds(min_open=True), default=10.0, show_default=True,
              help="Seconds between scans; a checkpoint is committed once unchanged across two.")
@click.option("--branch", type=TextGiven("a branch name"), multiple=True, callback=given_once,
              help="Commit to this branch (created at HEAD if new); HEAD stays.")
@click.option("--lossy", type=click.Choice([*LEVEL_NAMES, "none"]), help="Lossy level of the commits.")
@click.option("--once", is_flag=True, help="Scan twice, --interval apart, commit what is complete, and exit.")
@click.pass_context
def watch(ctx, folder, interval, branch, lossy, once) -> None:
    """Commit checkpoint files and checkpoint-N folders appearing in FOLDER, each once complete (Ctrl-C stops)."""
    import threading

    from ckptstore.repo import WatchOptions, watch_folder

    stop, stopped_by = threading.Event(), []
    # finish the commit in progress; a second signal, of any of these, interrupts it. SIGTERM (systemd, scancel)
    # and SIGHUP stop it too, unless ignored (nohup)
    named = ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP"))
    stopping = {signum: name for signum, name in named if signal.getsignal(signum) != signal.SIG_IGN}

    def on_interrupt(signum, frame) -> None:
        stop.set()
        stopped_by.append(stopping[signum])
        for each, handler in previous.items():
            signal.signal(each, handler)

    previous = {signum: signal.signal(signum, on_interrupt) for signum in stopping}
    try:
        report = watch_folder(open_repo(ctx), folder, WatchOptions(interval, branch, lossy, once), stop, echo)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for name, why in sorted(report.waiting.items()):
        echo(f"waiting: {name}: {why}")  # shown names already (watch.py)
    how = f"stopped on {stopped_by[0] if stopped_by else 'Ctrl-C'}" if report.stopped else "done"
    echo(f"{how}: {len(report.committed)} checkpoint(s) committed")
    if once and report.conflicted:  # a scan to come would have tried them again: --once has none
        raise ConflictError(f"{', '.join(report.conflicted)}: not committed, another writer moved the branch "
                            "meanwhile; run `ckpt watch --once` again to commit them on top")


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
    report = export(open_repo(ctx), ref, fmt, output, everything)
    echo(f"Wrote {report.commit[:12]} to {shown_name(output)}: {report.tensors} tensors ({fmt})")
    if report.lossy:  # as checkout says it
        echo(f"note: {report.commit[:12]} is a lossy commit (level {report.lossy}): its tensors are close to, not "
             "equal to, the originals; `ckpt show` lists each tensor's error")
    if report.skipped:
        count = len(report.skipped)
        names = listing([shown_name(name) for name in report.skipped], 5)
        echo(f"note: left out {count} item{'s' if count != 1 else ''} ({names}): {report.why_skipped}")


@cli.command()
@click.pass_context
def status(ctx) -> None:
    """Where HEAD is, and whether the checkpoint files still match it."""
    report = open_repo(ctx).status()
    where = f"On branch {report['branch']}" if report["branch"] else "HEAD detached"
    echo(where + (f" at {report['head'][:12]}" if report["head"] else " (no commits yet)"))
    for item in report["files"]:
        note = f" ({item['note']})" if item.get("note") else ""
        echo(f"  {item['state']:>10}: {shown_name(item['path'])}{note}")
