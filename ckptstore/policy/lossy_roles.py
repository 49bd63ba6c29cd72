"""What each tensor is to the lossy planner: its role, which picks the planner that codes it.

A tensor's role follows from its place in the optimizer (weight, Adam's first or second moment,
SGD momentum, or none), its size and dtype, its parent (a residual needs one with the same layout
and room in the chain) and the level: a weight is fast-moving where its learning rate is a large
share of its RMS, frozen where no optimizer state has its shape. Whether it is an embedding only
scales its step (PlanContext.step_factor), in whichever role.
"""

from __future__ import annotations

import re
from enum import Enum

from ckptstore.codecs.floats import LOSSY_DTYPES
from ckptstore.policy.lossy_base import Subject, eligible, temporal_base, whole_numbers
from ckptstore.policy.lossy_context import PlanContext
from ckptstore.policy.mapping import ParamSlots, is_buffer
from ckptstore.state import RawTensor

WEIGHT_BASE_CODECS = ("deadzone", "bytegroup")  # a weight's residual may build on a lossy or lossless parent
# biases and norm layers' weights by name, kept exact whatever their shape (a LayerNorm over (16, 512) is 2-D): a
# `bias`, or the weight of a module named as norms are (ln_f, norm1, bn2, LayerNorm, input_layernorm, final_layer_norm);
# `norm` only as a whole word part, so neither `denorm` nor `norm_proj` (a matrix) is caught
_BIAS_OR_NORM = re.compile(r"(?:^|[./])bias$|(?:^|[./])(?:\w*_)?(?:ln|bn|gn|norm|layernorm|batchnorm|groupnorm|rmsnorm"
                           r"|instancenorm)(?:_?(?:\d+|f))?[./]weight$", re.IGNORECASE)


class Role(Enum):
    """A tensor's role in a lossy commit; every role but LOSSLESS has its own planner."""

    LOSSLESS = "lossless"  # ineligible (small, 1-D, integer, all zero) or left lossless by the level
    WEIGHT_KEYFRAME = "weight_keyframe"  # a trained weight without a usable parent
    WEIGHT_RESIDUAL = "weight_residual"  # a trained weight against its parent's reconstruction
    FROZEN_WEIGHT = "frozen_weight"  # a keyframe of a weight no optimizer state has the shape of
    FAST_WEIGHT_KEYFRAME = "fast_weight_keyframe"  # moving at a from-scratch pace, no usable parent
    FAST_WEIGHT_RESIDUAL = "fast_weight_residual"  # moving at a from-scratch pace, against its parent
    SGD_MOMENTUM = "sgd_momentum"
    ADAM_SECOND_MOMENT = "adam_second_moment"
    ADAM_FIRST_MOMENT = "adam_first_moment"  # coded against its second moment's plan, so planned after


def is_first_moment(ctx: PlanContext, path: str) -> bool:
    """Adam's first moment: planned in a second pass, once every second moment has its plan."""
    return ctx.optimizer_role(path)[0] == "exp_avg"


def classify(ctx: PlanContext, path: str, raw: RawTensor) -> tuple[Role, Subject]:
    """The tensor's role, with what the classification measured for its planner."""
    role, slot = ctx.optimizer_role(path)
    if path in ctx.keep_exact:
        return Role.LOSSLESS, Subject(path, raw, slot)
    if role is None:
        return _unowned(ctx, path, raw)
    if role == "weight":
        if not ctx.level.weights_lossy:
            return Role.LOSSLESS, Subject(path, raw, slot)
        return _weight(ctx, Subject(path, raw, slot, importance=_importance(ctx, slot)))
    if role == "momentum_buffer":
        if slot.other_state:  # another optimizer's buffer (RMSprop's): SGD's bound does not hold for it
            return Role.LOSSLESS, Subject(path, raw, slot)
        return _sgd_momentum(ctx, Subject(path, raw, slot))
    if slot.foreign_moments:  # Adan's, Adafactor's: a bound worked out for Adam's update does not hold
        return Role.LOSSLESS, Subject(path, raw, slot)
    if role == "exp_avg_sq":
        return _second_moment(ctx, Subject(path, raw, slot))
    return _first_moment(ctx, Subject(path, raw, slot))


def _importance(ctx: PlanContext, slot: ParamSlots) -> str | None:
    """The second moment whose values weigh a weight's entries (extreme's pruning): Adam's v, when it can be read."""
    v = slot.exp_avg_sq
    certain = ctx.optimizer.certain and v is not None and v in ctx.tensors
    return v if certain and ctx.tensors[v].dtype in LOSSY_DTYPES else None


