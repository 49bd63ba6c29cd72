"""History verbs: `log` (and `--graph`), ref decorations, `show` and `stats`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CorruptRecordError, RefNotFoundError, shown_name
from ckptstore.hashing import CommitId
from ckptstore.metadata import commits as commit_rows
from ckptstore.metadata import liveness
from ckptstore.metadata import refs as ref_rows
from ckptstore.metadata.commits import CommitInfo
from ckptstore.metadata.liveness import reached
from ckptstore.repo import graph, refs

if TYPE_CHECKING:
    from ckptstore.metadata import Tx
    from ckptstore.repo.manifest import Manifest
    from ckptstore.repo.repository import Repository


def log(repo: Repository, ref: str | Sequence[str] | None = None, all_refs: bool = False,
        limit: int | None = None, damage: dict[str, str] | None = None) -> list[CommitInfo]:
    """Commits reachable from `ref` (default HEAD; one ref or several) or from every ref, newest first.

    A ref may be a range as git reads one: `A..B`, the commits B leads to that A does not, or `A...B`,
    those one of them leads to and not both. `limit`: the newest that many only. A damaged ref or commit
    row is CorruptRecordError; where `damage` is given, it is noted there (what, then the problem and what to
    do) and the rest is listed: one damaged branch hid the whole history of `ckpt log --all` and `ckpt stats`.
    """
    specs = [ref] if isinstance(ref, str) else list(ref or [])
    tolerant, noted, unparsed = damage is not None, {}, {}
    with repo.db.read() as tx:
        history = commit_rows.all_commits(tx, unparsed if tolerant else None)
        tips, hiding = _revisions(tx, specs)
        if all_refs:
            tips += _ref_tips(tx, history, noted if tolerant else None)
        elif not specs:
            try:
                tips = [refs.resolve(tx, refs.HEAD)]
            except RefNotFoundError:
                tips = []
    parents = {c: i.parents for c, i in history.items()}
    order = graph.topo_order(tips, parents, lambda c: history[c].created_at if c in history else 0.0)
    reaches = [[reached([t], parents) for t in group] for group in hiding]
    # a ref or a parent names it: damage for fsck to list, not a KeyError; nor, on a range's hiding side,
    # a walk cut short that would list the commits it hides (so that is refused even where `damage` is given)
    lost = [c for c in order if c not in history]
    hiding_lost = next((c for c in itertools.chain(*itertools.chain(*reaches)) if c not in history), None)
    if hiding_lost is not None or (lost and not tolerant):
        raise CorruptRecordError(f"commit {lost[0] if lost else hiding_lost}", "a ref or a commit names it, but it "
                                 "has no record")
    for cid in lost:
        noted.setdefault(f"commit {cid}", f"a ref or a commit names it, but it has no record; the history behind it "
                                          f"was left out: {refs.RESTORE_METADATA}")
    hidden = set().union(*(set.intersection(*group) for group in reaches))
    listed = [history[c] for c in order if c not in hidden and c in history][:limit]
    if damage is not None:  # a commit row that does not parse is warned of where it is listed, not elsewhere
        damage.update({**_unparsed_damage(unparsed, [c.id for c in listed]), **noted})
    return listed


def _unparsed_damage(unparsed: dict[str, str], listed: list[CommitId]) -> dict[str, str]:
    """The damage of the commits in `listed` whose rows `all_commits` noted as not parsing (read without it)."""
    return {f"commit {cid}": f"{unparsed[f'commit {cid}']}; it is listed without that value: {refs.RESTORE_METADATA}"
            for cid in listed if f"commit {cid}" in unparsed}


def _ref_tips(tx: Tx, history: dict[CommitId, CommitInfo], damage: dict[str, str] | None) -> list[CommitId]:
    """The commits every ref names (`log --all`), HEAD's too.

    With `damage`, a ref naming no commit, or one that has no record, is noted there with what to do, and left out.
    """
    if damage is None:
        head = refs.head_commit(tx)
        return ref_rows.tip_commits(tx) + ([head] if head else [])
    tips = []
    for name, kind, cid, target in liveness.all_refs(tx):
        if kind == refs.HEAD_KIND and target and not cid:  # on a branch: that branch's row is read as one
            continue
        if cid in history:
            tips.append(cid)
        elif kind in (refs.BRANCH, refs.TAG, refs.HEAD_KIND, ref_rows.REMOTE):
            damage[f"ref {name}"] = refs.damage_of(name, kind, cid)
    return tips


def _revisions(tx: Tx, specs: Sequence[str]) -> tuple[list[CommitId], list[list[CommitId]]]:
    """The commits `specs` start from and, per range, the commits whose shared history it hides (A..B: [A])."""
    tips: list[CommitId] = []
    hiding: list[list[CommitId]] = []
    for spec in specs:
        split = refs.split_range(spec) if isinstance(spec, str) else None
        if split is None:
            tips.append(refs.resolve(tx, spec))
            continue
        a, b = refs.resolve(tx, split[0]), refs.resolve(tx, split[1])
        tips += [a, b] if split[2] else [b]
        hiding.append([a, b] if split[2] else [a])
    return tips, hiding


def decorations(repo: Repository) -> dict[CommitId, list[str]]:
    """Ref names by commit, with `HEAD -> branch` like git.

    Names are shown escaped: a row another client of a shared database wrote may hold a newline.
    """
    labels: dict[CommitId, list[str]] = {}
    with repo.db.read() as tx:
        try:
            branch, head = refs.head_branch(tx), refs.head_commit(tx)
        except CorruptRecordError:  # a damaged HEAD row (a listing warns of it): the other refs keep their labels
            branch, head = None, None
        damaged: list[str] = []  # fsck names them; a log of other refs goes on without their labels
        branches, tags = ref_rows.refs_of_kind(tx, refs.BRANCH, damaged), ref_rows.refs_of_kind(tx, refs.TAG, damaged)
        tracking = ref_rows.refs_of_kind(tx, ref_rows.REMOTE, damaged)
    for name, cid in branches.items():
        labels.setdefault(cid, []).append(f"HEAD -> {shown_name(name)}" if name == branch else shown_name(name))
    for name, cid in tracking.items():
        labels.setdefault(cid, []).append(shown_name(name.removeprefix("remotes/")))
    for name, cid in tags.items():
        labels.setdefault(cid, []).append(f"tag: {shown_name(name)}")
    if branch is None and head:
        labels.setdefault(head, []).insert(0, "HEAD")
    return labels


def subject(message: str) -> str:
    """A commit message's first line: what one-line-per-commit views (log --graph, stats) show, as git's do."""
    return next(iter(message.splitlines()), "")


def log_graph(repo: Repository, ref: str | Sequence[str] | None = None, all_refs: bool = False,
              limit: int | None = None, lanes: bool = True, damage: dict[str, str] | None = None) -> list[str]:
    """`log --graph` lines, of the commits `log` lists (lanes end where a range or the limit leaves a parent out).

    Without `lanes`, `log --oneline`'s: the same line per commit, without the graph. `damage`: as `log`'s.
    """
    if not isinstance(all_refs, bool):  # Repository.log_graph's first argument: log_graph("side") listed them all
        raise TypeError(f"log_graph's all_refs is True or False, not {all_refs!r}: name the ref with ref=")
    history = log(repo, ref, all_refs, limit, damage)
    labels = decorations(repo)
    by_id = {c.id: c for c in history}

    def describe(cid: str) -> str:
        info = by_id[cid]
        deco = f" ({', '.join(labels[cid])})" if cid in labels else ""
        step = f" step={info.step}" if info.step is not None else ""
        lossy = f" [lossy:{info.lossy}]" if info.lossy else ""
        pruned = " [pruned]" if info.pruned else ""
        return f"{cid[:12]}{deco}{step}{lossy}{pruned} {subject(info.message)}".rstrip()

    if not lanes:
        return [describe(c.id) for c in history]
    return graph.render([c.id for c in history], {c.id: [p for p in c.parents if p in by_id] for c in history},
                        describe)


def show(repo: Repository, ref: str = "HEAD") -> dict[str, Any]:
    """A commit's metadata and its files and tensors."""
    from ckptstore.repo.integrity import entry_records  # numpy: only for show

    info = repo.commit_info(ref)
    if info.pruned:  # its record stays, its files and tensors are gone
        return dict(info.to_json(), pruned=True, files=[], tensors=[])
    manifest = repo.read_manifest(info.manifest_object)
    records = entry_records(repo, manifest)
    tensors = []
    for path, entry in manifest.entries.items():
        record = records[entry.tensor]
        row = {"path": path, "dtype": entry.dtype, "shape": list(entry.shape), "tensor": entry.tensor,
               "stored_bytes": record.stored_bytes, "depth": record.depth, "codec": record.codec}
        for key in ("rel_error", "max_error", "measured_as"):  # measured_as: its lossy codec, before a prune
            if key in record.params:
                row[key] = record.params[key]
        if path in manifest.measured:  # restores as a record of an earlier commit: this commit's own figures
            row.update(rel_error=manifest.measured[path][0], max_error=manifest.measured[path][1])
            if len(manifest.measured[path]) > 2:  # and the codec it was measured with (that record's may be exact)
                row["measured_as"] = manifest.measured[path][2]
            row = {k: v for k, v in row.items() if v is not None}
        tensors.append(row)
    files = [{"name": f.name, "format": f.format, "size": f.size, "note": f.opaque_reason} for f in manifest.files]
    extra = ({"pairing": manifest.pairing, "importance": _importance(manifest), "fidelity": fidelity(tensors)}
             if manifest.lossy else {})
    if manifest.dcp is not None:  # its entries are shards: also list the logical tensors they make up
        from ckptstore.repo.sharded import logical_tensors

        extra["sharded"] = logical_tensors(manifest.dcp)
    return dict(info.to_json(), files=files, tensors=tensors, **extra)


