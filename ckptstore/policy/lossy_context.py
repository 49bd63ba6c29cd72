"""What every lossy planner of one commit shares, computed once: RMS, step factors, trained shapes.

The planners of the roles (lossy_weights, lossy_moments) each need some of the same facts about
the commit: a weight's RMS (a pass over its entries, also needed by the Fisher factors), its
sensitivity factor, which shapes the optimizer trains, the learning rate, the smallest moment
quantized, and the plans made so far (a first moment is coded against its second moment's plan).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field

import numpy as np

from ckptstore.codecs.floats import LOSSY_DTYPES, to_float32
from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossless import EncodingSettings
from ckptstore.policy.lossy_base import LossyPlan, bulk_median, eligible, rms
from ckptstore.policy.mapping import OptimizerMap, ParamSlots
from ckptstore.policy.sensitivity import step_factors
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor

_EMBEDDING = re.compile(r"embed|wte|wpe|tok_emb|pos_emb", re.IGNORECASE)
SMALL_STATE_SHARE = 0.05  # see moment_min_elements
MAX_ALLOWANCE = 2.0  # a weight's error bound is the level's times its step factor, within [1/2, 2]


class RmsCache:
    """Each tensor's RMS, computed on first use: one pass over a weight serves its factor and its plan."""

    def __init__(self, tensors: Mapping[str, RawTensor]) -> None:
        self._tensors = tensors
        self._values: dict[str, float] = {}

    def __call__(self, path: str) -> float:
        if path not in self._values:
            self._values[path] = rms(self._tensors[path])
        return self._values[path]


@dataclass
class PlanContext:
    """The inputs of one commit's lossy planning, the facts derived from them, and the plans so far.

    `slots` maps each optimizer-owned path to (its optimizer role, its parameter's slots);
    `sensitivity` holds per-weight step factors (Fisher allocation); `trained_shapes` are the
    shapes some optimizer state has; `shared_lr` is the learning rate when every parameter shares
    one (it stands in for unpaired weights); `moment_min` is the smallest moment quantized.
    """

    tensors: Mapping[str, RawTensor]
    parents: Mapping[str, TensorRecord]
    level: LossyLevel
    settings: EncodingSettings
    optimizer: OptimizerMap
    rms_of: RmsCache
    slots: dict[str, tuple[str, ParamSlots]]
    sensitivity: dict[str, float]
    trained_shapes: set[tuple[int, ...]]
    moment_min: int
    shared_lr: float | None
    plans: dict[str, LossyPlan] = field(default_factory=dict)
    elements: Mapping[str, int] = field(default_factory=dict)  # a shard's whole tensor's count (lossy_shards)
    keep_exact: Set[str] = frozenset()  # paths kept lossless whatever their role (views sharing a storage)
    optimizer_state: Set[str] = frozenset()  # paths inside an optimizer's `state`: never taken for weights
    medians: dict[str, float] = field(default_factory=dict)  # bulk medians by path (a shard's: its whole tensor's)

    def optimizer_role(self, path: str) -> tuple[str | None, ParamSlots | None]:
        """The path's role in the optimizer ("weight", "exp_avg", ...) and its slots, or (None, None)."""
        return self.slots.get(path, (None, None))

    def bulk_median(self, path: str) -> float:
        """The tensor's median nonzero magnitude, which its chunks judge their bulk by (fidelity.bulk_error)."""
        if path not in self.medians:
            self.medians[path] = bulk_median(self.tensors[path])
        return self.medians[path]

    def step_factor(self, path: str) -> float:
        """How much coarser than the level's step a weight is quantized: finer for embeddings, by Fisher."""
        return (self.level.embedding_factor if _EMBEDDING.search(path) else 1.0) * self.sensitivity.get(path, 1.0)

    def weight_bound(self, path: str) -> dict[str, float]:
        """The weight's enforced error bound (`max_weight_error` times its allowance), if the level sets one."""
        if self.level.max_weight_error <= 0:
            return {}
        allowance = min(MAX_ALLOWANCE, max(1 / MAX_ALLOWANCE, self.step_factor(path)))
        return {"max_error": self.level.max_weight_error * allowance}

    def fast(self, path: str, raw: RawTensor, weight_rms: float) -> bool:
        """Whether an Adam step (up to about lr per entry) moves the weight at a from-scratch pace."""
        lr = adam_lr(self.optimizer_role(path)[1]) or (self.shared_lr if raw.shape in self.trained_shapes else None)
        return self.level.fast_move > 0 and lr is not None and lr >= self.level.fast_move * weight_rms

    def untrained(self, raw: RawTensor) -> bool:
        """No optimizer state has the tensor's shape (while some has): frozen, when frozen_step < 1 asks."""
        return bool(self.level.frozen_step < 1 and self.trained_shapes and raw.shape not in self.trained_shapes)


