"""The lossy plan every planner returns, and the per-tensor measurements the planners share."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.codecs.floats import LOSSY_DTYPES, to_float32
from ckptstore.policy import fidelity
from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossless import EncodingSettings
from ckptstore.policy.mapping import ParamSlots
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor, element_slices


@dataclass
class LossyPlan:
    """How one tensor is encoded in a lossy commit."""

    path: str
    codec: str
    params: dict[str, Any]
    base: TensorRecord | None = None
    sibling: str | None = None
    mask_from: str | None = None
    importance: str | None = None
    prune: float = 0.0
    stage: int = 0
    paced_by: str | None = None


@dataclass(frozen=True)
class Subject:
    """One tensor as its role's planner sees it, with what its classification already measured.

    `rms` is set for weights and SGD momentum (whose steps are relative to it), `base` for weights
    coded as a residual of their parent, `importance` for paired weights (their second moment).
    """

    path: str
    raw: RawTensor
    slot: ParamSlots | None = None
    rms: float = 0.0
    base: TensorRecord | None = None
    importance: str | None = None


def eligible(raw: RawTensor, level: LossyLevel, min_elements: int | None = None, elements: int | None = None) -> bool:
    """Float tensors large enough to be worth quantizing (`min_elements`: the level's, by default).

    `elements` is the size that counts, where it is not the raw's own (a shard: its whole tensor's).
    """
    least = level.min_elements if min_elements is None else min_elements
    count = int(np.prod(raw.shape)) if elements is None else elements
    return raw.dtype in LOSSY_DTYPES and count >= max(1, least)


def _float32_slices(raw: RawTensor, first: int = 0) -> Iterator[np.ndarray]:
    """A float tensor's values in float32, a slice at a time: no copy of a multi-GB tensor at once (9x its size)."""
    for part in element_slices(raw, first):
        yield to_float32(part.data, part.dtype)


def rms(raw: RawTensor) -> float:
    """Root mean square of a float tensor's entries (0 for an empty one), accumulated in float64."""
    count = raw.data.size // raw.itemsize
    if not count:
        return 0.0
    squares = 0.0
    for values in _float32_slices(raw):
        wide = values.astype(np.float64)
        squares += float(np.dot(wide, wide))
    return math.sqrt(squares / count)


def bulk_median(raw: RawTensor) -> float:
    """The median nonzero magnitude of a float tensor, sampled (fidelity.sample_positions): its bulk's scale."""
    positions = fidelity.sample_positions(raw.data.size // raw.itemsize)
    picked = np.ascontiguousarray(raw.data.reshape(-1, raw.itemsize)[positions]).reshape(-1)
    return fidelity.median_nonzero(to_float32(picked, raw.dtype))


def whole_numbers(raw: RawTensor, sample: int = 4096) -> bool:
    """Whether a float tensor holds only whole numbers (a mask, a count): a sample first, most weights fail it."""
    if raw.dtype not in LOSSY_DTYPES or not raw.data.size:
        return False
    head = to_float32(raw.data[: sample * raw.itemsize], raw.dtype)
    if not np.array_equal(head, np.round(head)):
        return False
    return all(np.array_equal(values, np.round(values)) for values in _float32_slices(raw, sample))


def temporal_base(parent: TensorRecord | None, raw: RawTensor, codecs: tuple[str, ...],
                  max_chain: int) -> TensorRecord | None:
    """The parent's tensor as a closed-loop base, when the layout matches and the chain has room."""
    if (parent is None or parent.dtype != raw.dtype or parent.shape != raw.shape
            or parent.codec not in codecs or parent.depth + 1 > max_chain):
        return None
    return parent


def chunk_bytes(raw: RawTensor, base: TensorRecord | None, settings: EncodingSettings) -> int:
    """A residual's chunks line up with its base's; a keyframe's are the settings' size in whole items."""
    if base is not None:
        return int(base.params["chunk_bytes"])
    return max(raw.itemsize, settings.chunk_bytes // raw.itemsize * raw.itemsize)


def codebooks(level: LossyLevel) -> dict[str, bool]:
    """The dead-zone param that lets chunks try a codebook (absent when off, as in older records)."""
    return {"codebooks": True} if level.codebooks else {}


def plans_without(plans: Mapping[str, LossyPlan], whole: Set[str]) -> dict[str, LossyPlan]:
    """`plans` less the tensors in `whole` and every tensor coded with one of them, lossless too.

    A first moment is coded against its second moment (`sibling`), a moment may take its weight's
    mask or pace: without its partner's reconstruction it has nothing to be coded with. And a
    dropped first moment's second moment goes too: only m's codec bounds the update m / sqrt(v),
    which an exact m beside a lossy v missed by up to v's grid factor.
    """
    dropped = set(whole)
    while True:
        more = {path for path, plan in plans.items() if path not in dropped
                and {plan.sibling, plan.mask_from, plan.paced_by} & dropped}
        more |= {plan.sibling for path, plan in plans.items() if path in dropped
                 and plan.sibling in plans and plan.sibling not in dropped}
        if not more:
            return {path: plan for path, plan in plans.items() if path not in dropped}
        dropped |= more
