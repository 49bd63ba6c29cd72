"""Lossy plans for a sharded (DCP) commit: every rank plans its shards with the whole tensors' facts.

A rank holds only shards, but a tensor's plan depends on statistics of the whole tensor (its RMS
sets the step, the mean of its second moment its Fisher factor, its element count whether it is
quantized at all) and on facts across tensors (Fisher factors are relative to all weights, the
smallest moment quantized to the whole optimizer state). Each rank sums its shards
(`ShardStats`, sent in its local save plan); the coordinator combines every rank's sums into
`ShardFacts` (sent back in the global plan), and each rank then runs the ordinary role planners
over its own shards with those facts. The plan of a shard is thus the plan its whole tensor would
get, at any world size. RMS and mean are rounded to float32 so that the sums' different order at
different world sizes (float64 rounding, ~1e-16) does not change a step.

Weights pair with their optimizer state by fully qualified name, as `get_state_dict` flattens it:
`PREFIX.state.PARAM.exp_avg` belongs to the weight whose name is or ends with `.PARAM`, and
`PREFIX.param_groups` gives each PARAM its learning rate. A moment's shard pairs with the weight's
shard of the same offsets and sizes (FSDP2 shards a parameter and its moments alike).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckptstore.codecs.floats import LOSSY_DTYPES
from ckptstore.policy import fidelity
from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossless import EncodingSettings
from ckptstore.policy.lossy import LossyPlan, Role, eligible, plan_context
from ckptstore.policy.lossy_context import PlanContext, RmsCache, moment_min_of_sizes
from ckptstore.policy.mapping import ADAM_EXTRAS, NO_OPTIMIZER_STATE, OptimizerMap, ParamSlots
from ckptstore.policy.sensitivity import step_factors
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
AMSGRAD_MAX = "max_exp_avg_sq"  # with it, Adam's moments stay exact (policy/lossy_roles.py)
# other torch optimizers' state (RMSprop's, amsgrad's): with no optimizer known, a `.state.` name ending in one
# of these or a moment is optimizer state (state_names)
OTHER_STATE = (AMSGRAD_MAX, "square_avg", "grad_avg", "sum", "exp_inf", "acc_delta", "mu_product", "eta", "mu", "ax",
               "prev", "step_size", "row_var", "col_var", "variance")
PAIRING = "by fully qualified name (DCP's flattened optimizer state)"
_PARAM_GROUPS = re.compile(r"^(?:(.*)\.)?param_groups(?:\..*)?$")
_NO_DATA = np.empty(0, dtype=np.uint8)


@dataclass(frozen=True)
class Shard:
    """Where one stored shard sits in its logical tensor."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass
class ShardStats:
    """One shard's sums, a rank's contribution to its tensor's statistics (plain data, JSON-able)."""

    sum_sq: float
    total: float
    count: int
    sample: dict[int, float] = field(default_factory=dict)  # its entries at the whole tensor's sample positions


@dataclass
class ShardFacts:
    """What every rank needs to plan its shards as whole tensors, computed once by the coordinator.

    `rms`, `mean` and `median` are per float tensor (by FQN), `elements` its global element count, `slots`
    each weight's optimizer state by role, `lrs` each weight's learning rate, `sensitivity` its
    Fisher step factor; `moment_min` and `shared_lr` as in PlanContext; `state` every optimizer
    state tensor.
    """

    rms: dict[str, float] = field(default_factory=dict)
    mean: dict[str, float] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    slots: dict[str, dict[str, str]] = field(default_factory=dict)
    lrs: dict[str, float] = field(default_factory=dict)
    sensitivity: dict[str, float] = field(default_factory=dict)
    moment_min: int = 0
    shared_lr: float | None = None
    state: list[str] = field(default_factory=list)  # every optimizer state tensor's FQN, paired or not
    median: dict[str, float] = field(default_factory=dict)  # bulk median per float tensor (PlanContext.bulk_median)
    # tensors some of whose shards the parent lacks (the layout changed): every shard a keyframe, as one tensor's
    keyframed: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardFacts:
        return cls(**data)


