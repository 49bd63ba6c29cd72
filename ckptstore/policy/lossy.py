"""Lossy plans: per tensor, which lossy codec, with what step, against which base.

Weights (matrices of trainable parameters) get dead-zone quantization, keyframe or closed-loop
residual, with a step relative to the tensor's RMS (finer for embeddings); Adam's second moment is
coded in the log domain against its parent, the first moment as m / sqrt(v) against this commit's
reconstructed second moment; SGD momentum as a keyframe with a step tied to `moment_step`.
Biases, norms, small tensors, integers, step counters and all non-tensor state stay lossless.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.codecs.floats import LOSSY_DTYPES, to_float32
from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossless import EncodingSettings
from ckptstore.policy.mapping import OptimizerMap, ParamSlots
from ckptstore.policy.sensitivity import step_factors
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor

_EMBEDDING = re.compile(r"embed|wte|wpe|tok_emb|pos_emb", re.IGNORECASE)
V_EPS = 1e-30
SMALL_STATE_SHARE = 0.05  # see _moment_min_elements
SGD_MOMENTUM_STEP = 1.0  # SGD momentum's step, in its RMS, per unit of `moment_step` (balanced: 4 RMS)


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


def _rms(raw: RawTensor) -> float:
    values = to_float32(raw.data, raw.dtype).astype(np.float64)
    return float(np.sqrt(np.mean(values * values))) if values.size else 0.0


def _temporal_base(parent: TensorRecord | None, raw: RawTensor, codecs: tuple[str, ...],
                   max_chain: int) -> TensorRecord | None:
    """The parent's tensor as a closed-loop base, when the layout matches and the chain has room."""
    if (parent is None or parent.dtype != raw.dtype or parent.shape != raw.shape
            or parent.codec not in codecs or parent.depth + 1 > max_chain):
        return None
    return parent


def _codebooks(level: LossyLevel) -> dict[str, bool]:
    """The dead-zone param that lets chunks try a codebook (absent when off, as in older records)."""
    return {"codebooks": True} if level.codebooks else {}


def eligible(raw: RawTensor, level: LossyLevel, min_elements: int | None = None) -> bool:
    """Float tensors large enough to be worth quantizing (`min_elements`: the level's, by default)."""
    least = level.min_elements if min_elements is None else min_elements
    return raw.dtype in LOSSY_DTYPES and int(np.prod(raw.shape)) >= max(1, least)


