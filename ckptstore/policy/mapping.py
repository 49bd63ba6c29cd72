"""Which optimizer state belongs to which weight, for joint weight-moment compression.

Moments pair with each other by optimizer index, always. Pairing them with weights needs names:
given by the caller (`commit(model=..., optimizer=...)`), or inferred from the optimizer's order
(torch numbers parameters in `param_groups` order) checked against shapes, first in the model's
own order, then in the order Hugging Face Trainer groups them (decayed weights, then biases and
norms). With the optimizer's parameter ids at hand, that order is assumed and only checked: shapes
cannot tell apart groups listed in another order among parameters of equal shapes (docs/guide.md
says so). Without them, an inference is accepted only when it is the only one the shapes allow.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptstore.state import RawTensor, key_component, readable_path

_STATE = re.compile(r"^(?:(.*)/)?state/(\d+)/(exp_avg|exp_avg_sq|momentum_buffer)$")
_ANY_STATE = re.compile(r"^(?:(.*)/)?state/(\d+)/([^/]+)$")
_ADAM_OR_SGD = {"exp_avg", "exp_avg_sq", "momentum_buffer", "step"}
ADAM_EXTRAS = {"max_exp_avg_sq", "mu_product"}  # what Adam's variants keep beside its moments: amsgrad's, NAdam's
_NO_DECAY = re.compile(r"bias|norm|(^|[._/])ln(_\w+)?([._/]|$)", re.IGNORECASE)
NO_OPTIMIZER_STATE = "no optimizer state found"  # an OptimizerMap's `how` (a lossy manifest's pairing) then
# the same where there is optimizer state, of no kind it pairs (Adagrad's sum): not "none found"
UNPAIRED_STATE = "optimizer state of no kind it pairs (neither Adam's moments nor SGD's momentum); weights not paired"
FLOATS = ("torch.float32", "torch.float16", "torch.bfloat16", "torch.float64")
# buffers no optimizer trains, by their state-dict names: BatchNorm's running statistics, pruning's masks,
# spectral norm's power-iteration vectors, orthogonal's base (torch.nn.utils.parametrizations)
_BUFFER_NAME = re.compile(r"(?:^|[./])(?:running_mean|running_var|\w+_mask|_u|_v)$"
                          r"|\.parametrizations\.\w+\.\d+\.base$")
# the older spectral_norm's vectors; weight_norm's weight_v, a trained matrix, shares the name
_SPECTRAL_VECTOR = re.compile(r"(?:^|[./])weight_[uv]$")


def is_buffer(path: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a buffer no optimizer trains, by its name (and, for `weight_u`/`weight_v`, its shape)."""
    return bool(_BUFFER_NAME.search(path) or len(shape) == 1 and _SPECTRAL_VECTOR.search(path))


@dataclass
class ParamSlots:
    """The tensors of one optimizer parameter, by logical path."""

    index: int
    weight: str | None = None
    exp_avg: str | None = None
    exp_avg_sq: str | None = None
    momentum_buffer: str | None = None
    lr: float | None = None  # its param group's learning rate, when the checkpoint has it
    # the state holds tensors neither Adam nor SGD keeps (RMSprop's square_avg): its momentum_buffer
    # is that optimizer's, in other units than SGD's
    other_state: bool = False
    amsgrad: bool = False  # Adam's max_exp_avg_sq beside its moments: v must never pass it
    # state beside exp_avg and exp_avg_sq that no Adam keeps (Adan's exp_avg_diff, Adafactor's factored rows):
    # another optimizer's, whose moments enter its step otherwise than Adam's bound assumes
    foreign_moments: bool = False


@dataclass
class OptimizerMap:
    """Optimizer parameters with their tensors, and how sure the weight pairing is."""

    slots: list[ParamSlots] = field(default_factory=list)
    certain: bool = False
    how: str = NO_OPTIMIZER_STATE

    def roles(self) -> dict[str, tuple[str, ParamSlots]]:
        """Path -> (role, slots) for every path that belongs to some parameter."""
        out = {}
        for slot in self.slots:
            for role in ("weight", "exp_avg", "exp_avg_sq", "momentum_buffer"):
                path = getattr(slot, role)
                if path is not None:
                    out[path] = (role, slot)
        return out


