"""`ckpt gc`, `prune`, `fsck`: keeping the store small and checking it."""

from __future__ import annotations

import click

from ckptstore.cli.group import cli, open_repo, remote_verbs
from ckptstore.cli.output import echo, emit_json, size
from ckptstore.errors import shown_name
from ckptstore.repo import fsck, gc


@cli.command("gc")
@click.option("--prune", is_flag=True, help="Also delete commits no branch, tag or HEAD reaches.")
@click.pass_context
def gc_command(ctx, prune) -> None:
    """Remove objects no commit needs (and leftovers of interrupted commits)."""
    repo = open_repo(ctx)
    report = gc(repo, prune_unreachable=prune)  # a wait for the lock says so 2 s in, naming its holders
    echo(f"removed {report.objects_removed} objects ({size(report.bytes_removed)}), "
         f"{report.tensors_removed} tensor records, {report.commits_removed} commits, "
         f"{report.temp_files_removed} temp files")


@cli.command("prune")
@click.option("--keep-last", type=click.IntRange(min=0), default=0, help="Keep each branch's N newest commits.")
@click.option("--keep-every", type=click.IntRange(min=0), default=0,
              help="Keep every K-th commit of each branch, counted from its first commit.")
@click.option("--keep-best", default="", metavar="METRIC[:min|max]", help="Keep each branch's best commit by METRIC.")
@click.option("--keep-tagged", is_flag=True, help="Keep tagged commits.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="the report (commits removed, tensors re-encoded) as JSON")
@click.pass_context
def prune_command(ctx, keep_last, keep_every, keep_best, keep_tagged, dry_run, as_json) -> None:
    """Remove the commits a retention policy does not keep (default: [retention] in config.toml); free their space."""
    from ckptstore.repo import RetentionPolicy, prune

    given = RetentionPolicy(keep_last, keep_every, keep_best, keep_tagged)
    repo = open_repo(ctx)
    report = prune(repo, given if given.active else None, dry_run=dry_run)  # a wait says so as gc's does
    if as_json:
        return emit_json(vars(report))
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
        echo(f"objects held here: {size(report.bytes_before)} before, {size(report.bytes_after)} after "
             + (f"({size(change)} freed)" if change >= 0 else f"({size(-change)} more: the survivors re-encoded"
                                                                f"{', read from the origin' if lazy else ''})"))
    return None


@cli.command("fsck")
@click.option("--full", is_flag=True, help="Also decode every tensor and check it against its id.")
@click.option("--remote", "remote_name", help="Check remote NAME instead of this repository.")
@click.pass_context
def fsck_command(ctx, full, remote_name) -> None:
    """Verify every stored object; list damaged objects and the commits they break."""
    repo = open_repo(ctx)  # an empty --remote is a name like any other: no remote has it
    report = remote_verbs().fsck_remote(repo, remote_name, full) if remote_name is not None else fsck(repo, full=full)
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
    for oid, path in report.unreadable.items():
        echo(f"unreadable object {oid}: permission denied on {shown_name(path)}; ask for access, or run fsck as a "
             "user who may read it")
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
        where = "`ckpt gc` there" if remote_name is not None else "`ckpt gc`"  # a local gc leaves the remote's
        echo(f"{report.unreferenced_objects} unreferenced objects (run {where} to remove them; an interrupted push "
             "or commit leaves them, and running it again uses them)")
    if not report.ok:
        raise SystemExit(1)
    echo("ok")