def pair_by_fqn(fqns: Iterable[str], param_lrs: Mapping[str, float], state: Iterable[str] | None = None
                ) -> tuple[dict[str, dict[str, str]], dict[str, float]]:
    """(weight FQN -> {role: state FQN}, weight FQN -> lr) for the optimizer state among `fqns`.

    `state`: the optimizer state among them (`state_names`; default: told by its roles' names).
    `param_lrs` maps PREFIX.state's PARAM names to their group's learning rate (from param_groups).
    A state whose weight no other name is stays unpaired (and lossless). Where several names end
    with its PARAM, it pairs with the one under the prefix where the unambiguous pairs live (`model.`
    for `proj.weight`, not `model.blocks.0.attn.`); the others, and all of them where no prefix
    tells (a model and its EMA copy, `model.w` and `ema.w`, alone), get a slot with no state: a
    weight all the same, planned from its own statistics, where leaving every name unpaired kept
    the whole commit lossless. A slot's moments are never taken over by another state.
    """
    names = sorted(set(fqns))
    states = {n for n in (state_names(names) if state is None else state) if n.rsplit(".", 1)[-1] in MOMENTS}
    weights = [n for n in names if n not in states]
    found = {name: _hits(name, weights) for name in sorted(states)}
    beside: dict[str, set[str]] = {}  # a moment's head -> the last names of everything under it but step
    for name in names:
        head, _, last = name.rpartition(".")
        if last != "step":
            beside.setdefault(head, set()).add(last)
    prefixes = Counter(hits[0][:-len(param)] for param, hits in found.values() if len(hits) == 1)
    slots: dict[str, dict[str, str]] = {}
    lrs: dict[str, float] = {}
    for name, (param, hits) in found.items():
        head, role = name.rsplit(".", 1)
        for weight in hits:
            slots.setdefault(weight, {})
        chosen = _by_prefix(hits, param, prefixes)
        if chosen is None or role in slots[chosen]:
            continue
        slots[chosen][role] = name
        # beside a moment, under its own head: never a model parameter named like one (`x.state.sum`); any
        # name, not only torch's (Adan's exp_avg_diff), so another optimizer's moments are told from Adam's
        slots[chosen].update({other: f"{head}.{other}" for other in beside.get(head, ()) if other not in MOMENTS})
        if param in param_lrs:
            lrs[chosen] = float(param_lrs[param])
    return slots, lrs


def state_names(fqns: Iterable[str], optimizers: Iterable[str] | None = None,
                params: Iterable[str] = ()) -> list[str]:
    """The optimizer state among `fqns`: told by where it sits under a known optimizer, else by its roles' names.

    `optimizers` are the PREFIXes where the save holds `PREFIX.param_groups` ("" for an optimizer's
    state dict saved at the top): under `PREFIX.state.` everything is state whatever its roles' names
    (bitsandbytes' `state1`), but where `params` (the parameters the groups list) are known, only
    `PREFIX.state.PARAM.ROLE` of one of them (a model's own `state.proj.weight` beside a top-level
    optimizer is no state). With no optimizer known (none or an empty list): `.state.PARAM.ROLE`
    with a role some torch optimizer keeps. A `.state.` alone is no proof: a model's submodule may
    be called `state` (an SSM's, an RNN's), so with an optimizer known, nothing else is state.
    """
    heads = tuple(f"{prefix}.state." if prefix else "state." for prefix in optimizers or ())
    if not heads:
        roles = (*MOMENTS, *OTHER_STATE, "step")
        return sorted(name for name in fqns if ".state." in f".{name}" and name.rsplit(".", 1)[-1] in roles)
    known = set(params)
    found = []
    for name in fqns:
        head = next((h for h in heads if name.startswith(h)), None)
        if head is not None and (not known or name[len(head):].rpartition(".")[0] in known):
            found.append(name)
    return sorted(found)


def optimizer_prefixes(fqns: Iterable[str]) -> list[str]:
    """The PREFIXes of a save's optimizers: those of its `PREFIX.param_groups…` items ("" at the top)."""
    return sorted({found.group(1) or "" for name in fqns if (found := _PARAM_GROUPS.match(name))})


def _hits(state: str, weights: list[str]) -> tuple[str, list[str]]:
    """(PARAM, the weights named PARAM or ending with it) for `state`, by its longest PARAM that any weight has."""
    head = state.rsplit(".", 1)[0]
    for param in _params_of(head):
        hits = [w for w in weights if w == param or w.endswith("." + param)]
        if hits:
            return param, hits
    return "", []


