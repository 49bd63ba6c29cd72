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
        with _buffer_slots_kept(model):
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
    touching the caller's model. Values are written in place, so that aliases and views of a tensor
    see them too, and put back from host copies, even on error (_saved); a buffer that refuses
    writes (an expanded view, an inference tensor) is swapped by binding its slots instead.
    """
    import torch

    named = dict(model.named_parameters())
    saved = _saved(model)
    was_training = model.training
    model.eval()
    bound: list[tuple[Any, str, Any]] = []
    try:
        with torch.no_grad(), _buffer_slots_kept(model):
            buffers = dict(model.named_buffers())
            values = {name: value.reshape(buffers[name].shape).to(buffers[name].device, buffers[name].dtype)
                      for name, value in weights.items() if name not in named and name in buffers}
            for name in weights.keys() & named.keys():
                named[name].copy_(weights[name].reshape(named[name].shape))
            for name, value in values.items():
                _write_or_bind(model, buffers[name], value, bound, saved)
            return finite_loss(calling(loss_fn, model))
    finally:
        for module, leaf, tensor in bound:
            module._buffers[leaf] = tensor
        _put_back(model, saved)
        model.train(was_training)


def model_tensors(model: Any) -> dict[str, Any]:
    """A model's parameters and buffers by name: a level may quantize a float buffer (a fixed projection) too."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def _write_or_bind(model: Any, tensor: Any, value: Any, bound: list[tuple[Any, str, Any]],
                   saved: dict[str, tuple[Any, int, Any]]) -> None:
    """`value` into buffer `tensor` in place, its values kept in `saved` first (as _saved keeps them).

    Where it refuses writes, every slot holding it is bound to `value`; each such slot, and the
    tensor it held, goes to `bound`, to bind back.
    """
    if not tensor.is_inference():  # an inference tensor is written in inference mode only
        saved.setdefault(f"buffer {id(tensor)}", (tensor, tensor._version, tensor.detach().to("cpu", copy=True)))
        try:
            tensor.copy_(value)
            return
        except RuntimeError:  # an expanded view: one element at several places
            pass
    for _, module in model.named_modules(remove_duplicate=False):
        for leaf, held in list(module._buffers.items()):
            if held is tensor:
                bound.append((module, leaf, tensor))
                module._buffers[leaf] = value


@contextmanager
def _buffer_slots_kept(model: Any) -> Iterator[None]:
    """Buffer slots as they were: one empty (None) or absent before the block is so again after.

    A cache forward fills from the values it sees (an inverse of a restored projection) must not
    stay for the model's next forward; a slot forward replaced (a mask it grew) keeps its new tensor.
    """
    empty = [(module, leaf) for _, module in model.named_modules(remove_duplicate=False)
             for leaf, tensor in module._buffers.items() if tensor is None]
    keys = {id(module): (module, set(module._buffers)) for _, module in model.named_modules(remove_duplicate=False)}
    try:
        yield
    finally:
        for module, leaf in empty:
            module._buffers[leaf] = None
        for module, before in keys.values():
            for leaf in set(module._buffers) - before:
                del module._buffers[leaf]


def _persistent_buffers(model: Any) -> dict[str, Any]:
    """The buffers a state dict holds (not caches: non-persistent ones are forward's to rebuild), once each."""
    from torch.nn.parameter import is_lazy

    found: dict[str, Any] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for leaf, tensor in module._buffers.items():
            if tensor is None or leaf in module._non_persistent_buffers_set or is_lazy(tensor) or id(tensor) in seen \
                    or tensor.is_inference():  # written in inference mode only: not by a calibration function
                continue
            seen.add(id(tensor))
            found[f"{prefix}.{leaf}" if prefix else leaf] = tensor
    return found


def _saved(model: Any) -> dict[str, tuple[Any, int, Any]]:
    """Every parameter's and persistent buffer's values (loss_fn may change any), kept in host memory.

    On a GPU, not a second model there. By name: (the tensor, its version counter, its values).
    """
    tensors = {**_persistent_buffers(model), **dict(model.named_parameters())}
    return {name: (tensor, tensor._version, tensor.detach().to("cpu", copy=True)) for name, tensor in tensors.items()}


def _put_back(model: Any, saved: dict[str, tuple[Any, int, Any]]) -> None:
    """The values as they were before the calibration function ran, into each tensor written since."""
    import torch

    with torch.no_grad():
        for tensor, version, value in saved.values():
            if tensor._version != version:
                tensor.copy_(value)


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
