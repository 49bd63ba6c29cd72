"""Lossy plans for shards: pairing by fully qualified name, and whole-tensor facts from shard sums."""

from __future__ import annotations

import numpy as np

from ckptstore.policy import LEVELS, EncodingSettings
from ckptstore.policy.lossy import plan_lossy
from ckptstore.policy.lossy_shards import Shard, ShardStats, combine, pair_by_fqn, plan_shards, shard_sample
from ckptstore.policy.mapping import map_optimizer
from ckptstore.state import RawTensor

F32 = "torch.float32"


def test_moments_pair_with_the_weight_whose_name_ends_with_their_parameter():
    names = ["model.0.weight", "model.10.weight", "model.state.proj.weight", "optim.state.0.weight.exp_avg",
             "optim.state.0.weight.exp_avg_sq", "optim.state.0.weight.step", "optim.state.state.proj.weight.exp_avg",
             "optim.state.10.weight.exp_avg_sq", "optim.state.missing.weight.exp_avg"]
    slots, lrs = pair_by_fqn(names, {"0.weight": 1e-4, "state.proj.weight": 2e-4})
    assert slots == {"model.0.weight": {"exp_avg": "optim.state.0.weight.exp_avg",
                                        "exp_avg_sq": "optim.state.0.weight.exp_avg_sq"},
                     "model.10.weight": {"exp_avg_sq": "optim.state.10.weight.exp_avg_sq"},
                     "model.state.proj.weight": {"exp_avg": "optim.state.state.proj.weight.exp_avg"}}
    assert lrs == {"model.0.weight": 1e-4, "model.state.proj.weight": 2e-4}


def test_other_optimizer_state_marks_its_slot_but_a_parameter_named_like_it_stays_a_weight():
    """amsgrad's max and RMSprop's square_avg beside a moment mark the slot; `model.z.state.prev` (a submodule called
    `state`) was taken for state and its moments paired with `model.a.prev` (reader)."""
    names = ["model.a.prev", "model.z.state.prev", "model.w", "optim.state.a.prev.exp_avg",
             "optim.state.a.prev.exp_avg_sq", "optim.state.z.state.prev.exp_avg", "optim.state.z.state.prev.exp_avg_sq",
             "optim.state.w.momentum_buffer", "optim.state.w.square_avg"]
    slots, _ = pair_by_fqn(names, {})
    assert slots["model.z.state.prev"] == {"exp_avg": "optim.state.z.state.prev.exp_avg",
                                           "exp_avg_sq": "optim.state.z.state.prev.exp_avg_sq"}
    assert slots["model.a.prev"] == {"exp_avg": "optim.state.a.prev.exp_avg",
                                     "exp_avg_sq": "optim.state.a.prev.exp_avg_sq"}
    assert slots["model.w"] == {"momentum_buffer": "optim.state.w.momentum_buffer",
                                "square_avg": "optim.state.w.square_avg"}


def test_state_of_any_name_beside_a_moment_marks_its_slot():
    """Adan's exp_avg_diff was in no list of torch's names: its moments were coded as Adam's (auditor)."""
    names = ["model.w", *[f"optim.state.w.{m}" for m in ("exp_avg", "exp_avg_sq", "exp_avg_diff", "pre_grad", "step")]]
    slots, _ = pair_by_fqn(names, {})
    assert slots["model.w"] == {m: f"optim.state.w.{m}" for m in ("exp_avg", "exp_avg_sq", "exp_avg_diff", "pre_grad")}


def test_a_state_whose_param_ends_several_names_pairs_under_the_models_prefix_or_not_at_all():
    """`proj.weight`'s moments went to the first hit, `model.blocks.0.attn.proj.weight`, over its own (reader)."""
    moments = ("exp_avg", "exp_avg_sq")
    nested = ["model.blocks.0.attn.proj.weight", "model.proj.weight", "model.head.weight",
              *[f"optim.state.{p}.{m}" for p in ("blocks.0.attn.proj.weight", "proj.weight", "head.weight")
                for m in moments]]
    slots, lrs = pair_by_fqn(nested, {"blocks.0.attn.proj.weight": 1e-5, "proj.weight": 1e-3})
    assert slots["model.proj.weight"] == {m: f"optim.state.proj.weight.{m}" for m in moments}
    assert slots["model.blocks.0.attn.proj.weight"] == {m: f"optim.state.blocks.0.attn.proj.weight.{m}"
                                                        for m in moments}
    assert lrs == {"model.blocks.0.attn.proj.weight": 1e-5, "model.proj.weight": 1e-3}
    copies = ["model.0.weight", "ema.0.weight", *[f"optim.state.0.weight.{m}" for m in moments]]
    assert pair_by_fqn(copies, {}) == ({"ema.0.weight": {}, "model.0.weight": {}}, {})  # names cannot tell: unpaired


def _raw(values: np.ndarray) -> RawTensor:
    return RawTensor(F32, values.shape, values.astype(np.float32).view(np.uint8).reshape(-1))


