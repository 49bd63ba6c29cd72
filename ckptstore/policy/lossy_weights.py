"""Planners for weight matrices, one per role: dead-zone quantization with a step in the weight's RMS.

Every weight's step is the role's step (a fraction of the level's) times the weight's step factor
(finer for embeddings, by Fisher information) times its RMS. A residual against the parent rounds
with the level's dead zone, and is capped at `relative_step` of its own RMS so that a fine-tune's
small updates are kept; a fast-moving weight (from-scratch pace) rounds to nearest and, with a
fast residual step, skips that cap: its error is overtaken within a few steps of training.
"""

from __future__ import annotations

import math
from typing import Any

from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossy_base import LossyPlan, Subject, chunk_bytes, codebooks
from ckptstore.policy.lossy_context import PlanContext


def plan_weight_keyframe(ctx: PlanContext, weight: Subject) -> LossyPlan:
    """A trained weight without a usable parent: the level's keyframe step, rounded to nearest."""
    level = ctx.level
    step = level.weight_keyframe_step * ctx.step_factor(weight.path) * weight.rms
    return _deadzone(ctx, weight, step, 0.5, level.relative_step)


def plan_frozen_weight(ctx: PlanContext, weight: Subject) -> LossyPlan:
    """A weight the optimizer does not train: stored once for the run and never corrected, so finer.

    Later commits reuse it while it is unchanged, so its finer step (`frozen_step` of the keyframe
    step) is paid for once.
    """
    level = ctx.level
    step = level.weight_keyframe_step * ctx.step_factor(weight.path) * weight.rms
    return _deadzone(ctx, weight, step * level.frozen_step, 0.5, level.relative_step)


def plan_weight_residual(ctx: PlanContext, weight: Subject) -> LossyPlan:
    """A trained weight against its parent's reconstruction: the residual step, the level's dead zone."""
    level = ctx.level
    step = level.weight_residual_step * ctx.step_factor(weight.path) * weight.rms
    return _deadzone(ctx, weight, step, level.weight_rounding, level.relative_step, _drift_params(ctx, weight))


def plan_fast_weight_keyframe(ctx: PlanContext, weight: Subject) -> LossyPlan:
    """A fast-moving weight without a usable parent: the fast keyframe step (the level's, if unset)."""
    level = ctx.level
    step = (level.fast_keyframe_step or level.weight_keyframe_step) * ctx.step_factor(weight.path) * weight.rms
    if ctx.untrained(weight.raw):  # only where its moments' shape is not its own (paired by a caller's names)
        step *= level.frozen_step
    return _deadzone(ctx, weight, _within_bound(ctx, weight, step), 0.5, _fast_relative_step(level))


def plan_fast_weight_residual(ctx: PlanContext, weight: Subject) -> LossyPlan:
    """A fast-moving weight against its parent: the fast residual step, rounded to nearest.

    A fast weight moves steadily: a dead zone wider than rounding's would hold it back, a lag in
    the direction of training that costs loss to first order.
    """
    level = ctx.level
    step = (level.fast_residual_step or level.weight_residual_step) * ctx.step_factor(weight.path) * weight.rms
    return _deadzone(ctx, weight, _within_bound(ctx, weight, step), 0.5, _fast_relative_step(level),
                     _drift_params(ctx, weight))


def _within_bound(ctx: PlanContext, weight: Subject, step: float) -> float:
    """A fast weight's step, no coarser than where its error (step / sqrt(12) of RMS) is 90% of its bound.

    The writer then rarely encodes its chunks twice (bf16 commits were 32% slower). Only fast weights:
    the fine-tune rules compare each chunk's step with the planned one, and capping theirs broke their
    refinement (docs/design-notes.md).
    """
    bound = ctx.weight_bound(weight.path)
    return min(step, 0.9 * math.sqrt(12) * bound["max_error"] * weight.rms) if bound else step


def _fast_relative_step(level: LossyLevel) -> float:
    """No fine-tune cap with a fast residual step: a small move late in a decaying schedule is overtaken."""
    return 0.0 if level.fast_residual_step else level.relative_step


def _drift_params(ctx: PlanContext, weight: Subject) -> dict[str, Any]:
    """A residual's fine-tune params with `fine_drift` (see LossyLevel): below which movement it is capped.

    The parent's reconstruction error (`base_error`) tells the codec when that error is already below
    the movement, where `settled_step` replaces the cap.
    """
    level = ctx.level
    if not (level.fine_drift > 0 and weight.base is not None):
        return {}
    params: dict[str, Any] = {"fine_below": level.fine_drift * weight.rms,
                              "base_error": float(weight.base.params.get("rel_error", 0.0)) * weight.rms}
    if level.settled_step > 0:
        params["settled_step"] = level.settled_step
    if level.fine_grid:
        params["fine_grid"] = True
    return params


def _deadzone(ctx: PlanContext, weight: Subject, step: float, rounding: float, relative_step: float,
              extra: dict[str, Any] | None = None) -> LossyPlan:
    """The dead-zone plan of a weight; a paired weight's second moment judges which residuals to prune.

    Under an error bound the planned step stays the rules' own (fast weights aside, `_within_bound`);
    the writer enforces it by encoding a chunk again: the fine-tune rules compare each chunk's step with the planned one
    (chunk_step, capped), and starting keyframes at the bound's predicted step broke their
    refinement (minilm-finetune's eval drifted to +3.5% along the chain; docs/design-notes.md).
    """
    bound = ctx.weight_bound(weight.path)
    params = {"chunk_bytes": chunk_bytes(weight.raw, weight.base, ctx.settings), "dtype": weight.raw.dtype,
              "step": step, "rounding": rounding, "relative_step": relative_step, **codebooks(ctx.level),
              **(extra or {}), **bound}
    return LossyPlan(weight.path, "deadzone", params, weight.base, importance=weight.importance,
                     prune=ctx.level.prune if weight.importance else 0.0)