def _embedding(model: Sequence[tuple[str, tuple]], shapes: Sequence[tuple]) -> list[int] | None:
    """Indices into `model` of the only order-preserving placement of `shapes`, or None."""
    forward, j = [], 0
    for shape in shapes:
        while j < len(model) and model[j][1] != shape:
            j += 1
        if j == len(model):
            return None
        forward.append(j)
        j += 1
    backward, j = [], len(model) - 1
    for shape in reversed(shapes):
        while j >= 0 and model[j][1] != shape:
            j -= 1
        backward.append(j)
        j -= 1
    return forward if forward == backward[::-1] else None


def _optimizer_groups(skeleton: object) -> list[list[tuple[list[int], object]]]:
    """Per optimizer state dict found in a checkpoint skeleton, its param_groups as (ids, lr)."""
    found: list[list[tuple[list[int], object]]] = []

    def visit(node: object) -> None:
        if isinstance(node, list) and node and node[0] in ("dict", "odict"):
            keys = {k: v for k, v in node[1] if isinstance(k, str)}
            groups = keys.get("param_groups")
            if "state" in keys and isinstance(groups, list) and groups and groups[0] == "list":
                parsed = []
                for group in groups[1]:
                    fields = {k: v for k, v in group[1] if isinstance(k, str)} if group else {}
                    params = fields.get("params")
                    if isinstance(params, list) and params and params[0] == "list":
                        parsed.append(([i for i in params[1] if isinstance(i, int)], fields.get("lr")))
                found.append(parsed)
            for _, value in node[1]:
                visit(value)
        elif isinstance(node, list) and node and node[0] in ("list", "tuple"):
            for value in node[1]:
                visit(value)

    visit(skeleton)
    return found


def optimizer_state_paths(skeleton: object) -> set[str]:
    """Paths of the tensors in the `state` of each optimizer state dict (one beside `param_groups`) of a skeleton."""
    found: set[str] = set()
    stack: list[tuple[object, bool]] = [(skeleton, False)]
    while stack:
        node, under_state = stack.pop()
        if not isinstance(node, list) or not node:
            continue
        if node[0] == "tensor" and len(node) > 1 and isinstance(node[1], str):
            if under_state:
                found.add(node[1])
        elif node[0] in ("dict", "odict") and len(node) > 1 and isinstance(node[1], list):
            items = [item for item in node[1] if isinstance(item, list) and len(item) == 2]
            keys = {item[0] for item in items if isinstance(item[0], str)}  # a float key is a list: not a name
            optimizer = "state" in keys and "param_groups" in keys
            stack.extend((value, under_state or (optimizer and key == "state")) for key, value in items)
        else:  # lists, tuples, sets and the lists of their items: every element may hold a node
            stack.extend((child, under_state) for child in node)
    return found


def param_ids(skeleton: object) -> list[int] | None:
    """Parameter ids in `param_groups` order, found in a checkpoint skeleton (None if not exactly one)."""
    found = _optimizer_groups(skeleton)
    return [i for ids, _ in found[0] for i in ids] if len(found) == 1 else None


def param_lrs(skeleton: object) -> dict[int, float]:
    """Parameter id -> its group's learning rate, where a checkpoint skeleton holds exactly one optimizer."""
    found = _optimizer_groups(skeleton)
    if len(found) != 1:
        return {}
    return {i: float(lr) for ids, lr in found[0] if isinstance(lr, (int, float)) and not isinstance(lr, bool)
            for i in ids}