def build_context(tensors: Mapping[str, RawTensor], parents: Mapping[str, TensorRecord], level: LossyLevel,
                  settings: EncodingSettings, optimizer: OptimizerMap,
                  fisher: Mapping[str, float] | None, keep_exact: Set[str] = frozenset(),
                  optimizer_state: Set[str] = frozenset()) -> PlanContext:
    """The shared facts of one commit, each computed once (see PlanContext)."""
    rms_of = RmsCache(tensors)
    sensitivity: dict[str, float] = {}
    if fisher:
        sensitivity = measured_factors(tensors, fisher, level, rms_of)
    elif level.fisher_allocation:
        sensitivity = fisher_factors(tensors, optimizer, level, rms_of)
    states = [tensors[p] for slot in optimizer.slots
              for p in (slot.exp_avg, slot.exp_avg_sq, slot.momentum_buffer) if p in tensors]
    # Unpaired weights (pairing uncertain) take the learning rate when every parameter shares one.
    lrs = {adam_lr(slot) for slot in optimizer.slots}
    return PlanContext(tensors, parents, level, settings, optimizer, rms_of, optimizer.roles(), sensitivity,
                       {state.shape for state in states}, moment_min_elements(states, level),
                       lrs.pop() if len(lrs) == 1 else None, keep_exact=keep_exact, optimizer_state=optimizer_state)


def fisher_factors(tensors: Mapping[str, RawTensor], optimizer: OptimizerMap, level: LossyLevel,
                   rms_of: Callable[[str], float]) -> dict[str, float]:
    """Per weight, how much coarser (>1) or finer (<1) than the level's step it may be quantized.

    Adam's second moment estimates the Fisher information F of each weight, and quantization noise
    of step s costs about F * s^2 / 24 of loss per entry: at equal total loss, bits go furthest
    with s proportional to 1 / sqrt(F). The factors keep the geometric mean of step / RMS at the
    level's value, clamped to [1/8, 8].
    """
    scores = {}
    for slot in optimizer.slots:
        if not (optimizer.certain and slot.weight and slot.exp_avg_sq) or slot.weight not in tensors:
            continue
        weight, v = tensors[slot.weight], tensors[slot.exp_avg_sq]
        if len(weight.shape) < 2 or not eligible(weight, level) or v.dtype not in LOSSY_DTYPES:
            continue  # a float64 v (moments kept in double beside float32 weights): no estimate read from it
        fisher = float(np.mean(to_float32(v.data, v.dtype), dtype=np.float64))
        weight_rms = rms_of(slot.weight)
        if fisher > 0 and weight_rms > 0:
            scores[slot.weight] = fisher * weight_rms * weight_rms
    return step_factors(scores)


def measured_factors(tensors: Mapping[str, RawTensor], fisher: Mapping[str, float], level: LossyLevel,
                     rms_of: Callable[[str], float]) -> dict[str, float]:
    """Per weight, its step factor from the Fisher information measured on a calibration batch."""
    scores = {}
    for path, value in fisher.items():
        weight = tensors.get(path)
        if weight is not None and len(weight.shape) >= 2 and eligible(weight, level):
            scores[path] = value * rms_of(path) ** 2
    return step_factors(scores)


def moment_min_elements(states: list[RawTensor], level: LossyLevel) -> int:
    """The smallest optimizer state quantized: the level's `moment_min_elements`, or `min_elements`.

    The first holds unless the tensors below `min_elements` hold more than SMALL_STATE_SHARE of the
    state's entries. Small tensors (biases, norms) are a sliver of a whole model's training, and
    their moments then follow the level; where they are what is trained (a linear probe on a frozen
    backbone, low-rank adapters) their moments decide the resume, and stay lossless.
    """
    return moment_min_of_sizes([int(np.prod(state.shape)) for state in states], level)


def moment_min_of_sizes(sizes: list[int], level: LossyLevel) -> int:
    """`moment_min_elements` given the states' element counts (a sharded commit's whole tensors)."""
    small = sum(size for size in sizes if size < level.min_elements)
    if small > SMALL_STATE_SHARE * sum(sizes):
        return level.min_elements
    return level.moment_min_elements


def adam_lr(slot: ParamSlots | None) -> float | None:
    """The learning rate of an Adam-family parameter (whose step moves each entry by up to about lr)."""
    return slot.lr if slot is not None and slot.exp_avg_sq is not None else None