def plan_lossy(tensors: Mapping[str, RawTensor], parents: Mapping[str, TensorRecord], level: LossyLevel,
               settings: EncodingSettings, optimizer: OptimizerMap,
               fisher: Mapping[str, float] | None = None) -> dict[str, LossyPlan]:
    """Plans for every tensor that this level makes lossy; the others stay lossless.

    `fisher` (per weight path, from sensitivity.measure_fisher) replaces Adam's second moment
    as the estimate of each weight's loss sensitivity.
    """
    plans: dict[str, LossyPlan] = {}
    chunking = {"chunk_bytes": settings.chunk_bytes}
    roles = optimizer.roles()
    rms_by_path: dict[str, float] = {}

    def rms_of(path: str) -> float:  # one pass over each weight, shared by the factors and its plan
        if path not in rms_by_path:
            rms_by_path[path] = _rms(tensors[path])
        return rms_by_path[path]

    sensitivity = {}
    if fisher:
        sensitivity = _measured_factors(tensors, fisher, level, rms_of)
    elif level.fisher_allocation:
        sensitivity = _fisher_factors(tensors, optimizer, level, rms_of)

    states = [tensors[p] for slot in optimizer.slots
              for p in (slot.exp_avg, slot.exp_avg_sq, slot.momentum_buffer) if p in tensors]
    trained_shapes = {state.shape for state in states}
    moment_min = _moment_min_elements(states, level)
    # Unpaired weights (pairing uncertain) take the learning rate when every parameter shares one.
    lrs = {_adam_lr(slot) for slot in optimizer.slots}
    shared_lr = lrs.pop() if len(lrs) == 1 else None

    def weight_plan(path: str, raw: RawTensor, importance: str | None, stage: int = 0) -> LossyPlan | None:
        if len(raw.shape) < 2 or not eligible(raw, level):
            return None
        rms = rms_of(path)
        if rms == 0.0:
            return None
        factor = (level.embedding_factor if _EMBEDDING.search(path) else 1.0) * sensitivity.get(path, 1.0)
        base = _temporal_base(parents.get(path), raw, ("deadzone", "bytegroup"), level.max_chain)
        keyframe_step, residual_step = level.weight_keyframe_step, level.weight_residual_step
        lr = _adam_lr(roles.get(path, (None, None))[1]) or (shared_lr if raw.shape in trained_shapes else None)
        fast = level.fast_move > 0 and lr is not None and lr >= level.fast_move * rms  # a from-scratch pace
        if fast:
            keyframe_step = level.fast_keyframe_step or keyframe_step
            residual_step = level.fast_residual_step or residual_step
        step = (residual_step if base is not None else keyframe_step) * factor * rms
        if base is None and level.frozen_step < 1 and trained_shapes and raw.shape not in trained_shapes:
            step *= level.frozen_step  # no optimizer state has its shape: untrained, stored once
        # A fast weight moves steadily: a dead zone wider than rounding's would hold it back, a lag in
        # the direction of training that costs loss to first order, so it rounds to nearest; and a
        # small move late in a decaying schedule is still overtaken within steps, so the fine-tune
        # cap (relative_step) does not apply to it.
        rounding = level.weight_rounding if base is not None and not fast else 0.5
        relative_step = 0.0 if fast and level.fast_residual_step else level.relative_step
        params = dict(chunking, dtype=raw.dtype, step=step, rounding=rounding, relative_step=relative_step,
                      **_codebooks(level))
        if level.fine_drift > 0 and base is not None:
            params["fine_below"] = level.fine_drift * rms
            params["base_error"] = float(base.params.get("rel_error", 0.0)) * rms
            if level.settled_step > 0:
                params["settled_step"] = level.settled_step
            if level.fine_grid:
                params["fine_grid"] = True
        params["chunk_bytes"] = int(base.params["chunk_bytes"]) if base is not None else _chunk(raw, settings)
        return LossyPlan(path, "deadzone", params, base, importance=importance,
                         prune=level.prune if importance else 0.0, stage=stage)

    for path, raw in tensors.items():
        role, slot = roles.get(path, (None, None))
        if role is None:
            if not optimizer.certain and level.weights_lossy and not path.endswith(("/step", "step")):
                plan = weight_plan(path, raw, None)  # pairing unknown: per-tensor statistics only
                if plan is not None:
                    plans[path] = plan
            continue
        if role == "weight":
            if level.weights_lossy:
                plan = weight_plan(path, raw, slot.exp_avg_sq if optimizer.certain else None)
                if plan is not None:
                    plans[path] = plan
        elif role == "momentum_buffer" and eligible(raw, level, moment_min):
            rms = _rms(raw)
            if rms > 0:  # its error reaches the weights only as lr / (1 - momentum) times it, decaying
                plans[path] = LossyPlan(path, "deadzone", dict(chunking, dtype=raw.dtype,
                                        step=level.moment_step * SGD_MOMENTUM_STEP * rms, rounding=0.5,
                                        chunk_bytes=_chunk(raw, settings), **_codebooks(level)))
        elif role == "exp_avg_sq" and eligible(raw, level, moment_min) and slot.exp_avg is not None:
            base = _temporal_base(parents.get(path), raw, ("log2moment",), level.max_chain)
            params = dict(dtype=raw.dtype, k=level.v_levels_log2,
                          chunk_bytes=int(base.params["chunk_bytes"]) if base else _chunk(raw, settings))
            mask_from = slot.weight if (level.prune > 0 and slot.weight in plans and base is not None) else None
            plans[path] = LossyPlan(path, "log2moment", params, base, mask_from=mask_from, stage=1)
    for path, raw in tensors.items():
        role, slot = roles.get(path, (None, None))
        if role == "exp_avg" and slot.exp_avg_sq in plans:
            v_plan = plans[slot.exp_avg_sq]
            factor = sensitivity.get(slot.weight, 1.0)  # m's error becomes the weight's
            params = dict(dtype=raw.dtype, v_dtype=tensors[slot.exp_avg_sq].dtype, step=level.moment_step * factor,
                          rounding=level.moment_rounding, eps=V_EPS, chunk_bytes=v_plan.params["chunk_bytes"])
            if raw.itemsize != tensors[slot.exp_avg_sq].itemsize:
                continue  # chunks must line up with the second moment's
            mask_from = slot.weight if (level.prune > 0 and slot.weight in plans) else None
            paced_by = None
            if level.fine_moment_step > 0 and slot.weight in plans:
                params["fine_step"], paced_by = level.fine_moment_step * factor, slot.weight
            plans[path] = LossyPlan(path, "normmoment", params, sibling=slot.exp_avg_sq, mask_from=mask_from,
                                    stage=2, paced_by=paced_by)
    return plans


def _fisher_factors(tensors: Mapping[str, RawTensor], optimizer: OptimizerMap, level: LossyLevel,
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
        if len(weight.shape) < 2 or not eligible(weight, level):
            continue
        fisher = float(np.mean(to_float32(v.data, v.dtype), dtype=np.float64))
        rms = rms_of(slot.weight)
        if fisher > 0 and rms > 0:
            scores[slot.weight] = fisher * rms * rms
    return step_factors(scores)


def _measured_factors(tensors: Mapping[str, RawTensor], fisher: Mapping[str, float], level: LossyLevel,
                      rms_of: Callable[[str], float]) -> dict[str, float]:
    """Per weight, its step factor from the Fisher information measured on a calibration batch."""
    scores = {}
    for path, value in fisher.items():
        weight = tensors.get(path)
        if weight is not None and len(weight.shape) >= 2 and eligible(weight, level):
            scores[path] = value * rms_of(path) ** 2
    return step_factors(scores)


def _moment_min_elements(states: list[RawTensor], level: LossyLevel) -> int:
    """The smallest optimizer state quantized: the level's `moment_min_elements`, or `min_elements`.

    The first holds unless the tensors below `min_elements` hold more than SMALL_STATE_SHARE of the
    state's entries. Small tensors (biases, norms) are a sliver of a whole model's training, and
    their moments then follow the level; where they are what is trained (a linear probe on a frozen
    backbone, low-rank adapters) their moments decide the resume, and stay lossless.
    """
    sizes = [int(np.prod(state.shape)) for state in states]
    small = sum(size for size in sizes if size < level.min_elements)
    if small > SMALL_STATE_SHARE * sum(sizes):
        return level.min_elements
    return level.moment_min_elements


def _adam_lr(slot: ParamSlots | None) -> float | None:
    """The learning rate of an Adam-family parameter (whose step moves each entry by up to about lr)."""
    return slot.lr if slot is not None and slot.exp_avg_sq is not None else None


def _chunk(raw: RawTensor, settings: EncodingSettings) -> int:
    return max(raw.itemsize, settings.chunk_bytes // raw.itemsize * raw.itemsize)
