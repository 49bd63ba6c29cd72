"""`ckpt log`, `show`, `diff`, `stats`, `branch`, `tag`: reading the history and naming commits."""

from __future__ import annotations

import datetime
import math
import os
import warnings
from collections.abc import Callable, Collection, Mapping

import click

from ckptstore.cli.group import cli, open_repo
from ckptstore.cli.output import echo, emit_json, indented, size
from ckptstore.errors import CorruptRecordError, DamageListedPastError, listing, shown_name
from ckptstore.repo import listed_refs, log_graph, remove_ref, subject
from ckptstore.repo import log as listed_log
from ckptstore.repo import stats as listed_stats


@cli.command()
@click.argument("revisions", nargs=-1)
@click.option("-n", "--max-count", "limit", type=click.IntRange(min=0), help="Show the newest N commits only.")
@click.option("--graph", is_flag=True, help="Draw the history as a graph.")
@click.option("--oneline", is_flag=True, help="One line per commit: id, refs, step, subject.")
@click.option("--all", "all_refs", is_flag=True, help="Every branch and tag, not only HEAD.")
@click.option("--json", "as_json", is_flag=True, help="the commits as a JSON list")
@click.pass_context
def log(ctx, revisions, limit, graph, oneline, all_refs, as_json) -> None:
    """Show the history of HEAD, or of REVISIONS (branches, tags, commits, ranges).

    As git reads them: A..B, on B but not on A; A...B, on one of them, not both.
    """
    if (graph or oneline) and as_json:  # --graph was dropped without a word
        raise click.UsageError(f"--{'graph' if graph else 'oneline'} writes text; --json lists the commits: choose one")
    repo, damage = open_repo(ctx), {}
    if as_json:
        emit_json([dict(c.to_json(), **({"pruned": True} if c.pruned else {}))
                   for c in listed_log(repo, revisions, all_refs, limit, damage)])
    elif graph or oneline:  # both: the graph, whose lines are one a commit too (as git draws them)
        lines = log_graph(repo, revisions, all_refs, limit, lanes=graph, damage=damage)
        for line in lines or ([] if revisions else _unborn_head(repo, damage)):
            echo(line)
    else:
        _full_log(repo, listed_log(repo, revisions, all_refs, limit, damage), bool(revisions), damage)
    damage_listed_past(damage)


def _full_log(repo, commits: list, revisions: bool, damage: dict[str, str]) -> None:
    """`ckpt log`'s lines without --oneline or --graph: a header, the metrics and the message of each commit."""
    labels = repo.decorations()
    for line in [] if commits or revisions else _unborn_head(repo, damage):
        echo(line)
    for info in commits:
        deco = f" ({', '.join(labels[info.id])})" if info.id in labels else ""
        when = commit_time(info.created_at)
        lossy = f"\nLossy:  {info.lossy}" if info.lossy else ""
        lossy += "\nPruned: its tensors were removed by `ckpt prune`" if info.pruned else ""
        step = "-" if info.step is None else info.step  # as stats shows it: no Python None in text output
        echo(f"commit {info.id}{deco}\nDate:   {when}\nStep:   {step}{lossy}")
        if info.metrics:
            echo("Metrics: " + ", ".join(f"{shown_name(k)}={_metric(v)}" for k, v in info.metrics.items()))
        echo(f"\n{indented(info.message)}\n" if info.message else "")  # an empty one: no line of spaces


def _metric(value: float) -> str:
    """A metric whole: every digit (2.3456789, not 2.34568), a whole number without ".0" (tokens=1234567)."""
    negative_zero = value == 0 and math.copysign(1.0, value) < 0  # keeps its sign: -0.0
    whole = float(value).is_integer() and abs(value) < 1e16 and not negative_zero
    return str(int(value)) if whole else repr(float(value))


def damage_listed_past(damage: Mapping[str, str]) -> None:
    """One warning line per damaged record a listing went past (the rest was listed), then exit 1 so scripts notice."""
    for what, problem in damage.items():
        warnings.warn(f"the metadata of {shown_name(what)} is damaged: {problem}", RuntimeWarning, stacklevel=1)
    if damage:
        raise DamageListedPastError(len(damage))