def _by_prefix(hits: list[str], param: str, prefixes: Counter[str]) -> str | None:
    """The one hit under the prefix most unambiguous pairs share, or None where that does not tell one."""
    if len(hits) <= 1:
        return hits[0] if hits else None
    counts = {hit: prefixes[hit[:-len(param)]] for hit in hits}
    best = max(counts.values())
    chosen = [hit for hit, count in counts.items() if count == best]
    return chosen[0] if best and len(chosen) == 1 else None


def _params_of(head: str) -> list[str]:
    """The PARAM names `head` (`PREFIX.state.PARAM`) may end with, one per `state.` in it, longest first."""
    dotted = f".{head}"
    found, start = [], dotted.find(".state.")
    while start >= 0:
        found.append(dotted[start + len(".state."):])
        start = dotted.find(".state.", start + 1)
    return found


def combine(stats: Mapping[Shard, ShardStats], dtypes: Mapping[str, str], sizes: Mapping[str, tuple[int, ...]],
            param_lrs: Mapping[str, float], level: LossyLevel, optimizers: Iterable[str] | None = None
            ) -> ShardFacts:
    """The coordinator's facts from every rank's shard sums (a shard reported twice counts once).

    `optimizers`: the PREFIXes whose `PREFIX.param_groups` the save holds (`optimizer_prefixes`).
    """
    sums: dict[str, list[float]] = {}
    for shard in sorted(stats, key=lambda s: (s.fqn, s.offsets)):  # one order at every world size
        s = stats[shard]
        acc = sums.setdefault(shard.fqn, [0.0, 0.0, 0])
        acc[0], acc[1], acc[2] = acc[0] + s.sum_sq, acc[1] + s.total, acc[2] + s.count
    floats = {f: v for f, v in sums.items() if v[2] and dtypes.get(f) in LOSSY_DTYPES}
    facts = ShardFacts(rms={f: _f32(math.sqrt(v[0] / v[2])) for f, v in floats.items()},
                       mean={f: _f32(v[1] / v[2]) for f, v in floats.items()},
                       elements={f: math.prod(sizes[f]) for f in sizes}, median=_medians(stats, sizes, floats))
    facts.state = state_names(dtypes, optimizers, param_lrs)
    facts.slots, facts.lrs = pair_by_fqn(dtypes, param_lrs, facts.state)
    states = [state for slot in facts.slots.values() for role, state in slot.items() if role in MOMENTS]
    lrs = set(facts.lrs.values())
    facts.shared_lr = lrs.pop() if len(lrs) == 1 else None
    facts.moment_min = moment_min_of_sizes([facts.elements[s] for s in states if s in facts.elements], level)
    if level.fisher_allocation:
        facts.sensitivity = _fisher(facts, sizes, dtypes, level)
    return facts


def _medians(stats: Mapping[Shard, ShardStats], sizes: Mapping[str, tuple[int, ...]],
             floats: Iterable[str]) -> dict[str, float]:
    """Each float tensor's bulk median from its shards' samples: the value a commit of the whole tensor plans."""
    found: dict[str, dict[int, float]] = {}
    for shard, shard_stats in stats.items():
        found.setdefault(shard.fqn, {}).update(shard_stats.sample)
    medians = {}
    for fqn in floats:
        sampled = found.get(fqn, {})
        positions = fidelity.sample_positions(math.prod(sizes.get(fqn, ())))
        medians[fqn] = fidelity.median_nonzero(np.array([sampled[p] for p in positions.tolist() if p in sampled]))
    return medians


def shard_sample(values: np.ndarray, offsets: Iterable[int], sizes: Iterable[int],
                 whole: Iterable[int]) -> dict[int, float]:
    """A shard's entries (`values`, flat) at its whole tensor's sample positions (fidelity.sample_positions)."""
    whole, offsets, sizes = tuple(whole), tuple(offsets), tuple(sizes)
    if not whole:  # a 0-d tensor: not a weight's
        return {}
    positions = np.unique(fidelity.sample_positions(math.prod(whole)))
    index = np.unravel_index(positions, whole)
    inside = np.ones(positions.size, dtype=bool)
    for axis, (start, size) in enumerate(zip(offsets, sizes)):
        inside &= (index[axis] >= start) & (index[axis] < start + size)
    local = np.ravel_multi_index(tuple(index[axis][inside] - offsets[axis] for axis in range(len(whole))), sizes)
    return dict(zip(positions[inside].tolist(), np.asarray(values, dtype=np.float64)[local].tolist()))


