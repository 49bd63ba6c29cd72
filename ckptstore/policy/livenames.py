"""A live model's tensor names as a checkpoint may hold them: once per wrapper level (DDP, DataParallel, compile).

A state may be saved from the wrapper (`module.fc.weight`) or from the model it wraps
(`fc.weight`); policy/mapping.py picks the one naming that matches the checkpoint, and none where
two copies (the model's and an EMA's) match alike. torch itself is not imported here: the model
is only walked, and its tensors read through state.raw_from_torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from ckptstore.errors import UnsupportedStateError
from ckptstore.policy.mapping import chosen_naming, key_component
from ckptstore.state import RawTensor, raw_from_torch, torch_dtype

# parts FSDP1 and activation checkpointing put in a parameter's name and never in its state_dict() key
_WRAPPED_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def level_names(model: Any, tensors: Iterable[Any]) -> list[Any]:
    """Each tensor's name in `model`: one where every wrapper level names it alike, else a tuple (None: not held).

    A PEFT model's names come without their adapter's part too (`lora_A.default.weight` -> `lora_A.weight`), as
    its save_pretrained writes them.
    """
    levels = []
    for each in _wrapper_levels(model):
        names = {id(t): _state_name(n) for n, t in chain(each.named_buffers(), each.named_parameters())}
        levels.append(names)
        adapters = getattr(each, "peft_config", None)
        if isinstance(adapters, dict) and adapters:
            levels.append({key: ".".join(p for p in name.split(".") if p not in adapters)
                           for key, name in names.items()})
    return [_one_or_both([names.get(id(t)) for names in levels]) for t in tensors]


def checkpoint_paths(model: Any, named: Mapping[str, Any], tensors: Mapping[str, RawTensor]) -> LivePaths:
    """Each name of `named` (as `model` names its tensor) -> the checkpoint path it names, in the naming matching.

    Where a name matches two copies (the model's and an EMA's), one holding the live tensor's values (in the
    checkpoint's dtype: a state may be saved in half precision).
    """
    given = level_names(model, named.values())
    live = dict(zip(given, named.values()))
    same: dict[tuple[Any, str], bool] = {}

    def holds(name: Any, path: str) -> bool:
        if (name, path) not in same:
            same[name, path] = _holds(live[name], tensors[path])
        return same[name, path]

    chosen = chosen_naming(tensors, given, holds)
    by_live = dict(zip(named, given))
    return LivePaths({name: chosen.paths[g] for name, g in by_live.items() if g in chosen.paths},
                     {name: chosen.doubled[g] for name, g in by_live.items() if g in chosen.doubled},
                     {name for name, g in by_live.items() if g in chosen.paths and holds(g, chosen.paths[g])},
                     {name: chosen.copies[g] for name, g in by_live.items() if g in chosen.copies})


def tied_paths(model: Any, named: Mapping[str, Any], paths: Mapping[str, str],
               tensors: Mapping[str, RawTensor]) -> dict[str, list[str]]:
    """Live names whose tensor the model also holds under other names (tied weights) -> those names' paths.

    `named()` gives a tied embedding and LM head once; a state cloned apart holds both, coded apart, and
    load_state_dict writes each into the one tensor: which lands last depends on the state's order. Found
    beside `paths[name]`: the same prefix with the other name, at the wrapper level that names it so.
    """
    tied: dict[str, list[str]] = {}
    for each in _wrapper_levels(model):
        by_id: dict[int, list[str]] = {}
        for name, tensor in chain(each.named_buffers(remove_duplicate=False),
                                  each.named_parameters(remove_duplicate=False)):
            by_id.setdefault(id(tensor), []).append(key_component(_state_name(name)))
        for name, tensor in named.items():
            aliases, path = by_id.get(id(tensor), []), paths.get(name)
            own = next((a for a in aliases if path is not None and (path == a or path.endswith("/" + a))), None)
            if own is None or len(aliases) < 2:
                continue
            prefix = path[:len(path) - len(own)]
            found = [prefix + a for a in aliases if a != own and prefix + a in tensors
                     and tuple(tensors[prefix + a].shape) == tuple(tensors[path].shape)]
            if found:
                tied[name] = list(dict.fromkeys([*tied.get(name, []), *found]))
    return tied


@dataclass
class LivePaths:
    """Where a live model's tensors are in a checkpoint."""

    paths: dict[str, str]  # live name -> checkpoint path (one of its copies, where it has several)
    doubled: dict[str, list[str]]  # live names matching two copies or more, none holding the live values: no path
    holding: set[str]  # the live names whose path holds the live tensor's values
    copies: dict[str, list[str]]  # live names whose values two paths or more hold (the model's, an EMA's just made)


def _holds(tensor: Any, raw: RawTensor) -> bool:
    """Whether live `tensor`, in `raw`'s dtype, holds `raw`'s bytes (compared a piece at a time: no second copy)."""
    if tuple(tensor.shape) != tuple(raw.shape):
        return False
    try:
        ours = raw_from_torch(tensor if str(tensor.dtype) == raw.dtype else tensor.to(torch_dtype(raw.dtype)))
    except (UnsupportedStateError, TypeError, ValueError, RuntimeError):  # meta, quantized, or no such cast
        return False
    theirs = np.asarray(raw.data).reshape(-1)
    step = 1 << 24
    return ours.data.size == theirs.size and all(
        np.array_equal(ours.data[at:at + step], theirs[at:at + step]) for at in range(0, theirs.size, step))


def _state_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPED_PARTS)


def _wrapper_levels(model: Any) -> list[Any]:
    """`model`, and each model a DDP, DataParallel or torch.compile wrapper in it holds, told by type."""
    found = [model]
    while True:
        kind = type(found[-1]).__name__
        inner = (getattr(found[-1], "module", None) if kind in ("DistributedDataParallel", "DataParallel")
                 else getattr(found[-1], "_orig_mod", None) if kind == "OptimizedModule" else None)
        if inner is None:
            return found  # each level: a state may be saved from any of them (DDP's .module of a compiled model)
        found.append(inner)


def _one_or_both(names: list[str | None]) -> Any:
    """One name where the namings (one per wrapper level) agree, else a tuple of them (mapping.namings)."""
    return names[0] if len(set(names)) == 1 else tuple(names)