# What each lossy codec's measured error is of (policy/fidelity.py), as `show` names it.
MEASURED = {"deadzone": "weights (and SGD momentum): ||W'-W||/||W||",
            "normmoment": "Adam updates: ||u'-u||/||u||, u = m/sqrt(v)",
            "log2moment": "Adam second moments: ||v'-v||/||v||"}


def _importance(manifest: Manifest) -> str:
    """How a lossy commit judged its weights' sensitivity: measured, estimated from Adam's v, or not at all."""
    from ckptstore.policy.mapping import NO_OPTIMIZER_STATE  # numpy (through state): only for show, not log

    if manifest.importance:
        return manifest.importance
    if manifest.pairing == NO_OPTIMIZER_STATE:
        return "none: no optimizer state"
    return "estimated from the optimizer state"


def fidelity(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of quantized tensor: how many, the worst measured relative error, and the worst share of its bound."""
    rows = []
    for codec, quantity in MEASURED.items():
        measured = [t for t in tensors if t.get("measured_as", t["codec"]) == codec and "rel_error" in t]
        if not measured:
            continue
        bounded = [t["rel_error"] / t["max_error"] for t in measured if t.get("max_error")]
        rows.append({"quantity": quantity, "tensors": len(measured), "bounded": len(bounded),
                     "worst": max(t["rel_error"] for t in measured),
                     "worst_of_bound": max(bounded) if bounded else None})
    return rows


def _history_order(every: dict[CommitId, CommitInfo]) -> list[CommitId]:
    """Every commit, children before parents: by history, not by clocks (a clock set back, another ahead)."""
    return graph.topo_order(list(every), {cid: [p for p in info.parents if p in every] for cid, info in every.items()},
                            lambda cid: every[cid].created_at)


def stats(repo: Repository, damage: dict[str, str] | None = None) -> dict[str, Any]:
    """Per commit raw and newly stored bytes, and totals against what is on disk (objects and metadata).

    `damage`: as `log`'s, damaged refs and commit rows noted there, the rest counted (not one error for all).
    """
    reachable, unparsed = log(repo, all_refs=True, damage=damage), {}
    with repo.db.read() as tx:
        every = commit_rows.all_commits(tx, None if damage is None else unparsed)
    if damage is not None:  # every commit is listed, those no ref reaches too
        damage.update(_unparsed_damage(unparsed, list(every)))
    # a pruned commit's row stays for the history; its checkpoint is gone, so the totals leave it out
    rows = [{"id": c.id, "step": c.step, "message": c.message, "raw_bytes": c.raw_bytes,
             "stored_bytes": c.stored_bytes, "pruned": c.pruned,
             "ratio": c.raw_bytes / c.stored_bytes if c.stored_bytes else None}  # None: it stored nothing new
            for c in (every[cid] for cid in reversed(_history_order(every)))]
    objects = sum(size for _, size in repo.store.iter_sizes())
    metadata = repo.db.size_on_disk()
    raw, stored = sum(r["raw_bytes"] for r in rows if not r["pruned"]), objects + metadata
    return {"commits": rows, "reachable_commits": sum(not c.pruned for c in reachable), "raw_bytes": raw,
            "stored_bytes": stored, "objects_bytes": objects, "metadata_bytes": metadata, "ratio": raw / max(stored, 1)}
