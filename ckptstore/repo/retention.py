"""Which commits a retention policy keeps: plain functions of the history, no I/O (`ckpt prune` applies them).

Candidates are the commits on some local branch's first-parent history; everything else (side
parents of merges, commits only a tag, a remote-tracking ref or a detached HEAD reaches) is kept.
A commit a ref points at is never removed (tags only with `keep_tagged`: a tag alone does not
protect its commit). A commit on several branches is kept when any branch's rules keep it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ckptstore.errors import UnknownMetricError
from ckptstore.hashing import CommitId
from ckptstore.repo.config import RetentionPolicy


@dataclass
class History:
    """What the rules look at: branch tips, parents, metrics, the commits refs protect, and those pruned already."""

    branches: Mapping[str, CommitId]
    parents: Mapping[CommitId, list[CommitId]]
    metrics: Mapping[CommitId, Mapping[str, float]]
    protected: set[CommitId] = field(default_factory=set)  # ref tips (and tagged commits with keep_tagged)
    pruned: set[CommitId] = field(default_factory=set)


def first_parent_chain(tip: CommitId, parents: Mapping[CommitId, list[CommitId]],
                       limit: int | None = None) -> list[CommitId]:
    """`tip` and its first parents down to the branch's first commit, newest first (the newest `limit` only)."""
    chain, seen = [], set()
    current: CommitId | None = tip
    while current is not None and current not in seen and (limit is None or len(chain) < limit):
        chain.append(current)
        seen.add(current)
        ancestors = parents.get(current) or []
        current = ancestors[0] if ancestors else None
    return chain


def kept_on_branch(chain: list[CommitId], policy: RetentionPolicy, metrics: Mapping[CommitId, Mapping[str, float]],
                   pruned: set[CommitId]) -> set[CommitId]:
    """The commits of one branch's first-parent `chain` (newest first) that the policy's rules keep.

    Positions count from the branch's first commit, so they never shift as the branch grows and
    a policy applied again keeps what it kept before; pruned commits keep their positions.
    """
    kept = set(chain[: policy.keep_last])
    if policy.keep_every:
        kept |= {cid for i, cid in enumerate(chain) if (len(chain) - 1 - i) % policy.keep_every == 0}
    best = policy.best()
    if best is not None:
        name, way = best
        scored = {cid: float(metrics[cid][name]) for cid in chain
                  if cid not in pruned and _finite(metrics.get(cid, {}).get(name))}
        if scored:
            # one commit: the oldest of those tied, which reached the value first (a Trainer's training loss
            # is carried to the saves after the step that logged it) and stays kept when later ones tie it
            target = (min if way == "min" else max)(scored.values())
            kept.add(next(cid for cid in reversed(chain) if scored.get(cid) == target))
    return kept


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def doomed(history: History, policy: RetentionPolicy) -> set[CommitId]:
    """The commits the policy removes (none pruned already, none protected, none off every branch's chain).

    Run after every commit: each commit's first-parent chain is walked once for all branches (`_ChainFacts`),
    not once per branch, which cost branches x history per commit.
    """
    facts = _ChainFacts.of(history, policy)
    if facts is None:  # a first-parent loop (forged rows): each branch walked alone, as the rules read it
        return _doomed_by_branch(history, policy)
    best = policy.best()
    kept: set[CommitId] = set(history.protected)
    unranked: set[CommitId] = set()
    for tip in history.branches.values():
        kept.update(first_parent_chain(tip, history.parents, policy.keep_last))
        if best is not None:
            if facts.best.get(tip) is not None:
                kept.add(facts.best[tip])
            elif not (policy.keep_last or policy.keep_every):
                unranked.update(facts.chain_of(tip))  # keep_best alone, nothing to rank on this branch yet
    if policy.keep_every:
        kept.update(cid for cid, depth in facts.depth.items() if depth % policy.keep_every == 0)
    return _checked_gone(set(facts.depth) - kept - history.pruned, history, best) - unranked