def map_optimizer(tensors: Mapping[str, RawTensor], names: Sequence[Any] | None = None,
                  ids: Sequence[int] | None = None, lrs: Mapping[int, float] | None = None,
                  by_name: Collection[str] = ()) -> OptimizerMap:
    """Find optimizer state among `tensors` and pair it with weights (see the module docstring).

    `ids` (the optimizer's parameter ids in group order, see `param_ids`) lets parameters that have
    no state yet (never received a gradient) hold their place in the order; `lrs` (see
    `param_lrs`) gives each its learning rate. `by_name`: the paths of tensors from files that list
    them sorted by name (safetensors), not in the model's order; where one has a moment's shape, only
    names or shapes no two tensors share pair them (`h.10` sorts before `h.2`, `k_proj` before `q_proj`).
    """
    slots = _slots_of(tensors, lrs or {})
    if not slots:
        return OptimizerMap(how=UNPAIRED_STATE if any(map(_ANY_STATE.match, tensors)) else NO_OPTIMIZER_STATE)
    prefixes = {prefix for prefix, _ in slots}
    if len(prefixes) > 1:
        return OptimizerMap(list(slots.values()), False, "several optimizers; weights not paired")
    (prefix,) = prefixes
    ordered = [slots[key] for key in sorted(slots, key=lambda k: k[1])]
    inside = f"{prefix}/" if prefix else ""
    model = [(p, tuple(r.shape)) for p, r in tensors.items()
             if r.dtype in FLOATS and not (inside and p.startswith(inside)) and not _STATE.match(p)]
    shapes = [tuple(tensors[s.exp_avg or s.momentum_buffer].shape) if (s.exp_avg or s.momentum_buffer) else None
              for s in ordered]
    if names is not None and (given := _by_caller(ordered, shapes, model, names)) is not None:
        return given
    if None in shapes:
        return OptimizerMap(ordered, False, "state without moments; weights not paired")
    params = [m for m in model if not is_buffer(*m) or _trained_mask(m[0], model)]
    if any(path in by_name for path, shape in model if shape in set(shapes)):
        return _by_unique_shapes(ordered, shapes, model) or OptimizerMap(
            ordered, False, BY_NAME + (NAMES_MATCH_NONE if names is not None else ASK_NAMES))
    # the model's parameters; then, should a buffer's name mislead, every float tensor (as before buffers were told)
    for listed in ([params, model] if len(params) < len(model) else [model]):
        paired = _by_ids(ordered, shapes, listed, ids) if ids is not None else None
        if paired is not None:
            return paired
        for candidates, how in _orders(listed):
            placement = _embedding(candidates, shapes)
            if placement is not None:
                return _pair(ordered, [candidates[i][0] for i in placement], how)
    masks = [path for path, shape in model if shape in set(shapes) and is_buffer(path, shape)
             and _trained_mask(path, model)]
    strict = [m for m in params if m[0] not in masks]
    if masks and any(_embedding(candidates, shapes) is not None for candidates, _ in _orders(strict)):
        # the masks alone stand in the way: a causal mask buffer and a learned mask look alike in a state
        return OptimizerMap(ordered, False, f"{readable_path(masks[0])} is named like a mask but has a moment's shape: "
                                            f"trained or a buffer, shapes cannot tell; weights not paired{ASK_NAMES}")
    return OptimizerMap(ordered, False, "shapes allow more than one pairing; weights not paired")


def _trained_mask(path: str, model: list[tuple[str, tuple]]) -> bool:
    """Whether `path`, named like a mask buffer, may be trained: torch's pruning keeps `X_mask` beside `X_orig`.

    A `learned_mask` parameter left out as a buffer made a frozen weight of its shape the only one, and that
    weight took its moments, said certain (reviewer 406).
    """
    return path.endswith("_mask") and not any(other == path[:-len("_mask")] + "_orig" for other, _ in model)


def _by_caller(ordered: list[ParamSlots], shapes: list[tuple | None], model: list[tuple[str, tuple]],
               names: Sequence[Any]) -> OptimizerMap | None:
    """The pairing the caller's live parameter names give, each slot's name found by its optimizer index.

    A slot whose name is unknown, matches no one float tensor (a complex parameter) or one of another shape stays
    unpaired, the others keep their pairing: requiring every name to match threw all of them away for a
    parameter with no state yet, and the guess from shapes then paired groups listed out of the model's order
    wrongly. None where no name pairs at all (the names are not this checkpoint's).
    """
    shape_of = dict(model)
    each = namings(names)
    # one naming that names two copies (the model's and an EMA's) makes another matching one copy no proof either
    if len(each) > 1 and any(len(_hits(model, n)) > 1 for naming in each for n in naming if n is not None):
        return OptimizerMap(ordered, False, _TWO_COPIES)
    pairings = []
    for naming in each:
        weights: list[str | None] = []
        for slot, shape in zip(ordered, shapes):
            name = naming[slot.index] if slot.index < len(naming) else None
            path = _path_named(model, name) if name is not None else None
            weights.append(path if path is not None and (shape is None or shape_of[path] == shape) else None)
        pairings.append(weights)
    best = _agreed_best(pairings, lambda weights: sum(w is not None for w in weights))
    if best is None:  # a wrapper's names and the wrapped model's match two copies alike
        return OptimizerMap(ordered, False, _TWO_COPIES)
    return _pair(ordered, best, "given by the caller") if any(best) else None


