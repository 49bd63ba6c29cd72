import numpy as np

from ckptstore.policy.mapping import map_optimizer, param_ids, param_lrs
from ckptstore.state import RawTensor


def _t(*shape):
    return RawTensor("torch.float32", shape, np.zeros(int(np.prod(shape)) * 4, dtype=np.uint8))


def _checkpoint(model: dict, order: list[str], prefix="optimizer"):
    tensors = {f"model/{k}": _t(*s) for k, s in model.items()}
    for i, name in enumerate(order):
        for role in ("exp_avg", "exp_avg_sq"):
            tensors[f"{prefix}/state/{i}/{role}"] = _t(*model[name])
        tensors[f"{prefix}/state/{i}/step"] = RawTensor("torch.float32", (), np.zeros(4, dtype=np.uint8))
    return tensors


MODEL = {"embed.weight": (100, 8), "fc.weight": (8, 8), "fc.bias": (8,), "norm.weight": (8,), "head.weight": (3, 8)}


def test_model_order_pairs_weights_with_their_moments():
    result = map_optimizer(_checkpoint(MODEL, list(MODEL)))
    assert result.certain and result.how.startswith("optimizer order")
    assert [s.weight for s in result.slots] == [f"model/{k}" for k in MODEL]
    roles = result.roles()
    assert roles["optimizer/state/1/exp_avg_sq"][1].weight == "model/fc.weight"


def test_hugging_face_decay_groups_are_recognised():
    order = ["embed.weight", "fc.weight", "head.weight", "fc.bias", "norm.weight"]
    result = map_optimizer(_checkpoint(MODEL, order))
    assert result.certain and "Trainer" in result.how
    assert [s.weight for s in result.slots] == [f"model/{k}" for k in order]


def test_ambiguous_shapes_are_not_guessed_and_names_settle_them():
    model = {"a.weight": (4, 4), "b.weight": (4, 4), "c.weight": (4, 4)}
    tensors = _checkpoint(model, ["b.weight"])
    result = map_optimizer(tensors)
    assert not result.certain and all(s.weight is None for s in result.slots)
    named = map_optimizer(tensors, names=["b.weight"])
    assert named.certain and named.slots[0].weight == "model/b.weight"


def test_no_optimizer_state():
    assert not map_optimizer({"w": _t(3, 3)}).slots


def test_parameters_without_state_keep_their_place_given_the_ids():
    model = {"a.weight": (4, 4), "unused.weight": (4, 4), "c.weight": (4, 4)}
    tensors = _checkpoint(model, ["a.weight", "unused.weight", "c.weight"])
    for role in ("exp_avg", "exp_avg_sq", "step"):
        del tensors[f"optimizer/state/1/{role}"]  # a parameter that never got a gradient
    assert not map_optimizer(tensors).certain
    result = map_optimizer(tensors, ids=[0, 1, 2])
    assert result.certain and [s.weight for s in result.slots] == ["model/a.weight", "model/c.weight"]


def test_param_ids_are_read_from_the_skeleton():
    import torch

    from ckptstore.state import flatten

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0}])
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert param_ids(flat.skeleton) == [0, 1]