@dataclass
class _ChainFacts:
    """Per commit on some branch's first-parent chain: its position from the first commit, and its chain's best.

    A commit's chain below it is the same whichever branch reaches it, so both are worked out once
    per commit, the shared part of the branches' chains once for all of them.
    """

    depth: dict[CommitId, int]
    best: dict[CommitId, CommitId | None]  # the oldest commit scoring the chain's best value, up to this one
    parents: Mapping[CommitId, list[CommitId]]

    @classmethod
    def of(cls, history: History, policy: RetentionPolicy) -> _ChainFacts | None:
        """The facts of every commit the branches' chains hold; None where a chain loops."""
        facts = cls({}, {}, history.parents)
        score = _scorer(history, policy)
        for tip in history.branches.values():
            path, current, longest = [], tip, len(history.parents) + 1  # longer than that: it came round again
            while current is not None and current not in facts.depth:
                if len(path) > longest:
                    return None
                path.append(current)
                ancestors = history.parents.get(current) or []
                current = ancestors[0] if ancestors else None
            start = -1 if current is None else facts.depth[current]
            facts.depth.update(zip(path, range(start + len(path), start, -1)))  # the tip is the deepest
            if score is not None:
                below = None if current is None else facts.best[current]
                for cid in reversed(path):
                    facts.best[cid] = below = _better(cid, below, score)
        return facts

    def chain_of(self, tip: CommitId) -> list[CommitId]:
        return first_parent_chain(tip, self.parents)


def _scorer(history: History, policy: RetentionPolicy) -> Callable[[CommitId], float | None] | None:
    """A commit's keep_best score, made comparable the larger the better (None where it has none); None: no rule."""
    best = policy.best()
    if best is None:
        return None
    name, way = best

    def score(cid: CommitId) -> float | None:
        value = history.metrics.get(cid, {}).get(name)
        if cid in history.pruned or not _finite(value):
            return None
        return -float(value) if way == "min" else float(value)

    return score


def _better(cid: CommitId, best_below: CommitId | None, score: Callable[[CommitId], float | None]) -> CommitId | None:
    """`cid` where it scores strictly better than the best below it (the older one keeps a tie), else that one."""
    own = score(cid)
    if own is None:
        return best_below
    if best_below is None:
        return cid
    below = score(best_below)
    return cid if below is None or own > below else best_below


def _doomed_by_branch(history: History, policy: RetentionPolicy) -> set[CommitId]:
    """`doomed`'s rules applied to each branch's chain walked alone (a chain that loops ends where it does)."""
    candidates: set[CommitId] = set()
    kept: set[CommitId] = set(history.protected)
    unranked: set[CommitId] = set()
    best = policy.best()
    for tip in history.branches.values():
        chain = first_parent_chain(tip, history.parents)
        candidates.update(chain)
        kept |= kept_on_branch(chain, policy, history.metrics, history.pruned)
        if best is not None and not (policy.keep_last or policy.keep_every) and not any(
                _finite(history.metrics.get(cid, {}).get(best[0])) for cid in chain if cid not in history.pruned):
            unranked.update(chain)  # keep_best alone, and nothing to rank on this branch yet: none of it goes
    return _checked_gone(candidates - kept - history.pruned, history, best) - unranked


def _checked_gone(gone: set[CommitId], history: History, best: tuple[str, str] | None) -> set[CommitId]:
    """`gone`, unless keep_best names a metric no commit has (misspelt, or not logged yet): then an error."""
    # keep_best must not quietly keep nothing
    if best is not None and gone and not any(_finite(m.get(best[0])) for m in history.metrics.values()):
        raise UnknownMetricError(f"keep_best: no commit has a finite value of metric {best[0]!r}, so nothing was "
                                 "pruned; check the name against `ckpt show`'s metrics")
    return gone
