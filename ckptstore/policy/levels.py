"""Lossy levels: named presets over explicit knobs that users can also set one by one."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ckptstore.errors import CkptError


@dataclass(frozen=True)
class LossyLevel:
    """What a lossy commit may change, and by how much.

    Steps for weights are fractions of each tensor's RMS (keyframe and residual); the first moment
    is quantized as m / sqrt(v) with `moment_step`; the second moment keeps `v_levels_log2` bits
    per octave (2 means steps of a quarter octave). `prune` (0 = off) prunes weight residuals whose
    estimated loss impact, |dW|^2 * sqrt(v), is in the lowest fraction; the moments of pruned
    entries are then rebuilt from the parent or dropped to zero. `max_chain` bounds lossy residual
    chains (each level decodes in one pass, so they may be longer than lossless ones).
    `relative_step` caps a weight residual's step at that fraction of the residual's RMS, so the
    small updates of a fine-tune are kept rather than rounded away; with `fine_drift` (> 0) only
    weights that moved less than that fraction of their RMS since the parent are capped (a
    fine-tune's weights move ~0.1% of their spread per checkpoint, a from-scratch run's several
    percent). `settled_step` (> 0) replaces relative_step once the parent's reconstruction error
    is below the movement (a keyframe's error is refined at relative_step first).
    `fine_grid` keeps that refined step for the rest of the chain: once a fine-tune's residual has
    refined the keyframe's error, later residuals quantize on the same lattice, so entries that did
    not move (embedding rows of unseen tokens, most of a fine-tune) cost nothing and the error
    stays below half that step; without it each residual refines the error again at
    settled_step or relative_step, paying bits for entries that never moved.
    `fine_moment_step` (> 0) is the first moment's step where its weight's residual step was
    capped that way: a fine-tune's next updates move the weights by as much as its whole run so
    far, so its moments need more precision than a from-scratch run's. `fine_v_levels_log2`
    (not None) is, for the same reason, the second moment's grid for weights that are not fast-moving
    (a whole tensor's choice, where `fine_moment_step` is a chunk's).
    `frozen_step` (< 1) scales the keyframe step of a weight whose shape no optimizer state has:
    the optimizer does not train it (a frozen backbone), so it is stored once for the whole run
    (later commits reuse it while it is unchanged) and its error is never corrected; a finer step
    is paid for once. The loss moves to first order in that error (the backbone is not at an
    optimum of the new task's loss), so `balanced` takes 1/16.
    `fast_move` (> 0) marks a weight as fast-moving where its learning rate is at least that
    fraction of its RMS (an Adam step moves each entry by up to about lr: a from-scratch run moves
    ~3% of the RMS per step, a fine-tune ~0.1%); such weights take `fast_keyframe_step` and
    `fast_residual_step` (when > 0) instead: their error is overtaken within a few steps of
    training, while a fine-tune keeps a keyframe's error for hundreds. They also round to nearest
    (a dead zone would make them lag behind training) and, with a fast residual step, skip the
    fine-tune cap (relative_step) however little they moved. Adam-family optimizers only (SGD's
    step is lr times its momentum, not lr).
    `moment_min_elements` is the smallest optimizer moment quantized (`min_elements` for weights):
    the moments of biases and norms then follow the level too, unless tensors that small hold over
    5% of the optimizer state (a probe on a frozen backbone, adapters), where they stay lossless.
    `fisher_allocation` scales each weight's step by its estimated Fisher information (from Adam's
    second moment), spending bits where the loss is sensitive. `codebooks` lets each chunk of a
    weight (or SGD momentum) take a fitted non-uniform codebook instead of the uniform levels
    where that is smaller at no larger error (codecs/codebook.py); off in the presets, since on
    the benchmark runs it never won a chunk and the trials slowed encoding (docs/benchmarks.md).
    Weights smaller than `min_elements`, one-dimensional weights (biases, norms) and integer
    tensors are always lossless.
    `max_weight_error` (> 0) is the bound the encoder enforces on every quantized weight matrix,
    whatever the rules above chose: its relative error ||W' - W|| / ||W|| times the weight's
    allowance (its step factor, clamped to [1/2, 2]: coarser where the loss is less sensitive).
    `max_update_error` (> 0) bounds Adam's restored update m / sqrt(v) the same way, and SGD's
    momentum. The writer measures each chunk it wrote and encodes it again at a finer step until
    it holds (policy/fidelity.py); `ckpt show` prints the measured figures against the bounds.
    `promised_loss_change` is the relative change of a restored checkpoint's loss the level is
    meant to keep (measured on the benchmark zoo); a commit with a calibration function enforces
    it on the user's data (repo/calibrate.py).
    """

    name: str
    weights_lossy: bool = True
    weight_keyframe_step: float = 1 / 64
    weight_residual_step: float = 1 / 64
    weight_rounding: float = 0.5
    moment_step: float = 1 / 16
    moment_rounding: float = 0.5
    v_levels_log2: int = 2
    prune: float = 0.0
    embedding_factor: float = 0.5
    min_elements: int = 4096
    moment_min_elements: int = 4096
    max_chain: int = 8
    fisher_allocation: bool = True
    relative_step: float = 0.5
    fine_drift: float = 0.0
    settled_step: float = 0.0
    fine_moment_step: float = 0.0
    fine_v_levels_log2: int | None = None
    codebooks: bool = False
    frozen_step: float = 1.0
    fast_move: float = 0.0
    fast_keyframe_step: float = 0.0
    fast_residual_step: float = 0.0
    fine_grid: bool = False
    max_weight_error: float = 0.0
    max_update_error: float = 0.0
    promised_loss_change: float | None = None

    def __post_init__(self) -> None:
        for knob in fields(self):
            value = getattr(self, knob.name)
            normal = _knob_value(knob.name, str(knob.type), value)
            if normal is _WRONG:
                raise CkptError(f"lossy knob {knob.name}={value!r}: expected {_expected(knob.name, str(knob.type))}")
            object.__setattr__(self, knob.name, normal)  # numpy scalars and 1e4 as the plain numbers they stand for

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


_FRACTIONS = ("weight_rounding", "moment_rounding", "prune")
# steps and scales of a step: 0 would divide by zero, where other knobs at 0 mean "off"
_POSITIVE = ("weight_keyframe_step", "weight_residual_step", "moment_step", "embedding_factor", "frozen_step")
# a v grid from 64 octaves per level (float32 spans 277) to 4096 levels per octave (past float32's 23 bits)
_LOG2_RANGE = (-6, 12)
_WRONG = object()


def _expected(name: str, kind: str) -> str:
    if kind.startswith("bool"):
        return "true or false"
    if kind.startswith("int"):
        return f"an integer from {_LOG2_RANGE[0]} to {_LOG2_RANGE[1]}" if name.endswith("log2") else "an integer >= 0"
    if name in _POSITIVE:
        return "a finite number > 0"
    return "a number in [0, 1]" if name in _FRACTIONS else "a finite number >= 0"


def _knob_value(name: str, kind: str, value: Any) -> Any:
    """`value` as knob `name` (of annotated type `kind`) holds it, or _WRONG when it is of the wrong kind or range."""
    if value is None and "None" in kind or name == "name":
        return value
    if kind.startswith("bool"):
        return bool(value) if isinstance(value, (bool, numbers.Integral)) and value in (0, 1) else _WRONG
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return _WRONG
    if kind.startswith("int"):  # octaves (log2) may be negative: coarser
        whole = value == int(value) and (_LOG2_RANGE[0] <= value <= _LOG2_RANGE[1] if name.endswith("log2")
                                         else value >= 0)
        return int(value) if whole else _WRONG
    in_range = value > 0 if name in _POSITIVE else value >= 0 and (name not in _FRACTIONS or value <= 1)
    return float(value) if in_range else _WRONG


LEVELS: dict[str, LossyLevel] = {
    # Calibrated on the benchmark suite's runs (docs/benchmarks.md): python -m bench.lossy_sweep RUN LEVEL.
    # The bounds (max_weight_error, max_update_error) cap whatever the rules chose; checked on the
    # zoo's held-back runs, which played no part in choosing them (python -m bench.zoo).
    "optimizer": LossyLevel("optimizer", weights_lossy=False, moment_step=1 / 4, v_levels_log2=0,
                            promised_loss_change=0.0),
    "balanced": LossyLevel("balanced", weight_keyframe_step=0.09, weight_residual_step=0.12, moment_step=4.0,
                           v_levels_log2=-2, prune=0.0, relative_step=0.2, fine_drift=0.01, settled_step=1.0,
                           fine_grid=True, fine_moment_step=0.8, fast_move=0.005, fast_keyframe_step=0.4,
                           fast_residual_step=0.2, moment_min_elements=1, frozen_step=1 / 16,
                           max_weight_error=0.02, max_update_error=1.0, promised_loss_change=0.0025),
    # Stores fast-moving weights coarsely on the assumption that training continues and overtakes
    # the error: a restored checkpoint resumes well but may evaluate worse than the original, so it
    # promises nothing about the restored loss and enforces no bound (balanced's rules, unbounded).
    "resume-only": LossyLevel("resume-only", weight_keyframe_step=0.09, weight_residual_step=0.12, moment_step=4.0,
                              v_levels_log2=-2, prune=0.0, relative_step=0.2, fine_drift=0.01, settled_step=1.0,
                              fine_grid=True, fine_moment_step=0.8, fast_move=0.005, fast_keyframe_step=0.4,
                              fast_residual_step=0.2, moment_min_elements=1, frozen_step=1 / 16),
    "extreme": LossyLevel("extreme", weight_keyframe_step=0.2, weight_residual_step=0.25,
                          moment_step=12.0, moment_rounding=0.4, v_levels_log2=-3, prune=0.6, fine_drift=0.01,
                          settled_step=2.0, fine_grid=True, fine_moment_step=4.0, fine_v_levels_log2=-2,
                          fast_move=0.005, fast_keyframe_step=1.0, fast_residual_step=0.6, moment_min_elements=1,
                          max_weight_error=0.035, max_update_error=1.0, promised_loss_change=0.01),
}


def check_knobs(given: Iterable[str] | Mapping[str, Any]) -> None:
    """Refuse a name that is no lossy knob, saying the nearest, and (given values) a value no level takes.

    Also `ckpt commit --knob`'s check of what was typed, before the level is known.
    """
    knobs = sorted(f.name for f in fields(LossyLevel) if f.name != "name")  # the level's own name is no knob
    unknown = sorted(set(given) - set(knobs))
    if unknown:
        close = difflib.get_close_matches(unknown[0], knobs, n=1)
        raise CkptError(f"unknown lossy knob {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + "; the knobs are listed in docs/reference.md#lossy-knobs")
    if isinstance(given, Mapping):
        replace(next(iter(LEVELS.values())), **given)  # each value checked as any level checks it (__post_init__)


def level_named(name: str | LossyLevel | None, /, **overrides: Any) -> LossyLevel | None:
    """The preset called `name` (None: lossless), with any knobs overridden."""
    if name is None or name in ("", "none", "lossless"):
        if overrides:
            raise CkptError("lossy knobs were given without a lossy level")
        return None
    if not isinstance(name, LossyLevel) and name not in LEVELS:
        raise CkptError(f"unknown lossy level {name!r}; choose one of none, {', '.join(LEVELS)}")
    check_knobs(overrides)
    return replace(name if isinstance(name, LossyLevel) else LEVELS[name], **overrides)