def commit_time(seconds: float) -> str:
    """A commit's time in this machine's zone with its UTC offset, as git shows it; a time no date holds as @SECONDS.

    Without the offset two machines' logs of one shared repository disagreed unsaid; a time past
    year 9999 (a machine's clock, a remote's record) stopped the whole log.
    """
    try:
        return datetime.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return f"@{seconds}"


def _unborn_head(repo, damage: dict[str, str]) -> list[str]:
    """A line where HEAD's branch has no commits but others have (a sharded save to its own branch).

    An empty log said nothing of them. A branch naming no commit is noted in `damage`, not an error.
    """
    branch, head = repo.head()
    others = sorted(listed_refs(repo, "branch", damage))
    if head is not None or not others:
        return []
    return [f"note: HEAD's branch {branch!r} has no commits yet; {listing(others, 5)} "
            f"{'has' if len(others) == 1 else 'have'}: `ckpt log --all` lists them"]


@cli.command()
@click.argument("words", nargs=-1, metavar="[NAME [START]]")
@click.option("-d", "delete", multiple=True, help="Delete branch NAME (repeatable; with -d, every NAME is deleted).")
@click.pass_context
def branch(ctx, words, delete) -> None:
    """List branches, create NAME at START (default HEAD), or delete some with -d."""
    repo = open_repo(ctx)
    if delete:
        for gone in _to_delete([*delete, *words], _deletable(repo, "branch"), repo.delete_branch, repo.head()[0]):
            echo(_deleted("branch", gone, remove_ref(repo, gone, "branch")))
    elif words:  # "" is a (bad) name, not a request for the listing
        name, start = _name_and_target(words, "START")
        cid = repo.branch(name, start)
        echo(f"Created branch {name} at {cid[:12]}")
    else:
        damage: dict[str, str] = {}
        current, at = _head_or_damage(repo, damage)
        if current is None and at is not None:  # as git lists it: where a detached HEAD is
            echo(f"* (HEAD detached at {at[:12]})")
        for branch_name, cid in listed_refs(repo, "branch", damage).items():
            echo(f"{'*' if branch_name == current else ' '} {shown_name(branch_name)} {cid[:12]}")
        damage_listed_past(damage)


def _head_or_damage(repo, damage: dict[str, str]) -> tuple[str | None, str | None]:
    """HEAD's branch and commit; a damaged HEAD row is noted in `damage` (none starred): it hid every branch."""
    try:
        return repo.head()
    except CorruptRecordError as exc:
        damage[exc.what] = f"{exc.problem}; no branch is starred as HEAD's: check out a branch (`ckpt checkout BRANCH`)"
        return None, None


@cli.command()
@click.argument("words", nargs=-1, metavar="[NAME [REF]]")
@click.option("-d", "delete", multiple=True, help="Delete tag NAME (repeatable; with -d, every NAME is deleted).")
@click.pass_context
def tag(ctx, words, delete) -> None:
    """List tags, tag REF (default HEAD) as NAME, or delete some with -d."""
    repo = open_repo(ctx)
    if delete:
        for gone in _to_delete([*delete, *words], _deletable(repo, "tag"), repo.delete_tag, None):
            echo(_deleted("tag", gone, remove_ref(repo, gone, "tag")))
    elif words:
        name, ref = _name_and_target(words, "REF")
        echo(f"Tagged {repo.tag(name, ref)[:12]} as {name}")
    else:
        damage: dict[str, str] = {}
        for tag_name, cid in listed_refs(repo, "tag", damage).items():
            echo(f"{shown_name(tag_name)} {cid[:12]}")
        damage_listed_past(damage)


def _name_and_target(words: tuple[str, ...], target: str) -> tuple[str, str]:
    """NAME and its commit (default HEAD) from a create's words; a third word is refused, not ignored."""
    if len(words) > 2:
        raise click.UsageError(f"give NAME and at most {target}, not {len(words)} words (to delete several: -d)")
    return words[0], words[1] if len(words) > 1 else "HEAD"


def _deletable(repo, kind: str) -> set[str]:
    """The branches or tags (`kind`) -d may delete: those whose row names no commit too (deleting is the way out)."""
    damaged: dict[str, str] = {}
    return set(listed_refs(repo, kind, damaged)) | {what.removeprefix("ref ") for what in damaged}


