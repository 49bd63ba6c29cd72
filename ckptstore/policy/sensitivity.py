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
    from torch.nn.parameter import is_lazy

    named = [(n, p) for n, p in model.named_parameters()
             if not is_lazy(p) and p.dim() >= 2 and p.is_floating_point() and p.requires_grad]
    if not named:
        return {}
    with _model_kept(model):
        model.eval()
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
    touching the caller's model (_model_kept). Values are written in place, so that aliases, views
    and plain attributes holding a tensor see them; a buffer that refuses writes (an expanded view,
    an inference tensor) is bound in every slot holding it instead.
    """
    import torch

    named = dict(model.named_parameters())
    with _model_kept(model) as saved, torch.no_grad():
        buffers = dict(model.named_buffers())
        values = {name: value.reshape(buffers[name].shape).to(buffers[name].device, buffers[name].dtype)
                  for name, value in weights.items() if name not in named and name in buffers}
        for name in weights.keys() & named.keys():
            named[name].copy_(weights[name].reshape(named[name].shape))
        for name, value in values.items():
            _write_or_bind(model, buffers[name], value, saved)
        model.eval()  # after the writes: an eval() override (a LoRA merge) works on the restored weights, as it did
        return finite_loss(calling(loss_fn, model))  # on the original ones the loss is compared with


def model_tensors(model: Any) -> dict[str, Any]:
    """A model's parameters and buffers by name: a level may quantize a float buffer (a fixed projection) too."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


@contextmanager
def _model_kept(model: Any) -> Iterator[dict[int, tuple[Any, Any, tuple[Any, Any]]]]:
    """The model after the block as it was before it; yields the host copies it puts back.

    As it was: each module's mode (the caller sets eval), every buffer and parameter slot bound to
    the tensor it held (an empty one emptied again, one forward added dropped, one forward replaced
    or grew bound back), and the values of every parameter, persistent buffer and gradient, put back
    from host copies into each whatever happened to the others. The copies come by tensor id, for
    the caller to add the tensors it writes. A put-back that fails is raised after the rest, in one
    line with the calibration's own error.

    A calibration function's forward may write buffers in place (a quantization observer's
    statistics, through `.data` or fused ops that move no version counter), replace them, or build
    a cache from the restored values: none of it stays on the live model.
    """
    import torch

    if isinstance(model, torch.jit.ScriptModule):  # its module dicts take no clear(): nothing could be put back
        raise CkptError("model= is a TorchScript module: pass the nn.Module it was scripted from")
    modules = [module for _, module in model.named_modules(remove_duplicate=False)]
    modes = [(module, module.training) for module in modules]  # each its own: a frozen BatchNorm stays in eval
    slots = [(module, dict(module._buffers), dict(module._parameters), dict(module._modules)) for module in modules]
    # gradients mid-accumulation, by copy: a calibration may zero them, accumulate into them or cast them
    grads = [(p, _host_copy(p.grad) if p.grad is not None else None) for p in model.parameters()]
    overridden = any(type(module).train is not torch.nn.Module.train or "train" in vars(module) for module in modules)
    saved = {id(tensor): _host_copy(tensor) for tensor in _kept_tensors(model)}
    running: BaseException | None = None
    try:
        yield saved
    except BaseException as exc:
        running = exc
        raise
    finally:
        problems: list[BaseException] = []
        # values before modes: a train() or eval() override derives from the weights it finds (a fused copy, a
        # LoRA adapter merged in or taken out), and after them again where one may have written into them
        steps = [lambda: _slots_back(slots), lambda: _values_back(saved), lambda: _modes_back(modes)]
        if overridden:
            steps.append(lambda: _values_back(saved))
        steps.append(lambda: _grads_back(grads))
        for step in steps:
            try:
                step()
            except Exception as exc:  # each step on its own: one that fails stops none of the others
                problems.append(exc)
        if problems:
            message = f"the calibration left the model changed where it could not be put back: {problems[0]}"
            if running is None:
                raise CkptError(message) from problems[0]
            if not isinstance(running, Exception):  # a Ctrl-C goes on as it is
                running.add_note(message)
            else:  # one line with both: code that logs str(exc) sees what the calibration left behind
                raise CkptError(f"{running}; and {message}") from running


def _slots_back(slots: list[tuple[Any, ...]]) -> None:
    """Buffer, parameter and submodule slots as they were: forward emptied, added, replaced or grew them."""
    for module, *was in slots:
        for held, before in zip((module._buffers, module._parameters, module._modules), was):
            held.clear()
            held.update(before)