def test_two_half_shards_are_planned_as_their_whole_tensor_is():
    rng = np.random.default_rng(0)
    whole = {"model.w": rng.normal(0, 0.02, (96, 64)), "optim.state.w.exp_avg": rng.normal(0, 1e-3, (96, 64)),
             "optim.state.w.exp_avg_sq": rng.uniform(1e-8, 1e-6, (96, 64)),
             "model.u": rng.normal(0, 0.5, (64, 96)), "optim.state.u.exp_avg": rng.normal(0, 1e-3, (64, 96)),
             "optim.state.u.exp_avg_sq": rng.uniform(1e-8, 1e-6, (64, 96))}
    level = LEVELS["balanced"]
    # the ordinary planner on whole tensors (its path form: model/w, optim/state/0/exp_avg, ...)
    paths = {"model.w": "model/w", "model.u": "model/u"}
    for i, p in enumerate("wu"):
        paths.update({f"optim.state.{p}.{k}": f"optim/state/{i}/{k}" for k in ("exp_avg", "exp_avg_sq")})
    tensors = {paths[k]: _raw(v) for k, v in whole.items()}
    optimizer = map_optimizer(tensors, ["w", "u"], lrs={0: 1e-3, 1: 1e-3})
    ordinary = plan_lossy(tensors, {}, level, EncodingSettings(), optimizer)
    stats, halves, places = {}, {}, {}
    for fqn, values in whole.items():
        for start in (0, values.shape[0] // 2):
            piece = values[start:start + values.shape[0] // 2]
            shard = Shard(fqn, (start, 0), piece.shape)
            x = piece.astype(np.float32).astype(np.float64).reshape(-1)
            stats[shard] = ShardStats(float(x @ x), float(x.sum()), x.size)
            halves[f"{fqn}@{start}"], places[f"{fqn}@{start}"] = _raw(piece), shard
    facts = combine(stats, dict.fromkeys(whole, F32), {k: v.shape for k, v in whole.items()},
                    {"w": 1e-3, "u": 1e-3}, level)
    plans, _ = plan_shards(halves, places, facts, {}, level, EncodingSettings())
    for key, plan in plans.items():
        fqn = key.split("@")[0]
        expected = ordinary[paths[fqn]].params
        for name in ("step", "max_error", "rounding", "k"):
            if name in expected:
                assert np.isclose(plan.params[name], expected[name], rtol=1e-6), (key, name)
    assert len(plans) == 12  # every half of every tensor quantized (each half of 3072 is below min_elements)


def test_shards_judge_their_bulk_by_their_whole_tensors_median_as_a_file_commit_does():
    """Trained rows in one shard, near-init rows in the other: a shard's own median is not the matrix's."""
    rng = np.random.default_rng(0)
    whole = {"model.w": np.concatenate([rng.normal(0, 0.1, (64, 96)), rng.normal(0, 1e-4, (128, 96))]),
             "optim.state.w.exp_avg": rng.normal(0, 1e-3, (192, 96)),
             "optim.state.w.exp_avg_sq": rng.uniform(1e-8, 1e-6, (192, 96))}
    level = LEVELS["balanced"]
    tensors = {"model/w": _raw(whole["model.w"])}
    ordinary = plan_lossy(tensors, {}, level, EncodingSettings(), map_optimizer(tensors))["model/w"].params
    stats, pieces, places = {}, {}, {}
    for fqn, values in whole.items():
        for start, stop in ((0, 64), (64, 192)):
            shard = Shard(fqn, (start, 0), values[start:stop].shape)
            x = values[start:stop].astype(np.float32).astype(np.float64).reshape(-1)
            stats[shard] = ShardStats(float(x @ x), float(x.sum()), x.size,
                                      shard_sample(x, shard.offsets, shard.sizes, values.shape))
            pieces[f"{fqn}@{start}"], places[f"{fqn}@{start}"] = _raw(values[start:stop]), shard
    facts = combine(stats, dict.fromkeys(whole, F32), {k: v.shape for k, v in whole.items()}, {"w": 1e-3}, level)
    plans, _ = plan_shards(pieces, places, facts, {}, level, EncodingSettings())
    magnitude = np.abs(whole["model.w"].astype(np.float32))
    for start in (0, 64):
        median = plans[f"model.w@{start}"].params["bulk_median"]
        assert median == ordinary["bulk_median"]  # the same sampled entries, read whole or shard by shard
        assert 0.8 < median / np.median(magnitude) < 1.25  # the matrix's, not a shard's (0.1 or 1e-4)


def test_a_second_optimizers_moment_does_not_take_over_a_slot():
    """With two optimizers' state for one parameter (an Adam beside a Lion, which keeps exp_avg alone), the later
    one's exp_avg replaced Adam's in the slot: Lion's momentum was coded as Adam's first moment against the other
    optimizer's v, a bound that does not hold (mutation audit round 13)."""
    names = ["model.fc.weight", "adam.state.fc.weight.exp_avg", "adam.state.fc.weight.exp_avg_sq",
             "lion.state.fc.weight.exp_avg"]
    slots, _ = pair_by_fqn(names, {})
    assert slots["model.fc.weight"]["exp_avg"] == "adam.state.fc.weight.exp_avg"


def test_a_sharded_commits_fisher_factors_leave_out_vectors_as_a_file_commits_do():
    """Only matrices enter the Fisher allocation of a sharded commit, as of a file commit: a big bias's v entered it
    and changed every matrix's factor, so a DCP save planned its weights unlike the same checkpoint committed as a
    file (mutation audit round 13)."""
    sizes = {"model.w": (256, 64), "model.b": (8192,), "model.u": (128, 128)}
    sizes.update({f"optim.state.{p}.{m}": sizes[f"model.{p}"] for p in "wbu" for m in ("exp_avg", "exp_avg_sq")})
    means = {"model.w": 1.0, "model.b": 1.0, "model.u": 2.0, "optim.state.w.exp_avg_sq": 1e-6,
             "optim.state.u.exp_avg_sq": 4e-6, "optim.state.b.exp_avg_sq": 1e-2}
    stats = {}
    for fqn, shape in sizes.items():
        n, mean = int(np.prod(shape)), means.get(fqn, 1e-3)
        stats[Shard(fqn, (0,) * len(shape), shape)] = ShardStats(mean * mean * n, mean * n, n)
    facts = combine(stats, dict.fromkeys(sizes, F32), sizes, {}, LEVELS["balanced"])
    assert set(facts.sensitivity) == {"model.w", "model.u"}