def _unowned(ctx: PlanContext, path: str, raw: RawTensor) -> tuple[Role, Subject]:
    """A tensor no optimizer parameter claims: a weight when the pairing is uncertain, else lossless.

    With the pairing uncertain, any tensor may be a trained weight; it is planned from its own
    statistics alone (no second moment to judge its importance). Step counters never are, nor
    other optimizers' state (RMSprop's square_avg, Adagrad's sum: their bounds are not a weight's),
    nor buffers told by their names (orthogonal's base: a step off it is no longer orthogonal).
    """
    subject = Subject(path, raw)
    if (ctx.optimizer.certain or not ctx.level.weights_lossy or path.endswith(("/step", "step"))
            or path in ctx.optimizer_state or is_buffer(path, raw.shape)):
        return Role.LOSSLESS, subject
    return _weight(ctx, subject)


def _weight(ctx: PlanContext, subject: Subject) -> tuple[Role, Subject]:
    """Which weight role: lossless when small, a bias or norm weight, zero or whole numbers, else by pace and parent.

    Whole numbers (a mask) stay exact whether or not an optimizer trains them: a step would change a mask's values.
    """
    path, raw = subject.path, subject.raw
    if (len(raw.shape) < 2 or _BIAS_OR_NORM.search(path)
            or not eligible(raw, ctx.level, elements=ctx.elements.get(path)) or whole_numbers(raw)):
        return Role.LOSSLESS, subject
    weight_rms = ctx.rms_of(path)
    if weight_rms == 0.0:
        return Role.LOSSLESS, subject
    base = temporal_base(ctx.parents.get(path), raw, WEIGHT_BASE_CODECS, ctx.level.max_chain)
    subject = Subject(path, raw, subject.slot, weight_rms, base, subject.importance)
    if ctx.fast(path, raw, weight_rms):
        return (Role.FAST_WEIGHT_KEYFRAME if base is None else Role.FAST_WEIGHT_RESIDUAL), subject
    if base is not None:
        return Role.WEIGHT_RESIDUAL, subject
    return (Role.FROZEN_WEIGHT if ctx.untrained(raw) else Role.WEIGHT_KEYFRAME), subject


def _sgd_momentum(ctx: PlanContext, subject: Subject) -> tuple[Role, Subject]:
    """Lossy from the smallest moment size on, unless all zero (no scale to set a step by)."""
    if eligible(subject.raw, ctx.level, ctx.moment_min, ctx.elements.get(subject.path)):
        momentum_rms = ctx.rms_of(subject.path)
        if momentum_rms > 0:
            return Role.SGD_MOMENTUM, Subject(subject.path, subject.raw, subject.slot, momentum_rms)
    return Role.LOSSLESS, subject


def _second_moment(ctx: PlanContext, subject: Subject) -> tuple[Role, Subject]:
    """Lossy from the smallest moment size on, where its first moment will be coded against it.

    Only the first moment's codec bounds the restored update m / sqrt(v): beside an exact m, a v on
    the level's grid moved the update by up to the grid's factor (2.7x `max_update_error` at extreme),
    unmeasured. So v is lossless wherever m will be: kept exact, or of another item size or shape
    (their chunks must line up; a factored second moment, Adafactor's rows, has another shape).
    Not with amsgrad: its max_exp_avg_sq stays exact, and a v restored above it (half the entries,
    up to 4x at balanced) would raise the max for good on the first step resumed.
    """
    slot: ParamSlots | None = subject.slot
    big = eligible(subject.raw, ctx.level, ctx.moment_min, ctx.elements.get(subject.path))
    if big and slot is not None and _codable_first_moment(ctx, slot.exp_avg, subject.raw) and not slot.amsgrad:
        return Role.ADAM_SECOND_MOMENT, subject
    return Role.LOSSLESS, subject


def _codable_first_moment(ctx: PlanContext, first: str | None, second: RawTensor) -> bool:
    """Whether the first moment `first` can be coded against this second moment: present, not kept exact, lined up."""
    m = ctx.tensors.get(first) if first is not None else None
    return (m is not None and first not in ctx.keep_exact and m.itemsize == second.itemsize
            and m.shape == second.shape)


def _first_moment(ctx: PlanContext, subject: Subject) -> tuple[Role, Subject]:
    """Lossy where its second moment is (planned only where the two line up: `_second_moment`)."""
    second = subject.slot.exp_avg_sq if subject.slot is not None else None
    if second in ctx.plans:
        return Role.ADAM_FIRST_MOMENT, subject
    return Role.LOSSLESS, subject
