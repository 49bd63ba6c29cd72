"""Measured loss sensitivity: what quantization noise in each weight matrix costs on a calibration batch.

Given the live model and a function computing its loss on a fixed batch, each matrix's sensitivity
is the mean squared gradient of that loss over its entries: the empirical Fisher information, which
for a likelihood loss estimates the Hessian's diagonal, the loss a unit of squared quantization
error costs there. It is what Adam's second moment averages over many batches, so a calibration
batch matters most where there is no second moment (SGD). Estimating the Hessian directly was
tried and dropped: finite differences drown in rounding on a bfloat16 model, and Hutchinson's
z^T H z with 4 probes disagreed 2-4x between seeds and came out negative for a third of the
matrices (docs/benchmarks.md). The model's weights, gradients and train/eval mode are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ckptstore.errors import CkptError


def measure_fisher(model: Any, loss_fn: Callable[[Any], Any]) -> dict[str, float]:
    """Per parameter name (floating matrices that require grad), the mean squared gradient entry.

    `loss_fn(model)` returns the loss on a fixed calibration batch as a one-element tensor; the
    model is in eval mode while it runs, and the gradients go to a separate buffer, not `.grad`.
    """
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and p.is_floating_point() and p.requires_grad]
    if not named:
        return {}
    saved = _saved(model)
    was_training = model.training
    model.eval()
    try:
        loss = calling(loss_fn, model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CkptError("the calibration function must return the loss as a one-element tensor")
        if not torch.isfinite(loss.detach()).all():
            if not all(torch.isfinite(p.detach()).all() for p in model.parameters()):
                return {}  # a diverged model: its checkpoint is committed lossless, steered by nothing
            raise CkptError(f"the calibration loss is not finite ({float(loss.detach())}); "
                            "sensitivity cannot be measured")
        try:
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        except RuntimeError as exc:  # the loss was computed without a graph (torch.no_grad, a detached copy)
            raise CkptError(f"sensitivity needs the calibration loss's gradients, and torch found none ({exc}); "
                            "compute the loss with gradients enabled") from None
    finally:
        model.train(was_training)
        _put_back(model, saved)
    return {name: float(g.double().pow(2).mean()) for (name, _), g in zip(named, grads) if g is not None}


def step_factors(scores: dict[str, float]) -> dict[str, float]:
    """Per tensor, how much coarser (>1) or finer (<1) than the level's step to quantize it.

    `scores` is each tensor's loss per unit of relative squared error (Fisher times RMS^2):
    at equal total loss, bits go furthest with steps proportional to 1 / sqrt(score). The factors
    keep the geometric mean at 1 and are clamped to [1/8, 8].
    """
    scores = {path: s for path, s in scores.items() if s > 0}
    if not scores:
        return {}
    center = math.exp(sum(math.log(s) for s in scores.values()) / len(scores))
    return {path: min(8.0, max(1 / 8, math.sqrt(center / s))) for path, s in scores.items()}


def loss_with_weights(model: Any, loss_fn: Callable[[Any], Any], weights: dict[str, Any]) -> float:
    """`loss_fn(model)` with some parameters or buffers replaced by `weights` (name -> torch tensor), then put back.

    How a lossy commit measures what its reconstruction costs on the calibration batch without
    touching the caller's model: parameters are swapped in place and restored, even on error; a
    buffer (a fixed projection a level quantized) is swapped by rebinding it to the restored values
    and bound again to the model's own tensor after: a buffer may be replaced, grown or an expanded
    view by the time the loss is computed, and nothing is written into it.
    """
    import torch

    named = dict(model.named_parameters())
    saved = _saved(model)
    was_training = model.training
    model.eval()
    buffers: dict[str, Any] = {}
    try:
        with torch.no_grad():
            for name in weights.keys() & named.keys():
                named[name].copy_(weights[name].reshape(named[name].shape))
            buffers = _rebind_buffers(model, {n: w for n, w in weights.items() if n not in named})
            return finite_loss(calling(loss_fn, model))
    finally:
        _bind_back(model, buffers)
        _put_back(model, saved)
        model.train(was_training)


def model_tensors(model: Any) -> dict[str, Any]:
    """A model's parameters and buffers by name: a level may quantize a float buffer (a fixed projection) too."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def _rebind_buffers(model: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Bind each buffer named in `values` to its value (on the buffer's device, in its dtype).

    Returns the tensors they were bound to, for _bind_back.
    """
    current = dict(model.named_buffers())
    before = {}
    for name in values.keys() & current.keys():  # one set to None since has nothing to swap
        old = current[name]
        before[name] = old
        _bind(model, name, values[name].reshape(old.shape).to(old.device, old.dtype))
    return before


def _bind_back(model: Any, before: dict[str, Any]) -> None:
    """The buffers _rebind_buffers swapped, bound to the model's own tensors again (whatever loss_fn made of them)."""
    for name, tensor in before.items():
        _bind(model, name, tensor)


def _bind(model: Any, name: str, tensor: Any) -> None:
    prefix, _, leaf = name.rpartition(".")
    model.get_submodule(prefix)._buffers[leaf] = tensor


def _saved(model: Any) -> dict[str, Any]:
    """Every parameter's values (loss_fn may change any), kept in host memory: on a GPU, not a second model there."""
    return {name: value.detach().to("cpu", copy=True) for name, value in model.named_parameters()}


def _put_back(model: Any, saved: dict[str, Any]) -> None:
    """The parameters' values as they were before the calibration function ran."""
    import torch

    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            named[name].copy_(value)


def calling(calibration: Callable[[Any], Any], argument: Any) -> Any:
    """`calibration(argument)`; a failure in the user's code says so (it is no ckptstore bug)."""
    try:
        return calibration(argument)
    except Exception as exc:
        name = getattr(calibration, "__qualname__", repr(calibration))
        raise CkptError(f"the calibration function {name} raised {type(exc).__name__}: {exc}") from exc


def finite_loss(loss: Any) -> float:
    """A calibration function's result as a float: a number or a one-element tensor, and finite."""
    try:
        if isinstance(loss, str | bytes | bytearray | bool):  # float() reads "1.5" and True: no loss
            raise TypeError
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
    except (TypeError, ValueError, RuntimeError):
        raise CkptError(f"the calibration function must return a loss (a number or a one-element tensor), "
                        f"not {type(loss).__name__}") from None
    if not math.isfinite(value):
        raise CkptError(f"the calibration loss is not finite ({value})")
    return value
