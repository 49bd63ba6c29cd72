"""Planners for optimizer state, one per role: Adam's two moments and SGD's momentum.

Adam's second moment v is coded in the log domain against its parent; the first moment m as
m / sqrt(v) against this commit's reconstructed v, so its chunks follow v's plan and it is
planned after it; SGD momentum as a keyframe with a step tied to `moment_step`.
"""

from __future__ import annotations

from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossy_base import LossyPlan, Subject, chunk_bytes, codebooks, temporal_base
from ckptstore.policy.lossy_context import PlanContext
from ckptstore.policy.mapping import ParamSlots

V_EPS = 1e-30
SGD_MOMENTUM_STEP = 1.0  # SGD momentum's step, in its RMS, per unit of `moment_step` (balanced: 4 RMS)


def plan_sgd_momentum(ctx: PlanContext, momentum: Subject) -> LossyPlan:
    """A keyframe with a step in its RMS: its error reaches the weights only as lr / (1 - momentum) times it."""
    level = ctx.level
    # No planned-step cap from the bound (as weights have): rounding to nearest never puts an
    # entry further off than zero would, so a bound of 1 holds at any step, and a cap only cost bytes.
    params = {"chunk_bytes": chunk_bytes(momentum.raw, None, ctx.settings), "dtype": momentum.raw.dtype,
              "step": level.moment_step * SGD_MOMENTUM_STEP * momentum.rms, "rounding": 0.5, **codebooks(level),
              **update_bound(level)}
    return LossyPlan(momentum.path, "deadzone", params)


def plan_adam_second_moment(ctx: PlanContext, v: Subject) -> LossyPlan:
    """`v_levels_log2` bits per octave, against the parent's v; never pruned.

    The second moment of a lossy weight moving at a fine-tune's pace (not fast, see
    `PlanContext.fast`) takes `fine_v_levels_log2` where set: per tensor, since a record has one grid.
    Pruning it where its weight did not move kept the parent's v as the true one drifted, commit
    after commit, past the level's factor on sqrt(v).
    """
    level = ctx.level
    base = temporal_base(ctx.parents.get(v.path), v.raw, ("log2moment",), level.max_chain)
    weight = _slots(v).weight
    k = level.v_levels_log2
    if (level.fine_v_levels_log2 is not None and weight in ctx.plans
            and not ctx.fast(weight, ctx.tensors[weight], ctx.rms_of(weight))):
        k = level.fine_v_levels_log2
    params = {"dtype": v.raw.dtype, "k": k, "chunk_bytes": chunk_bytes(v.raw, base, ctx.settings)}
    return LossyPlan(v.path, "log2moment", params, base, stage=1)


def plan_adam_first_moment(ctx: PlanContext, m: Subject) -> LossyPlan:
    """Quantized as m / sqrt(v) with `moment_step` (its weight's step factor: m's error becomes the weight's).

    Where its weight is lossy, a fine-tune's moment takes `fine_moment_step` when the weight's
    residual was capped (the codec learns that from the weight: `paced_by`).
    """
    level, slot = ctx.level, _slots(m)
    second = slot.exp_avg_sq
    factor = ctx.sensitivity.get(slot.weight, 1.0)  # no weight (pairing uncertain): 1.0
    params = {"dtype": m.raw.dtype, "v_dtype": ctx.tensors[second].dtype, "step": level.moment_step * factor,
              "rounding": level.moment_rounding, "eps": V_EPS, "chunk_bytes": ctx.plans[second].params["chunk_bytes"],
              **update_bound(level)}
    # the weight's pruned entries, chunk by chunk: only where its chunks hold the same entries as the moment's
    # (a bf16 weight beside fp32 moments is cut in other places: its masks did not fit, IndexError at `extreme`)
    same_chunks = slot.weight in ctx.plans and ctx.tensors[slot.weight].dtype == m.raw.dtype and \
        ctx.plans[slot.weight].params.get("chunk_bytes") == params["chunk_bytes"]
    mask_from = slot.weight if level.prune > 0 and same_chunks else None
    paced_by = None
    if level.fine_moment_step > 0 and slot.weight in ctx.plans:
        params["fine_step"], paced_by = level.fine_moment_step * factor, slot.weight
    return LossyPlan(m.path, "normmoment", params, sibling=second, mask_from=mask_from, stage=2, paced_by=paced_by)


def update_bound(level: LossyLevel) -> dict[str, float]:
    """The bound on a restored update (Adam's m / sqrt(v), SGD's momentum) the writer enforces, if any."""
    return {"max_error": level.max_update_error} if level.max_update_error > 0 else {}


def _slots(moment: Subject) -> ParamSlots:
    """A moment's optimizer parameter (classification only gives moments roles with one)."""
    if moment.slot is None:
        raise ValueError(f"{moment.path} has no optimizer parameter")
    return moment.slot