def _deleted(kind: str, name: str, gone) -> str:
    """`Deleted branch NAME (was ID)`, as git says it; a damaged ref's line says the commit it named was not found."""
    if gone.commit_id is None:
        return f"Deleted {kind} {name} (it named no commit: its row was damaged)"
    missing = "" if gone.recorded else ", a commit not found in the metadata"
    return f"Deleted {kind} {name} (was {gone.commit_id[:12]}{missing})"


def _to_delete(names: list[str], known: Collection[str], delete: Callable[[str], object],
               current: str | None) -> list[str]:
    """The names -d deletes, each once: `ckpt branch -d a b` and `-d a -d b` delete both, as git does.

    Checked first: one that is not there (`ckpt branch new -d old`, a typo) or the branch HEAD is on
    deletes none of them; `delete` of it raises its own error (a tag, not a branch; did you mean).
    """
    names = list(dict.fromkeys(names))
    for refused in [word for word in names if word not in known or word == current][:1]:
        delete(refused)
    return names


@cli.command()
@click.argument("ref", default="HEAD")
@click.option("--json", "as_json", is_flag=True, help="the commit as JSON")
@click.pass_context
def show(ctx, ref, as_json) -> None:
    """Show one commit: metadata, files and tensors."""
    data = open_repo(ctx).show(ref)
    if as_json:
        return emit_json(data)
    echo(f"commit {data['id']}\nparents {' '.join(p[:12] for p in data['parents']) or '-'}")
    step, source = ("-" if data[key] is None else data[key] for key in ("step", "source_path"))  # as stats: "-"
    echo(f"step {step}  metrics {data['metrics']}  source {shown_name(str(source))}")
    if data.get("pruned"):  # its row stays for the history; its tensors and their bytes are gone
        echo(f"pruned by `ckpt prune`: its tensors are gone{' (it was lossy)' if data.get('lossy') else ''}")
    elif data.get("lossy"):
        echo(f"lossy commit, level {data['lossy']}; optimizer pairing: {data.get('pairing')}; "
             f"importance: {data.get('importance')}")
    stored = "- (pruned)" if data.get("pruned") else size(data["stored_bytes"])
    message = f"\n\n{indented(data['message'])}\n" if data["message"] else ""  # an empty one: no line of spaces
    echo(f"raw {size(data['raw_bytes'])}  stored {stored}{message}")
    for f in data["files"] if data["kind"] != "state" else []:  # an in-memory state's only record has no file
        echo(f"file {shown_name(f['name']) or '.'} [{f['format']}] {size(f['size'])} {f['note']}".rstrip())
    for row in data.get("fidelity", []):
        # "at most" rounds up (0.904: 91%), as far as float math lets a ratio of 0.07 stay 7%
        ceiling = None if row["worst_of_bound"] is None else f"{math.ceil(round(row['worst_of_bound'] * 100, 9))}%"
        bound = (" (no bound)" if ceiling is None
                 else f", at most {ceiling} of its bound" if row["bounded"] == row["tensors"]
                 else f"; the {row['bounded']} with a bound at most {ceiling} of it")
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
        echo(f"  {shown_name(t['path'])}  {t['dtype']} {tuple(t['shape'])}  {size(t['stored_bytes'])} "
             f"depth {t['depth']}{error}")
    return None


def _path_like(spec: str) -> bool:
    """Whether `spec` names a path, not a commit or a range: no ref begins with "./" or a slash, nor ends with one."""
    if spec in ("..", "..."):
        return False
    left, dots, right = spec.partition("..")
    return spec.startswith(("/", "./")) or bool(dots) and (
        left.endswith("/") or right.startswith("/") or os.path.exists(spec))


