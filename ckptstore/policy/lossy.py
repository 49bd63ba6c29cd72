"""Lossy plans: per tensor, which lossy codec, with what step, against which base.

Weights (matrices of trainable parameters) get dead-zone quantization, keyframe or closed-loop
residual, with a step relative to the tensor's RMS (finer for embeddings); Adam's second moment is
coded in the log domain against its parent, the first moment as m / sqrt(v) against this commit's
reconstructed second moment; SGD momentum as a keyframe with a step tied to `moment_step`.
Biases, norms, small tensors, integers, step counters and all non-tensor state stay lossless.

Each tensor is classified into a role (lossy_roles.Role) and planned by that role's planner
(ROLE_PLANNERS: lossy_weights, lossy_moments); what several planners need (RMS, step factors,
trained shapes, the learning rate) is computed once per commit (lossy_context.PlanContext).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set

from ckptstore.policy.levels import LossyLevel
from ckptstore.policy.lossless import EncodingSettings
from ckptstore.policy.lossy_base import LossyPlan, Subject, eligible
from ckptstore.policy.lossy_context import PlanContext, build_context
from ckptstore.policy.lossy_moments import plan_adam_first_moment, plan_adam_second_moment, plan_sgd_momentum
from ckptstore.policy.lossy_roles import Role, classify, is_first_moment
from ckptstore.policy.lossy_weights import (
    plan_fast_weight_keyframe,
    plan_fast_weight_residual,
    plan_frozen_weight,
    plan_weight_keyframe,
    plan_weight_residual,
)
from ckptstore.policy.mapping import OptimizerMap
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor

__all__ = ["ROLE_PLANNERS", "LossyPlan", "Planner", "Role", "eligible", "plan_context", "plan_lossy", "plan_roles"]

Planner = Callable[[PlanContext, Subject], LossyPlan]

ROLE_PLANNERS: dict[Role, Planner] = {
    Role.WEIGHT_KEYFRAME: plan_weight_keyframe,
    Role.WEIGHT_RESIDUAL: plan_weight_residual,
    Role.FROZEN_WEIGHT: plan_frozen_weight,
    Role.FAST_WEIGHT_KEYFRAME: plan_fast_weight_keyframe,
    Role.FAST_WEIGHT_RESIDUAL: plan_fast_weight_residual,
    Role.SGD_MOMENTUM: plan_sgd_momentum,
    Role.ADAM_SECOND_MOMENT: plan_adam_second_moment,
    Role.ADAM_FIRST_MOMENT: plan_adam_first_moment,
}


def plan_lossy(tensors: Mapping[str, RawTensor], parents: Mapping[str, TensorRecord], level: LossyLevel,
               settings: EncodingSettings, optimizer: OptimizerMap, fisher: Mapping[str, float] | None = None,
               keep_exact: Set[str] = frozenset(), optimizer_state: Set[str] = frozenset()) -> dict[str, LossyPlan]:
    """Plans for every tensor that this level makes lossy; the others (and those in `keep_exact`) stay lossless.

    `fisher` (per weight path, from sensitivity.measure_fisher) replaces Adam's second moment
    as the estimate of each weight's loss sensitivity. `optimizer_state` (mapping.optimizer_state_paths)
    names the tensors of optimizers' states, which are never taken for weights.
    """
    ctx = build_context(tensors, parents, level, settings, optimizer, fisher, keep_exact, optimizer_state)
    return plan_context(ctx)[0]


def plan_roles(tensors: Mapping[str, RawTensor], parents: Mapping[str, TensorRecord], level: LossyLevel,
               settings: EncodingSettings, optimizer: OptimizerMap, fisher: Mapping[str, float] | None = None,
               keep_exact: Set[str] = frozenset(), optimizer_state: Set[str] = frozenset()) -> dict[str, Role]:
    """Every tensor's role, in the tensors' order, as `plan_lossy` (same arguments) classifies it."""
    ctx = build_context(tensors, parents, level, settings, optimizer, fisher, keep_exact, optimizer_state)
    return plan_context(ctx)[1]


def plan_context(ctx: PlanContext) -> tuple[dict[str, LossyPlan], dict[str, Role]]:
    """(plans, roles) for every tensor of a prepared context (build_context's, or lossy_shards' for shards).

    Classifies and plans every tensor, first moments last; the plans in the order they were made.
    """
    roles: dict[str, Role] = {}
    # A first moment follows its second moment's plan (chunking, and whether it is lossy at all).
    # Second moments take their weight's pruning mask only where that weight was planned before them.
    for first_moments in (False, True):
        for path, raw in ctx.tensors.items():
            if is_first_moment(ctx, path) is not first_moments:
                continue
            role, subject = classify(ctx, path, raw)
            roles[path] = role
            if role is not Role.LOSSLESS:
                ctx.plans[path] = ROLE_PLANNERS[role](ctx, subject)
    for path, plan in ctx.plans.items():
        if plan.codec == "deadzone" and plan.params.get("max_error"):
            # every chunk judges its bulk by the whole tensor's scale: a chunk's own let the matrix's bulk miss
            plan.params["bulk_median"] = ctx.bulk_median(path)
    return ctx.plans, {path: roles[path] for path in ctx.tensors}
