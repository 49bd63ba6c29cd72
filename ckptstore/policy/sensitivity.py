"""Measured loss sensitivity: what quantization noise in each weight matrix costs on a calibration batch.

Given the live model and a function computing its loss on a fixed batch, each matrix's sensitivity
is the mean squared gradient of that loss over its entries: the empirical Fisher information, which
for a likelihood loss estimates the Hessian's diagonal, the loss a unit of squared quantization
error costs there. It is what Adam's second moment averages over many batches, so a calibration
batch matters most where there is no second moment (SGD). Estimating the Hessian directly was
tried and dropped: finite differences drown in rounding on a bfloat16 model, and Hutchinson's
z^T H z with 4 probes disagreed 2-4x between seeds and came out negative for a third of the
matrices (docs/benchmarks.md). The model's weights, buffers, gradients and train/eval mode are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
        with _buffers_of_the_call(model, {}):
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
    touching the caller's model: parameters are swapped in place and restored, even on error;
    buffers are the call's own (_buffers_of_the_call), a quantized one's restored values among them.
    """
    import torch

    named = dict(model.named_parameters())
    saved = _saved(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _buffers_of_the_call(model, {n: w for n, w in weights.items() if n not in named}):
            for name in weights.keys() & named.keys():
                named[name].copy_(weights[name].reshape(named[name].shape))
            return finite_loss(calling(loss_fn, model))
    finally:
        _put_back(model, saved)
        model.train(was_training)


def model_tensors(model: Any) -> dict[str, Any]:
    """A model's parameters and buffers by name: a level may quantize a float buffer (a fixed projection) too."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


@contextmanager
def _buffers_of_the_call(model: Any, values: dict[str, Any]) -> Iterator[None]:
    """Every buffer slot of `model` bound, for the block, to a tensor of the call's own; the model's own after.

    A buffer `values` names gets its restored value (every module holding that tensor sees it), the
    others a copy. Nothing is written into the model's buffers, so none can fail or be left changed: forward may
    update them in place (a quantization observer's statistics), replace or grow them (a mask
    cache); they may be expanded views or inference tensors. A plain attribute holding a view of a
    buffer is no slot, and keeps reading the model's own.
    """
    import torch

    slots = [(module, leaf, tensor) for _, module in model.named_modules(remove_duplicate=False)
             for leaf, tensor in module._buffers.items() if tensor is not None]
    current = dict(model.named_buffers())
    own: dict[int, Any] = {}
    with torch.no_grad():  # every tensor made before any is bound: a failure leaves the model as it was
        for name in values.keys() & current.keys():
            old = current[name]
            own[id(old)] = values[name].reshape(old.shape).to(old.device, old.dtype)
        for _, _, tensor in slots:
            if id(tensor) not in own:
                own[id(tensor)] = tensor.clone()
    try:
        for module, leaf, tensor in slots:
            module._buffers[leaf] = own[id(tensor)]
        yield
    finally:
        for module, leaf, tensor in slots:
            module._buffers[leaf] = tensor


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
