"""Lossy roles: which role's planner each tensor gets, and that each planner codes it as its role says.

Expected steps are derived from the level's knobs and the tensor's own RMS (computed here), with
Fisher allocation off so that a weight's step factor is 1 (or the embedding factor).
"""

import numpy as np
import pytest

from ckptstore.policy import EncodingSettings, level_named
from ckptstore.policy.lossy import ROLE_PLANNERS, Role, plan_lossy, plan_roles
from ckptstore.policy.mapping import map_optimizer
from ckptstore.records import TensorRecord
from ckptstore.state import RawTensor

SETTINGS = EncodingSettings()


def _t(*shape, seed=0, dtype=np.float32, torch_dtype="torch.float32", scale=1.0):
    values = (np.random.default_rng(seed).standard_normal(int(np.prod(shape))) * scale).astype(dtype)
    return RawTensor(torch_dtype, shape, values.view(np.uint8))


def _rms(raw):
    values = np.frombuffer(raw.data, np.float32).astype(np.float64)
    return float(np.sqrt(np.mean(values * values)))


def _adam(tensors, index, weight, *shape):
    tensors[weight] = _t(*shape, seed=index)
    tensors[f"optimizer/state/{index}/exp_avg"] = _t(*shape, seed=100 + index, scale=1e-3)
    tensors[f"optimizer/state/{index}/exp_avg_sq"] = _t(*shape, seed=200 + index, scale=1e-6)


def _adam_model():
    """An embedding, two matrices and a bias, all trained by Adam, beside an integer buffer."""
    tensors = {}
    _adam(tensors, 0, "model/embed.weight", 128, 64)
    _adam(tensors, 1, "model/fc.weight", 64, 128)
    _adam(tensors, 2, "model/fc.bias", 64)
    _adam(tensors, 3, "model/out.weight", 96, 64)
    tensors["model/positions"] = RawTensor("torch.int64", (128, 64), np.zeros(128 * 64, np.int64).view(np.uint8))
    return tensors


def _pairing(tensors, lr):
    pairing = map_optimizer(tensors, None, [0, 1, 2, 3], {i: lr for i in range(4)})
    assert pairing.certain
    return pairing