_TWO_COPIES = "the model's names match two copies of it (the model's and an EMA's?) alike; weights not paired"
BY_NAME = ("a file that lists its tensors by name, not in the model's order (safetensors), holds tensors of the "
           "moments' shapes, and shapes cannot tell them apart; weights not paired")
ASK_NAMES = " (pass model= and optimizer= to pair them)"
NAMES_MATCH_NONE = " (the model's names pair none alone: two copies of it?)"


def _agreed_best(candidates: list[Any], matched: Callable[[Any], Any]) -> Any:
    """The candidate (one per naming) that matches most; None where two that match most differ (two copies)."""
    most = max(map(matched, candidates))
    best = [candidate for candidate in candidates if matched(candidate) == most]
    return best[0] if all(candidate == best[0] for candidate in best) else None


def _by_ids(ordered: list[ParamSlots], shapes: list[tuple], model: list[tuple[str, tuple]],
            ids: Sequence[int]) -> OptimizerMap | None:
    """The pairing the optimizer's parameter ids give, one per tensor of `model` in its order, checked by shape."""
    if len(ids) != len(model) or not set(s.index for s in ordered) <= set(ids):
        return None
    position = {param: i for i, param in enumerate(ids)}
    for candidates, how in _orders(model):
        if all(candidates[position[s.index]][1] == shape for s, shape in zip(ordered, shapes)):
            return _pair(ordered, [candidates[position[s.index]][0] for s in ordered], how)
    return None


def _slots_of(tensors: Mapping[str, RawTensor], lrs: Mapping[int, float]) -> dict[tuple[str, int], ParamSlots]:
    """Each optimizer parameter's moments by (optimizer prefix, index), with what other state it keeps."""
    slots: dict[tuple[str, int], ParamSlots] = {}
    other: dict[tuple[str, int], set[str]] = {}
    for path in tensors:
        match = _STATE.match(path)
        if match:
            prefix, index, role = match.group(1) or "", int(match.group(2)), match.group(3)
            slot = slots.setdefault((prefix, index), ParamSlots(index, lr=lrs.get(index)))
            setattr(slot, role, path)
        elif (match := _ANY_STATE.match(path)) and match.group(3) not in _ADAM_OR_SGD:
            other.setdefault((match.group(1) or "", int(match.group(2))), set()).add(match.group(3))
    for key in other.keys() & slots.keys():
        slots[key].other_state = True
        slots[key].amsgrad = "max_exp_avg_sq" in other[key]
        slots[key].foreign_moments = bool(other[key] - ADAM_EXTRAS)
    return slots


def _orders(model: list[tuple[str, tuple]]) -> tuple[tuple[list[tuple[str, tuple]], str], ...]:
    """The orders an optimizer may list the model's tensors in, each with how a pairing by it is said."""
    return ((model, "optimizer order matches the model's"),
            (_decay_groups(model), "Hugging Face Trainer's decay groups"))


def _by_unique_shapes(ordered: list[ParamSlots], shapes: list[tuple], model: list[tuple[str, tuple]]
                      ) -> OptimizerMap | None:
    """The pairing where each parameter's shape is one float tensor's alone, buffer-like names too; else None."""
    holders: dict[tuple, list[str]] = {}
    for path, shape in model:
        holders.setdefault(shape, []).append(path)
    weights = [paths[0] if len(paths := holders.get(shape, [])) == 1 else None for shape in shapes]
    if None in weights or len(set(weights)) < len(weights):
        return None
    return _pair(ordered, weights, "by shapes alone (the file lists its tensors by name, not in the model's order)")