def test_learning_rates_come_from_the_param_groups_of_the_one_optimizer():
    import torch

    from ckptstore.state import flatten

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-3},
                                   {"params": model[1].parameters(), "lr": 5e-5}])
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    flat = flatten({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert param_lrs(flat.skeleton) == {0: 1e-3, 1: 1e-3, 2: 5e-5, 3: 5e-5}
    pairing = map_optimizer(flat.tensors, None, param_ids(flat.skeleton), param_lrs(flat.skeleton))
    assert [slot.lr for slot in pairing.slots] == [1e-3, 1e-3, 5e-5, 5e-5]
    two = flatten({"a": optimizer.state_dict(), "b": optimizer.state_dict()})
    assert param_lrs(two.skeleton) == {}  # which optimizer's? neither


def test_buffers_beside_the_parameters_keep_the_ids_pairing():
    """A BatchNorm's running statistics counted as parameters: the ids no longer matched the model's tensors, shapes
    allowed several pairings, and weights went unpaired (wrappers auditor). Orthogonal's base and pruning's masks
    are buffers too."""
    model = {"conv.weight": (8, 3), "bn.weight": (8,), "bn.bias": (8,), "bn.running_mean": (8,), "bn.running_var": (8,),
             "q.parametrizations.weight.original": (8, 8), "q.parametrizations.weight.0.base": (8, 8),
             "fc.bias_orig": (8,), "fc.bias_mask": (8,), "head.weight": (8, 8)}
    trained = ["conv.weight", "bn.weight", "bn.bias", "q.parametrizations.weight.original", "fc.bias_orig",
               "head.weight"]
    tensors = _checkpoint(model, trained)
    for result in (map_optimizer(tensors, ids=list(range(len(trained)))), map_optimizer(tensors)):  # shapes alone too
        assert result.certain and [s.weight for s in result.slots] == [f"model/{k}" for k in trained]


def _without_state(tensors: dict, *indices: int, roles=("exp_avg", "exp_avg_sq", "step")) -> dict:
    """The checkpoint with the given roles of these parameters' state removed (no gradient yet, or no moment)."""
    return {k: v for k, v in tensors.items()
            if not any(k == f"optimizer/state/{i}/{role}" for i in indices for role in roles)}


def test_names_of_parameters_with_no_state_yet_do_not_shift_the_pairing():
    """The caller's names list every optimizer parameter, the state only those that had a gradient: pairing them in
    order would give the second parameter's moments to the first parameter's weight (mutation audit round 13)."""
    model = {"a.weight": (4, 3), "b.weight": (5, 2)}
    tensors = _without_state(_checkpoint(model, list(model)), 0)  # a.weight: in the optimizer, no gradient yet
    result = map_optimizer(tensors, names=list(model))
    assert [s.weight for s in result.slots] == ["model/b.weight"]


def test_ids_of_a_partial_optimizer_do_not_index_the_whole_model():
    """Ids counted by an optimizer that holds only some of the model's parameters are not positions in the model: a
    frozen first block was paired, as certain, with the next block's moments; ids past the model's end raised
    IndexError (mutation audit round 13)."""
    model = {"b0.weight": (4, 4), "b1.weight": (4, 4), "b2.weight": (4, 4)}
    result = map_optimizer(_checkpoint(model, ["b1.weight", "b2.weight"]), ids=[0, 1])  # b0 frozen, not optimized
    assert not result.certain or [s.weight for s in result.slots] == ["model/b1.weight", "model/b2.weight"]
    longer = map_optimizer(_checkpoint({"a.weight": (4, 4)}, ["a.weight"]), ids=[0, 1, 2])
    assert [s.weight for s in longer.slots] in (["model/a.weight"], [None])


def test_state_without_moments_is_said_so():
    """A state with no first moment is reported as such, not as ambiguous shapes: `show` explains the pairing with
    this text (mutation audit round 13)."""
    tensors = _without_state(_checkpoint({"a.weight": (4, 3)}, ["a.weight"]), 0, roles=("exp_avg",))
    result = map_optimizer(tensors)
    assert not result.certain and result.how == "state without moments; weights not paired"


def test_a_name_two_tensors_end_with_names_neither():
    """A name that both a model's tensor and its EMA copy end with is ambiguous: taking the first hit made
    calibration swap in (and measure) the EMA's tensor and paired the caller's names with the EMA's weight
    (mutation audit round 13)."""
    from ckptstore.policy.mapping import chosen_naming

    tensors = _checkpoint({"ema/fc.weight": (4, 3), "fc.weight": (4, 3)}, ["fc.weight"])
    assert chosen_naming(tensors, ["fc.weight"], None).paths == {}
    assert map_optimizer(tensors, names=["fc.weight"]).how != "given by the caller"


def test_a_complex_parameter_leaves_only_itself_unpaired_among_the_callers_names():
    """A complex parameter's name matches no float tensor: that dropped every name of the caller's, and shapes alone
    then guessed (auditor 382). Each name is now looked up by its optimizer index, the others kept."""
    model = {"z": (4, 4), "b.weight": (4, 4), "a.weight": (4, 4)}
    tensors = _checkpoint(model, ["z", "b.weight", "a.weight"])
    complex_z = RawTensor("torch.complex64", (4, 4), np.zeros(16 * 8, dtype=np.uint8))
    for path in ("model/z", "optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq"):
        tensors[path] = complex_z
    result = map_optimizer(tensors, names=["z", "b.weight", "a.weight"])
    assert result.how == "given by the caller"
    assert [s.weight for s in result.slots] == [None, "model/b.weight", "model/a.weight"]


def test_a_file_that_lists_tensors_by_name_pairs_by_shapes_no_two_share_or_not_at_all():
    """safetensors lists tensors by name: `h.10` before `h.2` (auditor 399: twelve LoRA layers of one shape paired
    the optimizer's third parameter with h.10's weights), `k_proj` before `q_proj` (reviewer 400: every LoRA
    projection paired with its neighbour's moments), all said certain. Its order is no model's: shapes that no
    two tensors share pair them, names given pair them, else nothing is paired."""
    from ckptstore.policy.mapping import BY_NAME

    layers = [f"h.{i}.{proj}.lora_A.weight" for i in range(12) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
    model = {name: (4, 8) for name in sorted(layers)}  # as the file lists them; the optimizer has the model's order
    tensors = _checkpoint(model, layers)
    in_order = map_optimizer(_checkpoint({name: (4, 8) for name in layers}, layers), ids=list(range(48)))
    assert in_order.certain and [s.weight for s in in_order.slots] == [f"model/{name}" for name in layers]  # torch.save
    unpaired = map_optimizer(tensors, ids=list(range(48)), by_name=set(tensors))
    assert not unpaired.certain and unpaired.how.startswith(BY_NAME) and all(s.weight is None for s in unpaired.slots)
    named = map_optimizer(tensors, names=layers, ids=list(range(48)), by_name=set(tensors))
    assert named.certain and [s.weight for s in named.slots] == [f"model/{name}" for name in layers]
    shapes = {"b.weight": (4, 8), "a.weight": (8, 8), "c.weight": (2, 8)}  # listed a, b, c; one shape each
    listed = _checkpoint(dict(sorted(shapes.items())), list(shapes))
    by_shape = map_optimizer(listed, by_name=set(listed))
    assert by_shape.certain and [s.weight for s in by_shape.slots] == [f"model/{name}" for name in shapes]


def test_a_name_sorted_file_beside_the_model_drops_no_pairing_and_a_buffer_like_name_counts_as_a_shape_holder():
    """One unrelated safetensors file in a folder (an EMA's, a VAE's) unpaired a torch.save file's weights listed in
    the model's order (reviewer 401, of e067889); and `learned_mask` (a trainable tensor named like a buffer) was
    no holder of its shape, so a frozen weight of that shape took its moments 'by shapes alone'."""
    model = {"a.weight": (4, 4), "b.weight": (4, 4), "c.weight": (4, 4)}
    tensors = {**_checkpoint(model, list(model)), "extra/w": _t(7, 5)}
    result = map_optimizer(tensors, ids=[0, 1, 2], by_name={"extra/w"})
    assert result.certain and [s.weight for s in result.slots] == [f"model/{k}" for k in model]
    masked = {"base.weight": (16, 16), "head.weight": (4, 16), "learned_mask": (16, 16)}
    listed = _checkpoint(masked, ["learned_mask", "head.weight"])
    assert not map_optimizer(listed, ids=[0, 1], by_name=set(listed)).certain
    # the same in a torch.save file (reviewer 406): a mask is a buffer only beside its pruned parameter, X_orig
    beside_frozen = _checkpoint({"frozen.weight": (8, 8), "learned_mask": (8, 8)}, ["learned_mask"])
    assert not map_optimizer(beside_frozen, ids=[0]).certain
    # a causal mask buffer looks the same from the state alone (reviewer 407): said so; the live names pair them
    causal = _checkpoint({"a.weight": (8, 8), "b.weight": (8, 8), "causal_mask": (8, 8)}, ["a.weight", "b.weight"])
    unsure = map_optimizer(causal, ids=[0, 1])
    assert not unsure.certain and "model/causal_mask is named like a mask" in unsure.how
    frozen = _checkpoint({"a.weight": (8, 8), "b.weight": (8, 8), "causal_mask": (4, 4), "c.weight": (4, 4)},
                         ["b.weight", "c.weight"])  # a frozen a.weight, not the mask, makes it ambiguous
    assert map_optimizer(frozen).how == "shapes allow more than one pairing; weights not paired"
    named = map_optimizer(causal, names=["a.weight", "b.weight"], ids=[0, 1])
    assert named.certain and [s.weight for s in named.slots] == ["model/a.weight", "model/b.weight"]
    pruned = _checkpoint({"base.weight_orig": (16, 16), "head.weight": (4, 16), "base.weight_mask": (16, 16)},
                         ["base.weight_orig", "head.weight"])
    result = map_optimizer(pruned, ids=[0, 1])
    assert result.certain and [s.weight for s in result.slots] == ["model/base.weight_orig", "model/head.weight"]