def _parent_of(raw, codec="deadzone", depth=0, rel_error=0.01):
    return TensorRecord("t" * 64, raw.dtype, raw.shape, codec, {"chunk_bytes": 1 << 20, "rel_error": rel_error},
                        None, depth, raw.nbytes, raw.nbytes // 4)


def _roles_and_plans(tensors, parents, level, pairing):
    roles = plan_roles(tensors, parents, level, SETTINGS, pairing)
    plans = plan_lossy(tensors, parents, level, SETTINGS, pairing)
    assert list(roles) == list(tensors)  # every tensor has a role, in order
    assert set(plans) == {path for path, role in roles.items() if role is not Role.LOSSLESS}
    return roles, plans


def test_every_role_but_lossless_has_a_planner():
    assert set(ROLE_PLANNERS) == set(Role) - {Role.LOSSLESS}


@pytest.mark.parametrize("fast", [True, False])
def test_adam_weights_by_pace_and_parent(fast):
    level = level_named("resume-only", fisher_allocation=False)
    tensors = _adam_model()
    # A weight is fast where Adam's lr (its step per entry) is at least fast_move of its RMS.
    least_rms = min(_rms(tensors[p]) for p in ("model/embed.weight", "model/fc.weight", "model/out.weight"))
    lr = 2 * level.fast_move * least_rms if fast else level.fast_move * least_rms / 4
    pairing = _pairing(tensors, lr)
    parents = {"model/fc.weight": _parent_of(tensors["model/fc.weight"], "bytegroup"),
               "model/embed.weight": _parent_of(tensors["model/embed.weight"])}
    roles, plans = _roles_and_plans(tensors, parents, level, pairing)

    keyframe = Role.FAST_WEIGHT_KEYFRAME if fast else Role.WEIGHT_KEYFRAME
    residual = Role.FAST_WEIGHT_RESIDUAL if fast else Role.WEIGHT_RESIDUAL
    assert roles["model/out.weight"] is keyframe
    assert roles["model/fc.weight"] is residual and roles["model/embed.weight"] is residual
    assert roles["model/fc.bias"] is Role.LOSSLESS  # one-dimensional
    assert roles["model/positions"] is Role.LOSSLESS  # integers
    for i in range(4):  # balanced's rules quantize even the bias's moments (they are a sliver of the state)
        assert roles[f"optimizer/state/{i}/exp_avg_sq"] is Role.ADAM_SECOND_MOMENT
        assert roles[f"optimizer/state/{i}/exp_avg"] is Role.ADAM_FIRST_MOMENT

    keyframe_step = level.fast_keyframe_step if fast else level.weight_keyframe_step
    residual_step = level.fast_residual_step if fast else level.weight_residual_step
    out, fc, embed = plans["model/out.weight"], plans["model/fc.weight"], plans["model/embed.weight"]
    assert out.params["step"] == pytest.approx(keyframe_step * _rms(tensors["model/out.weight"]), rel=1e-12)
    assert fc.params["step"] == pytest.approx(residual_step * _rms(tensors["model/fc.weight"]), rel=1e-12)
    assert embed.params["step"] == pytest.approx(
        residual_step * level.embedding_factor * _rms(tensors["model/embed.weight"]), rel=1e-12)
    assert out.base is None and fc.base is parents["model/fc.weight"]
    # Fast weights round to nearest and skip the fine-tune cap; slow residuals keep the level's dead zone.
    assert fc.params["rounding"] == (0.5 if fast else level.weight_rounding)
    assert fc.params["relative_step"] == (0.0 if fast else level.relative_step)
    assert out.params["rounding"] == 0.5
    assert fc.params["fine_below"] == pytest.approx(level.fine_drift * _rms(tensors["model/fc.weight"]))
    assert "fine_below" not in out.params  # a keyframe has no movement to measure
    assert fc.importance == "optimizer/state/1/exp_avg_sq"


def test_residual_roles_need_a_parent_of_the_same_layout_with_room_in_the_chain():
    level = level_named("resume-only", fisher_allocation=False)
    tensors = _adam_model()
    pairing = _pairing(tensors, 1e-7)
    w = tensors["model/out.weight"]
    for parent, role in [(_parent_of(w, depth=level.max_chain - 1), Role.WEIGHT_RESIDUAL),
                         (_parent_of(w, depth=level.max_chain), Role.WEIGHT_KEYFRAME),
                         (_parent_of(w, codec="log2moment"), Role.WEIGHT_KEYFRAME),
                         (_parent_of(_t(64, 96)), Role.WEIGHT_KEYFRAME)]:
        assert plan_roles(tensors, {"model/out.weight": parent}, level, SETTINGS, pairing)["model/out.weight"] is role


@pytest.mark.parametrize("frozen_step", [1 / 16, 1.0])
def test_a_weight_no_optimizer_state_has_the_shape_of_is_frozen(frozen_step):
    # Two of three 64x64 matrices are trained (which two, the shapes cannot tell): pairing uncertain.
    level = level_named("resume-only", fisher_allocation=False, frozen_step=frozen_step)
    tensors = {"model/a.weight": _t(64, 64), "model/b.weight": _t(64, 64, seed=1), "model/c.weight": _t(64, 64, seed=2),
               "model/backbone.weight": _t(64, 80, seed=9)}  # no optimizer state is 64x80
    for i in range(2):
        tensors[f"optimizer/state/{i}/exp_avg"] = _t(64, 64, seed=10 + i)
        tensors[f"optimizer/state/{i}/exp_avg_sq"] = _t(64, 64, seed=20 + i, scale=1e-3)
    pairing = map_optimizer(tensors)
    assert not pairing.certain
    roles, plans = _roles_and_plans(tensors, {}, level, pairing)
    frozen = "model/backbone.weight"
    assert roles[frozen] is (Role.FROZEN_WEIGHT if frozen_step < 1 else Role.WEIGHT_KEYFRAME)
    assert {roles[f"model/{name}.weight"] for name in "abc"} == {Role.WEIGHT_KEYFRAME}
    expected = level.weight_keyframe_step * _rms(tensors[frozen]) * min(frozen_step, 1.0)
    assert plans[frozen].params["step"] == pytest.approx(expected, rel=1e-12)
    assert plans[frozen].importance is None and plans[frozen].prune == 0.0  # unpaired: nothing to judge by
    # Once stored, a frozen weight is a residual like any other (frozen_step scales keyframes only).
    parents = {frozen: _parent_of(tensors[frozen])}
    assert plan_roles(tensors, parents, level, SETTINGS, pairing)[frozen] is Role.WEIGHT_RESIDUAL


def test_with_a_certain_pairing_a_weight_no_optimizer_parameter_claims_stays_lossless():
    level = level_named("resume-only")
    tensors = _adam_model()
    tensors["model/backbone.weight"] = _t(64, 80, seed=9)
    roles, _ = _roles_and_plans(tensors, {}, level, _pairing(tensors, 1e-3))
    assert roles["model/backbone.weight"] is Role.LOSSLESS
    assert roles["model/out.weight"] is not Role.LOSSLESS


@pytest.mark.parametrize("level", ["balanced", "extreme", "resume-only"])
def test_a_trained_parameter_of_whole_numbers_stays_lossless_at_every_level(level):
    tensors = _adam_model()
    mask = (np.arange(64 * 128) % 3 == 0).astype(np.float32)  # a 0/1 mask registered as a parameter, Adam-trained
    tensors["model/fc.weight"] = RawTensor("torch.float32", (64, 128), mask.view(np.uint8))
    roles, _ = _roles_and_plans(tensors, {}, level_named(level), _pairing(tensors, 1e-3))
    assert roles["model/fc.weight"] is Role.LOSSLESS
    assert roles["model/out.weight"] is not Role.LOSSLESS  # its neighbours are still weights


def test_sgd_momentum_and_its_weights_which_are_never_fast():
    level = level_named("resume-only", fisher_allocation=False)
    tensors = {"model/w.weight": _t(64, 64), "optimizer/state/0/momentum_buffer": _t(64, 64, seed=1, scale=0.1),
               "model/z.weight": _t(64, 64, seed=2), "optimizer/state/1/momentum_buffer": _t(64, 64, scale=0.0)}
    pairing = map_optimizer(tensors, ["w.weight", "z.weight"], [0, 1], {0: 10.0, 1: 10.0})
    roles, plans = _roles_and_plans(tensors, {}, level, pairing)
    assert roles["model/w.weight"] is Role.WEIGHT_KEYFRAME  # SGD's step is lr times momentum, not lr
    assert roles["optimizer/state/0/momentum_buffer"] is Role.SGD_MOMENTUM
    assert roles["optimizer/state/1/momentum_buffer"] is Role.LOSSLESS  # all zero: no scale for a step
    momentum = tensors["optimizer/state/0/momentum_buffer"]
    assert plans["optimizer/state/0/momentum_buffer"].params["step"] == pytest.approx(
        level.moment_step * _rms(momentum), rel=1e-12)
    assert plans["model/w.weight"].importance is None  # no second moment to judge pruning by


def test_a_momentum_buffer_beside_another_optimizers_state_is_not_sgds_and_stays_lossless():
    """RMSprop(momentum>0) keeps square_avg and a momentum_buffer in update units: SGD's bound is not its."""
    level = level_named("balanced", fisher_allocation=False)
    tensors = {"model/w.weight": _t(64, 64), "optimizer/state/0/momentum_buffer": _t(64, 64, seed=1, scale=0.1),
               "optimizer/state/0/square_avg": _t(64, 64, seed=3, scale=1e-6),
               "optimizer/state/0/step": RawTensor("torch.float32", (), np.zeros(1, np.float32).view(np.uint8))}
    pairing = map_optimizer(tensors, ["w.weight"], [0], {0: 1e-3})
    roles, _ = _roles_and_plans(tensors, {}, level, pairing)
    assert roles["optimizer/state/0/momentum_buffer"] is Role.LOSSLESS
    assert roles["optimizer/state/0/square_avg"] is Role.LOSSLESS
    del tensors["optimizer/state/0/square_avg"]  # the same buffer with SGD's state alone is SGD's momentum
    roles, _ = _roles_and_plans(tensors, {}, level, map_optimizer(tensors, ["w.weight"], [0], {0: 1e-3}))
    assert roles["optimizer/state/0/momentum_buffer"] is Role.SGD_MOMENTUM


def test_the_optimizer_level_keeps_weights_lossless_and_moments_follow_their_size():
    level = level_named("optimizer")
    assert not level.weights_lossy and level.moment_min_elements > 64
    tensors = _adam_model()
    roles, _ = _roles_and_plans(tensors, {}, level, _pairing(tensors, 1e-3))
    assert {roles[p] for p in tensors if p.startswith("model/")} == {Role.LOSSLESS}
    assert roles["optimizer/state/1/exp_avg_sq"] is Role.ADAM_SECOND_MOMENT
    assert roles["optimizer/state/1/exp_avg"] is Role.ADAM_FIRST_MOMENT
    assert roles["optimizer/state/2/exp_avg_sq"] is Role.LOSSLESS  # the bias's: below moment_min_elements
    assert roles["optimizer/state/2/exp_avg"] is Role.LOSSLESS  # no lossy second moment to code against


@pytest.mark.parametrize("exact_m", ["float16", "keep_exact"])
def test_a_first_moment_kept_lossless_keeps_its_second_moment_lossless_too(exact_m):
    """Only m's codec bounds the update m / sqrt(v): v on extreme's grid beside an exact m moved it 2.7x the bound.

    m of another item size (its chunks could not line up with v's), or asked to stay exact.
    """
    level = level_named("resume-only")
    tensors = _adam_model()
    keep_exact = set()
    if exact_m == "float16":
        tensors["optimizer/state/1/exp_avg"] = _t(64, 128, dtype=np.float16, torch_dtype="torch.float16")
    else:
        keep_exact.add("optimizer/state/1/exp_avg")
    pairing = _pairing(tensors, 1e-3)
    roles = plan_roles(tensors, {}, level, SETTINGS, pairing, keep_exact=keep_exact)
    assert roles["optimizer/state/1/exp_avg"] is Role.LOSSLESS
    assert roles["optimizer/state/1/exp_avg_sq"] is Role.LOSSLESS
    assert roles["optimizer/state/0/exp_avg_sq"] is Role.ADAM_SECOND_MOMENT  # the other pairs keep the level
    assert roles["optimizer/state/0/exp_avg"] is Role.ADAM_FIRST_MOMENT
    assert not {"optimizer/state/1/exp_avg", "optimizer/state/1/exp_avg_sq"} & set(
        plan_lossy(tensors, {}, level, SETTINGS, pairing, keep_exact=keep_exact))


def test_with_an_uncertain_pairing_every_large_float_matrix_is_a_weight_but_step_counters():
    level = level_named("resume-only", fisher_allocation=False)
    tensors = {"model/a.weight": _t(64, 64), "model/b.weight": _t(64, 64, seed=1), "model/step": _t(64, 64, seed=2),
               "model/zero.weight": _t(64, 64, scale=0.0), "model/small.weight": _t(8, 8, seed=3)}
    _adam(tensors, 0, "model/a.weight", 64, 64)
    pairing = map_optimizer(tensors)  # b could be the trained one as well as a
    assert not pairing.certain
    roles, plans = _roles_and_plans(tensors, {}, level, pairing)
    for weight in ("model/a.weight", "model/b.weight"):
        assert roles[weight] is Role.WEIGHT_KEYFRAME and plans[weight].importance is None
    for lossless in ("model/step", "model/zero.weight", "model/small.weight"):
        assert roles[lossless] is Role.LOSSLESS
    assert roles["optimizer/state/0/exp_avg"] is Role.ADAM_FIRST_MOMENT


def test_unpaired_tensors_that_are_not_weights_stay_lossless():
    """Pairing uncertain (no Adam moments): any big float tensor may be a weight, but not these."""
    import torch

    from ckptstore.policy.mapping import optimizer_state_paths
    from ckptstore.state import flatten

    weight = lambda seed, scale=1.0: torch.randn(128, 64, generator=torch.Generator().manual_seed(seed)) * scale
    others = {name: weight(3, 1e-3) for name in ("square_avg", "grad_avg", "sum", "max_exp_avg_sq", "exp_inf")}
    state = {"model": {"fc.weight": weight(0), "fc.weight_mask": (torch.arange(128 * 64) % 2).float().view(128, 64)},
             # Lightning keeps its optimizers in a list; a NaN key is a list in the skeleton, not a name
             "optimizer_states": [{"state": {0: others}, "param_groups": [{"params": [0], "lr": 1e-3}]}],
             float("nan"): 1.0,
             # get_state_dict keys by name; Composer keeps its model under state/model
             "optim": {"state": {"fc.weight": {"exp_avg_sq": weight(4, 1e-6)}}, "param_groups": []},
             "state": {"model": {"head.weight": weight(5)}}}
    flat = flatten(state)
    pairing = map_optimizer(flat.tensors)
    assert not pairing.certain
    roles = plan_roles(flat.tensors, {}, level_named("balanced"), SETTINGS, pairing,
                       optimizer_state=optimizer_state_paths(flat.skeleton))
    for path in ("model/fc.weight", "state/model/head.weight"):  # weights are still weights
        assert roles.pop(path) is Role.WEIGHT_KEYFRAME
    assert set(roles.values()) == {Role.LOSSLESS}, roles


def test_a_first_moment_beside_a_factored_second_moment_stays_lossless():
    tensors = {"model/w": _t(128, 64), "optimizer/state/0/exp_avg": _t(128, 64, seed=1, scale=1e-3),
               "optimizer/state/0/exp_avg_sq": RawTensor("torch.float32", (128 * 64,), np.abs(
                   _t(128 * 64, seed=2, scale=1e-6).data.view(np.float32)).view(np.uint8))}
    roles = plan_roles(tensors, {}, level_named("balanced"), SETTINGS, map_optimizer(tensors, ids=[0]))
    assert roles["optimizer/state/0/exp_avg_sq"] is Role.LOSSLESS  # beside an exact m, nothing bounds the update
    assert roles["optimizer/state/0/exp_avg"] is Role.LOSSLESS


def test_tensors_asked_to_stay_exact_do_whatever_their_role():
    tensors, level = _adam_model(), level_named("balanced")
    pairing = _pairing(tensors, 1e-3)
    assert plan_lossy(tensors, {}, level, SETTINGS, pairing).keys() >= {"model/fc.weight", "model/out.weight"}
    plans = plan_lossy(tensors, {}, level, SETTINGS, pairing, keep_exact={"model/fc.weight"})
    assert "model/fc.weight" not in plans and "model/out.weight" in plans


@pytest.mark.parametrize("beside", ["exp_avg_diff", "exp_avg_sq_row"])
def test_moments_beside_state_no_adam_keeps_are_another_optimizers_and_stay_lossless(beside):
    """Adan (exp_avg_diff) names its moments as Adam does: coded with Adam's bound, a resume drifted 3% (auditor)."""
    tensors = _adam_model()
    for index in range(4):
        tensors[f"optimizer/state/{index}/{beside}"] = tensors[f"optimizer/state/{index}/exp_avg"]
    roles, _ = _roles_and_plans(tensors, {}, level_named("balanced"), _pairing(tensors, 1e-3))
    assert {roles[f"optimizer/state/1/{m}"] for m in ("exp_avg", "exp_avg_sq", beside)} == {Role.LOSSLESS}
    assert roles["model/fc.weight"] is not Role.LOSSLESS  # its weights are still a weight's
    for extra in ("max_exp_avg_sq", "mu_product"):  # amsgrad's, NAdam's: Adam's moments all the same
        adam = {p: t for p, t in tensors.items() if not p.endswith(beside)}
        adam["optimizer/state/1/" + extra] = adam["optimizer/state/1/exp_avg_sq"]
        roles, _ = _roles_and_plans(adam, {}, level_named("balanced"), _pairing(adam, 1e-3))
        assert roles["optimizer/state/1/exp_avg"] is (Role.LOSSLESS if extra == "max_exp_avg_sq"
                                                      else Role.ADAM_FIRST_MOMENT), extra


def test_with_the_pairing_uncertain_a_buffer_told_by_its_name_stays_lossless():
    """Orthogonal's base was coded as a weight: the restored layer was orthogonal to 1.3e-2 (wrappers auditor)."""
    level = level_named("balanced", fisher_allocation=False)
    tensors = {"model/a.weight": _t(64, 64), "model/b.weight": _t(64, 64, seed=1),
               "model/q.parametrizations.weight.0.base": _t(64, 64, seed=3),
               "model/wn.weight_v": _t(64, 64, seed=4)}  # weight_norm's: a trained matrix (reader 9)
    tensors["optimizer/state/0/exp_avg"] = _t(64, 64, seed=10)
    tensors["optimizer/state/0/exp_avg_sq"] = _t(64, 64, seed=20, scale=1e-3)
    pairing = map_optimizer(tensors)
    assert not pairing.certain
    roles, _ = _roles_and_plans(tensors, {}, level, pairing)
    assert roles["model/q.parametrizations.weight.0.base"] is Role.LOSSLESS
    assert roles["model/a.weight"] is roles["model/wn.weight_v"] is Role.WEIGHT_KEYFRAME


@pytest.mark.parametrize("certain", [True, False])
def test_a_norm_weight_of_many_entries_stays_bit_exact(certain):
    """docs/guide.md promises biases and norm weights bit-exact at every level: a 1-D weight past min_elements (a
    wide LayerNorm's gain) stays lossless whether or not the pairing is certain (mutation audit round 13)."""
    tensors = {}
    _adam(tensors, 0, "model/fc.weight", 256, 64)
    _adam(tensors, 1, "model/norm.weight", 8192)
    if certain:
        pairing = map_optimizer(tensors, None, [0, 1], {0: 1e-4, 1: 1e-4})
    else:  # a model-only checkpoint: every float tensor may be a weight
        tensors = {k: v for k, v in tensors.items() if k.startswith("model/")}
        pairing = map_optimizer(tensors)
    for name in ("balanced", "extreme", "resume-only"):
        roles = plan_roles(tensors, {}, level_named(name, fisher_allocation=False), SETTINGS, pairing)
        assert roles["model/norm.weight"] == Role.LOSSLESS, name
        assert roles["model/fc.weight"] != Role.LOSSLESS, name


def test_a_matrix_named_as_a_norm_or_a_bias_stays_exact_and_one_merely_containing_norm_does_not():
    """2-D norm weights and biases were told only by being 1-D and quantized (auditor 382); `norm` inside another
    word or before `_proj` names an ordinary matrix."""
    tensors = {path: _t(64, 64, seed=i) for i, path in enumerate(
        ("model/h.ln_f.weight", "model/ln_f.bias", "model/enc.LayerNorm.weight", "model/norm_proj.weight",
         "model/denorm.weight"))}
    roles = plan_roles(tensors, {}, level_named("balanced", fisher_allocation=False), SETTINGS, map_optimizer(tensors))
    assert [roles[p] is Role.LOSSLESS for p in tensors] == [True, True, True, False, False]


def test_extremes_pruning_with_double_moments_beside_float_weights(repo, tmp_path):
    """A float64 v (moments kept in double) is not the importance that weighs extreme's pruning of float32 weights:
    read as float32-sized entries, it pruned the wrong ones and the restored weight missed extreme's bound
    (mutation audit round 13)."""
    import torch

    torch.manual_seed(0)
    path = tmp_path / "c.pt"

    def commit(w, step):
        state = {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(256, 64, dtype=torch.float64) * 1e-3,
                     "exp_avg_sq": torch.rand(256, 64, dtype=torch.float64) * 1e-6}}
        torch.save({"model": {"w": w}, "optimizer": {"state": state, "param_groups": [{"lr": 1e-4, "params": [0]}]}},
                   path)
        return repo.commit(path, lossy="extreme")

    w = torch.randn(256, 64)
    commit(w, 1)
    moved = w + 0.3 * torch.randn(256, 64)
    got = repo.checkout(commit(moved, 2))["model"]["w"]
    assert torch.linalg.norm(got - moved) / torch.linalg.norm(moved) <= 2 * level_named("extreme").max_weight_error