def _f32(value: float) -> float:
    return float(np.float32(value))


def _fisher(facts: ShardFacts, sizes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
            level: LossyLevel) -> dict[str, float]:
    """lossy_context.fisher_factors from the whole tensors' mean second moment and RMS."""
    scores = {}
    for weight, slot in facts.slots.items():
        v, shape = slot.get("exp_avg_sq"), tuple(sizes.get(weight, ()))
        whole = RawTensor(dtypes.get(weight, ""), shape, _NO_DATA)  # the whole tensor's dtype and shape, no data
        if v is None or len(shape) < 2 or not eligible(whole, level, elements=facts.elements.get(weight, 0)):
            continue
        fisher, weight_rms = facts.mean.get(v, 0.0), facts.rms.get(weight, 0.0)
        if fisher > 0 and weight_rms > 0:
            scores[weight] = fisher * weight_rms * weight_rms
    return step_factors(scores)


class _WholeRms(RmsCache):
    """A shard's RMS is its whole tensor's (from the coordinator's facts)."""

    def __init__(self, tensors: Mapping[str, RawTensor], shards: Mapping[str, Shard], rms: Mapping[str, float]):
        super().__init__(tensors)
        self._values = {key: rms.get(shard.fqn, 0.0) for key, shard in shards.items()}


def plan_shards(tensors: Mapping[str, RawTensor], shards: Mapping[str, Shard], facts: ShardFacts,
                parents: Mapping[str, TensorRecord], level: LossyLevel, settings: EncodingSettings
                ) -> tuple[dict[str, LossyPlan], dict[str, Role]]:
    """Plans (and roles) for this rank's shards (by shard key) that the level makes lossy."""
    tensors = {k: r for k, r in tensors.items() if k in shards and r.nbytes > 0}
    state_fqns = set(facts.state)
    optimizer = _shard_slots(tensors, shards, facts)
    roles = optimizer.roles()
    states = [tensors[p] for p, (role, _) in roles.items() if role != "weight"]
    ctx = PlanContext(tensors, parents, level, settings, optimizer, _WholeRms(tensors, shards, facts.rms), roles,
                      {k: facts.sensitivity[s.fqn] for k, s in shards.items() if s.fqn in facts.sensitivity},
                      {state.shape for state in states}, facts.moment_min, facts.shared_lr,
                      elements={k: facts.elements.get(s.fqn, 0) for k, s in shards.items()},
                      optimizer_state={k for k, s in shards.items() if s.fqn in state_fqns},
                      medians={k: facts.median[s.fqn] for k, s in shards.items() if s.fqn in facts.median})
    return plan_context(ctx)


def _shard_slots(tensors: Mapping[str, RawTensor], shards: Mapping[str, Shard], facts: ShardFacts) -> OptimizerMap:
    """One optimizer slot per (weight, shard layout) this rank holds: the weight's and moments' shard keys."""
    key_of = {(s.fqn, s.offsets, s.sizes): k for k, s in shards.items() if k in tensors}
    layouts = {(s.offsets, s.sizes) for k, s in shards.items() if k in tensors}
    slots = []
    for weight, states in sorted(facts.slots.items()):
        for offsets, sizes in sorted(layouts):
            found = {role: key_of.get((fqn, offsets, sizes)) for role, fqn in {"weight": weight, **states}.items()}
            if not any(found.values()):
                continue
            slot = ParamSlots(len(slots), weight=found["weight"], lr=facts.lrs.get(weight),
                              other_state=bool(set(states) - set(MOMENTS)), amsgrad=AMSGRAD_MAX in states,
                              foreign_moments=bool(set(states) - set(MOMENTS) - ADAM_EXTRAS))
            for role, key in found.items():
                if role in MOMENTS:
                    setattr(slot, role, key)
            slots.append(slot)
    if not any(role in MOMENTS for states in facts.slots.values() for role in states):
        # no moment pairs (no optimizer state, or RMSprop's and Adagrad's only): as a file commit, every tensor
        # outside the optimizer's state may be a weight, planned from its own statistics (see plan_shards)
        return OptimizerMap(slots, False, PAIRING if facts.state else NO_OPTIMIZER_STATE)
    return OptimizerMap(slots, True, PAIRING)