def _values_back(saved: dict[int, tuple[Any, Any, tuple[Any, Any]]]) -> None:
    """Every kept tensor's values, each on its own; the first failure raised after the rest."""
    problem = None
    for tensor, value, (device, dtype) in saved.values():
        try:
            _put_back(tensor, value, device, dtype)
        except RuntimeError as exc:
            problem = problem or exc
    if problem is not None:
        raise problem


def _modes_back(modes: list[tuple[Any, bool]]) -> None:
    """Each module's mode, the model's (first) over all, through train(): an override undoes what its eval() did."""
    model, was_training = modes[0]
    model.train(was_training)
    for module, training in modes:
        if module.training != training:
            module.train(training)


def _grads_back(grads: list[tuple[Any, Any]]) -> None:
    """Each parameter's gradient as it was (None where there was none): the same tensor, with its values."""
    for parameter, kept in grads:
        if kept is None:
            parameter.grad = None
            continue
        grad, value, (device, dtype) = kept
        _put_back(grad, value, device, dtype)
        parameter.grad = grad


def _host_copy(tensor: Any) -> tuple[Any, Any, tuple[Any, Any]]:
    """`tensor`, its values in host memory, and the device and dtype it has now: what _put_back needs."""
    return tensor, tensor.detach().to("cpu", copy=True), (tensor.device, tensor.dtype)


def _put_back(tensor: Any, value: Any, device: Any, dtype: Any) -> None:
    """`value` into `tensor` as it was: in place, or as its data where a calibration changed what it is.

    Resized, cast, moved or expanded: `m.half()`, an observer's first forward, `.data = ...`.
    """
    import torch

    with torch.no_grad():
        if tensor.shape != value.shape or tensor.dtype != dtype or tensor.device != device or _overlapping(tensor):
            tensor.data = value.to(device, dtype, copy=True)  # never the host copy itself: a later write would be in it
        else:
            tensor.copy_(value)


def _kept_tensors(model: Any) -> list[Any]:
    """The parameters, then the persistent buffers, once each: what a calibration must leave as it found them.

    Not caches (non-persistent buffers, forward's to rebuild; their slots are bound back), nor lazy,
    meta, inference or expanded ones, which hold no values to keep or take no write in place.
    """
    from torch.nn.parameter import is_lazy

    found = {}
    for tensor in model.parameters():
        found.setdefault(id(tensor), tensor)
    for _, module in model.named_modules():
        for leaf, tensor in module._buffers.items():
            if tensor is not None and leaf not in module._non_persistent_buffers_set:
                found.setdefault(id(tensor), tensor)
    return [tensor for tensor in found.values() if not (is_lazy(tensor) or tensor.is_meta or tensor.is_inference()
                                                         or _overlapping(tensor))]


def _overlapping(tensor: Any) -> bool:
    """Whether one element sits at several places (an expanded view): no in-place write takes it."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))


def _write_or_bind(model: Any, tensor: Any, value: Any, saved: dict[int, tuple[Any, Any, tuple[Any, Any]]]) -> None:
    """`value` into buffer `tensor` in place, its values in `saved` first.

    Where it refuses writes, `value` is bound instead in every slot holding it (_model_kept binds them back).
    """
    if not tensor.is_inference() and not _overlapping(tensor):
        saved.setdefault(id(tensor), _host_copy(tensor))
        tensor.copy_(value)
        return
    for _, module in model.named_modules(remove_duplicate=False):
        for leaf, held in list(module._buffers.items()):
            if held is tensor:
                module._buffers[leaf] = value


def calling(calibration: Callable[[Any], Any], argument: Any) -> Any:
    """`calibration(argument)`; a failure in the user's code says so (it is no ckptstore bug)."""
    try:
        return calibration(argument)
    except (Exception, SystemExit) as exc:  # SystemExit (sys.exit, argparse) ended `ckpt commit` with status 0, silent
        name = getattr(calibration, "__qualname__", repr(calibration))
        raise CkptError(f"the calibration function {name} raised {type(exc).__name__}: {exc}") from exc


def finite_loss(loss: Any) -> float:
    """A calibration function's result as a float: a number or a one-element tensor, and finite."""
    try:
        if isinstance(loss, str | bytes | bytearray | bool):  # float() reads "1.5" and True: no loss
            raise TypeError
        value = float(loss.detach() if hasattr(loss, "detach") else loss)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # OverflowError: an int past float's range
        raise CkptError(f"the calibration function must return a loss (a number or a one-element tensor), "
                        f"not {type(loss).__name__}") from None
    if not math.isfinite(value):
        raise CkptError(f"the calibration loss is not finite ({value})")
    return value