@cli.command()
@click.argument("a")
@click.argument("b", required=False)
@click.option("--json", "as_json", is_flag=True, help="the changes as JSON")
@click.option("--all", "show_all", is_flag=True, help="Also list unchanged tensors.")
@click.pass_context
def diff(ctx, a, b, as_json, show_all) -> None:
    """Per tensor: changed or not, relative L2 change, stored bytes in B; then the non-tensor values that differ.

    A alone may be a range, A..B.
    """
    # `ckpt diff HEAD ../x.pt` was called a range, and `ckpt diff ../x.pt` one to '/x.pt'; `..` stays HEAD..HEAD
    path = next((spec for spec in (a, b) if spec and _path_like(spec)), None)
    if path is not None and not os.path.exists(path):
        raise click.UsageError(f"{path!r} is neither a commit nor a file or folder here: `ckpt diff` compares commits")
    if path is not None:
        kind = "a folder" if os.path.isdir(path) else "a file"
        raise click.UsageError(f"{path!r} is {kind}: `ckpt diff` compares commits; commit it first (`ckpt commit "
                               f"{path}`), then diff the commits")
    ranged = next((spec for spec in (a, b) if b is not None and ".." in spec), None)  # no ref name holds ".."
    if ranged is not None:  # it was looked up as one ref: "unknown ref 'A..B'"
        raise click.UsageError(f"{ranged!r} is a range, which names both commits: give it alone (`ckpt diff A..B`) "
                               "or two commits (`ckpt diff A B`), not a range and another commit")
    if b is None and ".." not in a:  # a wrong argument: exit 2, as the range beside a commit above
        raise click.UsageError(f"diff compares two commits: give `{a} B` or `{a}..B`, not {a!r} alone")
    rows = open_repo(ctx).diff(a, b)
    if as_json:
        return emit_json([r.to_json() for r in rows])
    for row in rows:
        if row.status in ("unchanged", "uncompared") and not show_all:
            continue
        if row.is_value:
            echo(f"{row.status:>9} {shown_name(row.path)} (a non-tensor value)")
            continue
        rel = "" if row.relative_l2 is None else f" rel_l2={row.relative_l2:.3e}"
        was = f"{row.was[0]} {row.was[1]} -> " if row.was else ""
        echo(f"{row.status:>9} {shown_name(row.path)} {was}{row.dtype} {tuple(row.shape)}{rel} "
             f"stored={size(row.stored_bytes)}")
    # bytes (a blob file, a bytes value) are values; a file's own structure (a torch zip's container, a
    # safetensors header or gap) is neither
    tensors = [r for r in rows if not r.is_value and r.dtype != "bytes"]
    uncompared = sum(r.status == "uncompared" for r in rows)
    values = sum(r.status not in ("uncompared", "unchanged") and (r.is_value or r.dtype == "bytes")
                 and not r.is_structure for r in rows)
    unchanged = sum(r.status == "unchanged" for r in tensors)
    echo(f"{len(tensors) - unchanged} of {len(tensors)} tensors differ" + (f"; {values} non-tensor values differ"
                                                                         if values else "")
         + (f"; {uncompared} non-tensor values not compared: one commit is sharded, the other not (--all lists them)"
            if uncompared else ""))
    return None


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="the figures as JSON")
@click.pass_context
def stats(ctx, as_json) -> None:
    """Per commit raw bytes, newly stored bytes and ratio; totals."""
    damage: dict[str, str] = {}
    data = listed_stats(open_repo(ctx), damage)
    if as_json:
        emit_json(data)
        return damage_listed_past(damage)
    echo(f"{'commit':<12} {'step':>8} {'raw':>12} {'stored':>12} {'ratio':>8}  message")
    for row in data["commits"]:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"  # "-": nothing new stored
        stored, ratio = ("pruned", "-") if row["pruned"] else (size(row["stored_bytes"]), ratio)
        echo(f"{row['id'][:12]} {row['step'] if row['step'] is not None else '-':>8} "
             f"{size(row['raw_bytes']):>12} {stored:>12} {ratio:>8}  {subject(row['message'])}")
    kept = sum(not row["pruned"] for row in data["commits"])
    pruned = f" ({len(data['commits']) - kept} more pruned)" if kept < len(data["commits"]) else ""
    echo(f"total: {kept} commits{pruned}, {size(data['raw_bytes'])} of checkpoints in "
         f"{size(data['stored_bytes'])} on disk ({size(data['objects_bytes'])} objects, "
         f"{size(data['metadata_bytes'])} metadata), {data['ratio']:.2f}x")
    return damage_listed_past(damage)