def _decay_groups(model: Sequence[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """Hugging Face Trainer's order: weights that decay, then biases and norm weights."""
    return [m for m in model if not _NO_DECAY.search(m[0])] + [m for m in model if _NO_DECAY.search(m[0])]


@dataclass
class Naming:
    """Where live names are in a checkpoint, in the naming chosen."""

    paths: dict[Any, str] = field(default_factory=dict)  # each name's path (one of its copies where it has several)
    doubled: dict[Any, list[str]] = field(default_factory=dict)  # two copies or more, none holding the live bytes
    copies: dict[Any, list[str]] = field(default_factory=dict)  # two or more holding the live bytes, in any naming


def chosen_naming(tensors: Mapping[str, RawTensor], names: Sequence[Any],
                  holds: Callable[[Any, str], bool] | None) -> Naming:
    """The checkpoint path of each live name that matches one float tensor, in one naming; and what it leaves out.

    `holds(name, path)`: whether the live tensor of `name` (as given) holds the bytes at `path`. With it, a
    name matching two copies (the model's and an EMA's) names one holding the live bytes, and the naming most
    of whose paths hold them wins. Left out (`doubled`): a name matching two copies none of which holds the
    live bytes. Held twice (`copies`): copies of the model (an EMA's just made), alike now but not coded
    alike, so a measurement takes each. Nothing where two namings match alike, unless every path of each
    holds the live bytes (copies again).
    """
    model = _float_tensors(tensors)
    each = namings(names)
    found: list[Naming] = []
    for naming in each:
        chosen = Naming()
        for given, name in zip(names, naming):
            hits = _hits(model, name) if name is not None else []
            if len(hits) > 1 and holds is not None:
                hits = [path for path in hits if holds(given, path)][:1] or hits
            if len(hits) == 1:
                chosen.paths[given] = hits[0]
            elif hits:
                chosen.doubled[given] = hits
        found.append(chosen)
    held = len if holds is None else lambda paths: (sum(holds(g, path) for g, path in paths.items()), len(paths))
    best = _agreed_best([naming.paths for naming in found], held)
    if best is None and holds is not None:  # two namings alike: copies, where every path of each holds the live bytes
        top = max(held(naming.paths) for naming in found)
        tied = [naming.paths for naming in found if held(naming.paths) == top]
        best = tied[0] if all(top[0] == len(paths) for paths in tied) else None
    if best is None:
        return Naming()
    chosen = next(naming for naming in found if naming.paths == best)
    if holds is not None:
        for given, across in zip(names, zip(*each)):  # the name in every naming
            holding = [p for name in dict.fromkeys(across) if name is not None for p in _hits(model, name)
                       if holds(given, p)]
            if len(set(holding)) > 1:
                chosen.copies[given] = list(dict.fromkeys(holding))
    return chosen


def paths_in_any_naming(tensors: Mapping[str, RawTensor], names: Sequence[Any]) -> set[str]:
    """Every path a live name matches in any of its namings, in every copy (an EMA's): for what is kept exact."""
    model = _float_tensors(tensors)
    return {path for naming in namings(names) for name in naming if name is not None for path in _hits(model, name)}


def _float_tensors(tensors: Mapping[str, RawTensor]) -> list[tuple[str, tuple]]:
    """(path, shape) of each float tensor that is no optimizer state: what a live parameter name may name."""
    return [(p, tuple(r.shape)) for p, r in tensors.items() if r.dtype in FLOATS and not _STATE.match(p)]


def _path_named(model: Sequence[tuple[str, tuple]], name: str) -> str | None:
    """The one path live name `name` names, else None (none, or two copies)."""
    hits = _hits(model, name)
    return hits[0] if len(hits) == 1 else None


def _hits(model: Sequence[tuple[str, tuple]], name: str) -> list[str]:
    """The paths live name `name` names: the path itself, or one ending in it (below the state's own keys)."""
    return [p for p, _ in model if p == key_component(name) or p.endswith("/" + key_component(name))]


def namings(names: Sequence[Any]) -> list[list[Any]]:
    """The caller's names in each of their namings: a wrapped model's as given, and as each model it holds names them.

    A name that differs (DDP's `module.`, compile's `_orig_mod.`) comes as a tuple, one per wrapper level. One
    naming is chosen for all names, by how many match, and none where two match two copies alike (the model's
    and an EMA's): per name, a wrapper's `module.proj` matched an inner submodule named `module`.
    """
    width = max((len(n) for n in names if isinstance(n, tuple)), default=1)
    return [[n[k] if isinstance(n, tuple) else n for n in names] for k in range(width)]


def _pair(ordered: list[ParamSlots], weights: Sequence[str | None], how: str) -> OptimizerMap:
    for slot, weight in zip(ordered, weights):
        slot.weight = weight
    return OptimizerMap(ordered, True, how)
