"""Which commits a retention policy keeps: plain functions of the history, no I/O (`ckpt prune` applies them).

Candidates are the commits on some local branch's first-parent history; everything else (side
parents of merges, commits only a tag, a remote-tracking ref or a detached HEAD reaches) is kept.
A commit a ref points at is never removed (tags only with `keep_tagged`: a tag alone does not
protect its commit). A commit on several branches is kept when any branch's rules keep it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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


def first_parent_chain(tip: CommitId, parents: Mapping[CommitId, list[CommitId]]) -> list[CommitId]:
    """`tip` and its first parents down to the branch's first commit, newest first."""
    chain, seen = [], set()
    current: CommitId | None = tip
    while current is not None and current not in seen:
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
    """The commits the policy removes (none pruned already, none protected, none off every branch's chain)."""
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
    gone = candidates - kept - history.pruned
    # a metric no commit has is a misspelt name or one not logged yet: keep_best must not quietly keep nothing
    if best is not None and gone and not any(_finite(m.get(best[0])) for m in history.metrics.values()):
        raise UnknownMetricError(f"keep_best: no commit has a finite value of metric {best[0]!r}, so nothing was "
                                 "pruned; check the name against `ckpt show`'s metrics")
    return gone - unranked
