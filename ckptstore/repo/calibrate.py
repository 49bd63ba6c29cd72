"""A lossy commit's measured guarantee: the restored checkpoint's loss on the user's calibration data.

After encoding, the commit rebuilds what checkout will return, evaluates the calibration function
on it and on the original, and while the relative change exceeds `max_loss_change` encodes again
with the weights' steps and error bound halved; the last attempt keeps the weights lossless (as
the `optimizer` level does). The change is recorded in the commit's metrics (CALIBRATION_METRIC,
in percent), so `ckpt log` and `ckpt show` display it. Objects of a discarded attempt are
garbage for gc.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CkptError
from ckptstore.hashing import object_id
from ckptstore.policy import LossyLevel
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay
from ckptstore.state import RawTensor, readable_path
from ckptstore.warn import warn_caller

if TYPE_CHECKING:
    from ckptstore import formats
    from ckptstore.repo.repository import Repository

CALIBRATION_METRIC = "ckpt.calibration_loss_change_pct"
ATTEMPTS = 5  # four halvings of the weights' steps, then lossless weights


@dataclass
class LossGuard:
    """The calibration loss of the original checkpoint, and how to measure it with restored tensors."""

    loss_with: Callable[[Mapping[str, RawTensor]], list[float]]  # restored tensors by path -> a loss per copy
    original: float
    max_change: float

    def change(self, restored: Mapping[str, RawTensor]) -> float:
        """The relative change of the loss with `restored` in place of the original tensors.

        The largest of the model's copies in the checkpoint (its own and an EMA's just made, say). An original
        loss too small for float64 to show a relative change (0, subnormal) allows only the same loss.
        """
        if abs(self.original) < sys.float_info.min:
            return max(0.0 if loss == self.original else math.inf for loss in self.loss_with(restored))
        return max(((loss - self.original) / abs(self.original) for loss in self.loss_with(restored)), key=abs)

    def holds(self, change: float) -> bool:
        return abs(change) <= self.max_change


def loss_guard(calibration: Callable[[Any], Any] | None, model: Any, max_change: float | None,
               level: LossyLevel | None, checkpoint: formats.Checkpoint) -> LossGuard | None:
    """The guard of a lossy commit given a calibration function (None without one, or for a diverged checkpoint).

    With the live `model`, `calibration(model)` is evaluated with the restored weights swapped in;
    without it, `calibration(state)` receives the whole restored checkpoint as `ckptstore.load` gives it.
    """
    if calibration is None or level is None:
        if max_change is not None:
            raise CkptError("--max-loss-change needs a lossy level and a calibration function")
        return None
    if max_change is not None and not (isinstance(max_change, numbers.Real) and not isinstance(max_change, bool)
                                       and max_change >= 0):  # NaN fails >= too
        raise CkptError(f"max_loss_change={max_change!r}: give a fraction of the loss, 0 or more (0.001 = 0.1%)")
    limit = level.promised_loss_change if max_change is None else max_change
    if limit is None:
        raise CkptError(f"level {level.name} promises no loss change: give one (--max-loss-change, max_loss_change=)")
    from ckptstore.codecs.floats import first_with_nan, holds_non_finite

    if first_with_nan(checkpoint.tensors) is not None:  # a diverged run's checkpoint is kept lossless: no loss to guard
        return None
    loss_with = _model_loss(calibration, model, checkpoint) if model is not None else _state_loss(
        calibration, checkpoint)
    try:
        original = loss_with({})[0]  # the checkpoint's own values: its copies hold the same ones
    except CkptError as exc:  # an infinite weight's loss: the level keeps the checkpoint lossless where it quantizes it
        infinite = next((p for p, raw in checkpoint.tensors.items() if holds_non_finite(raw.dtype, raw.data)), None)
        if infinite is None:
            raise
        warn_caller(f"{exc}, and the checkpoint holds infinite values ({readable_path(infinite)}): committed without "
                    "the loss guard, lossless where the level would quantize them", RuntimeWarning)
        return None
    if abs(original) < sys.float_info.min:  # a floor in its place recorded an absolute change as a share of it
        warn_caller(f"the calibration loss of the checkpoint is {original!r}, too small for a relative change: only "
                    "the same loss is within the limit (the weights may be stored lossless); give a loss that is not "
                    "0 there (a cross-entropy, or the loss plus a constant)", RuntimeWarning)
    return LossGuard(loss_with, original, limit)


def _model_loss(calibration: Callable[[Any], Any], model: Any,
                checkpoint: formats.Checkpoint) -> Callable[[Mapping[str, RawTensor]], list[float]]:
    from ckptstore.policy.livenames import checkpoint_paths, tied_paths
    from ckptstore.policy.sensitivity import loss_with_weights, model_tensors

    named = model_tensors(model)  # buffers too: a level may quantize a float matrix the model only reads
    found = checkpoint_paths(model, named, checkpoint.tensors)  # as the model or one it wraps names them
    path_of = found.paths
    if found.doubled:  # measuring one copy would leave the other's quantization unmeasured, or the wrong one measured
        name, paths = next(iter(found.doubled.items()))
        raise CkptError(f"model=: its {name!r} matches {len(paths)} tensors of the checkpoint "
                        f"({', '.join(map(readable_path, paths[:3]))}), none holding its values, so the loss guard "
                        "cannot tell which it measures; pass the model as it was when the checkpoint was saved")
    if named and not path_of:  # else every measurement would be the original's: a change of 0, whatever was stored
        raise CkptError(f"model=: none of its parameters or buffers ({next(iter(named))!r}, ...) names one tensor of "
                        "the checkpoint, or its names and those of the model it wraps match two copies alike (the "
                        "model's and an EMA's?); pass the model the checkpoint was saved from")
    if path_of and not found.holding:
        name = next(iter(path_of))
        warn_caller(f"model=: none of the checkpoint's tensors its names match holds its values, in any dtype "
                    f"({name!r} is {readable_path(path_of[name])}): the loss guard measures the checkpoint's own "
                    "values there; if those are a copy's (an EMA's), pass the model the checkpoint was saved from",
                    RuntimeWarning)

    # the model's copies in the checkpoint (its own and an EMA's just made hold the same values, coded apart; a tied
    # weight's names, cloned apart): each measured, the k-th copy of every name in the k-th measurement
    copies = dict(found.copies)
    for name, aliases in tied_paths(model, named, path_of, checkpoint.tensors).items():
        copies[name] = list(dict.fromkeys([*copies.get(name, [path_of[name]]), *aliases]))
    each_copy = [{name: copies[name][min(k, len(copies[name]) - 1)] if name in copies else path
                  for name, path in path_of.items()} for k in range(max(map(len, copies.values()), default=1))]

    def loss_with(restored: Mapping[str, RawTensor]) -> list[float]:
        # nothing restored, every copy holds the same values: one measurement (the original loss) is enough
        return [loss_with_weights(model, calibration, {name: _value_of(checkpoint, restored, path)
                                                       for name, path in paths.items()})
                for paths in (each_copy if restored else each_copy[:1])]

    return loss_with


def _state_loss(calibration: Callable[[Any], Any],
                checkpoint: formats.Checkpoint) -> Callable[[Mapping[str, RawTensor]], list[float]]:
    from ckptstore import formats
    from ckptstore.policy.sensitivity import calling, finite_loss

    def loss_with(restored: Mapping[str, RawTensor]) -> list[float]:
        return [finite_loss(calling(calibration, formats.to_state(
            checkpoint.kind, checkpoint.files, lambda path: _value_of(checkpoint, restored, path))))]

    return loss_with


def _value_of(checkpoint: formats.Checkpoint, restored: Mapping[str, RawTensor], path: str) -> Any:
    """The torch value at `path` for a calibration run: the restored one, else a copy of the checkpoint's own.

    A copy: the calibration function may change what it is given, and a model's buffer may be bound and written;
    the checkpoint's own bytes, not the live model's, which may have moved on since the save.
    """
    from ckptstore.state import materialize

    if path in restored:
        return materialize(restored[path])
    raw = checkpoint.tensors[path]
    return materialize(RawTensor(raw.dtype, raw.shape, raw.data.copy()))


def restored_tensors(repo: Repository, records: Mapping[str, TensorRecord],
                     known: Mapping[str, TensorRecord]) -> dict[str, RawTensor]:
    """What checkout will return for each path of `records` (their chains' records in `known`, by id).

    A new record whose id is already stored gives way to the stored one, as the commit's insert
    does: ids name content, and the new one's chain may run through records that are based on it.
    """
    records = {path: known.get(r.id, r) for path, r in records.items()}
    source = ChainSource(repo.store, {**{r.id: r for r in records.values()}, **known})
    arrays = replay(source, list(records.values()), repo.pool)
    return {path: RawTensor(r.dtype, tuple(r.shape), arrays[r.id]) for path, r in records.items()}


def tighter(level: LossyLevel, attempt: int) -> LossyLevel:
    """The level for retry `attempt` (1, 2, ...): weight steps and bound halved each time, then lossless weights."""
    if attempt >= ATTEMPTS - 1:
        return replace(level, weights_lossy=False)
    scale = 0.5**attempt
    return replace(level, weight_keyframe_step=level.weight_keyframe_step * scale,
                   weight_residual_step=level.weight_residual_step * scale,
                   fast_keyframe_step=level.fast_keyframe_step * scale,
                   fast_residual_step=level.fast_residual_step * scale,
                   max_weight_error=(level.max_weight_error or 0.04) * scale)


def function_named(spec: str) -> Callable[[Any], Any]:
    """The function `MODULE:NAME` (MODULE a module importable from the current folder, or a .py file)."""
    import importlib
    import importlib.util
    from pathlib import Path

    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise CkptError(f"--calibration {spec!r}: expected MODULE:FUNCTION (or path/to/file.py:FUNCTION)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ImportError(f"no file {module_name}")
            # as `python FILE` runs it: its folder on the path (a helper beside it), and a module in
            # sys.modules while it runs (dataclasses look themselves up there), under a name no import takes
            folder = str(path.resolve().parent)
            unique = f"_ckpt_calibration_{path.stem}_{object_id(folder.encode())[:8]}"
            found = importlib.util.spec_from_file_location(unique, path)
            if found is None or found.loader is None:
                raise ImportError(f"{module_name} is no Python module")
            if folder not in sys.path:  # once: a long process (a notebook) commits many times
                sys.path.insert(0, folder)
            module = sys.modules[unique] = importlib.util.module_from_spec(found)
            try:
                found.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(unique, None)  # no half-made module for the next call
                raise
        else:
            if "" not in sys.path:  # the user's folder, as `python -m` does (once: a long process commits often)
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name not in (None, module_name):  # the module itself imports what is missing
            raise CkptError(f"--calibration {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
                            ) from None
        raise CkptError(f"--calibration {spec!r}: cannot import {module_name}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed as it loaded (SyntaxError, sys.exit)
        raise CkptError(f"--calibration {spec!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
                        ) from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise CkptError(f"--calibration {spec!r}: {module_name} has no function {name!r}")
    return function
