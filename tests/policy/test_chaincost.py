"""The lossless chain-length rule: chain while the modelled checkout stays faster than torch.load."""

import pytest

from ckptstore.errors import CkptError
from ckptstore.policy import AUTO, ChainCosts, EncodingSettings, chain_limit, cycle_after, plan_tensor
from ckptstore.policy.chaincost import AUTO_CAP, FALLBACK, MARGIN
from ckptstore.records import TensorRecord

# per byte: a keyframe decodes in 1 ns, each level adds 1 ns, torch.load reads in 5 ns
COSTS = {4: ChainCosts(keyframe=1e-9, level=1e-9, load=5e-9)}


def _record(depth: int, tid: str = "t", base: str = "b", stored: int = 100, cycle: list | None = None
            ) -> TensorRecord:
    params = {"chunk_bytes": 1024} | ({"cycle": cycle} if cycle else {})
    return TensorRecord(tid, "torch.float32", (256,), "bytegroup", params, base if depth else None, depth, 1024,
                        stored)


def test_a_chain_stops_where_the_modelled_checkout_crosses_torch_loads_time():
    deepest = COSTS[4].deepest()
    assert deepest == 3  # 1 + 3 levels = 4 ns <= 5 / 1.25; a fourth level would be 5 ns
    n = 1 << 20
    assert COSTS[4].restore_seconds(n, deepest) <= COSTS[4].load * n / MARGIN
    assert COSTS[4].restore_seconds(n, deepest + 1) > COSTS[4].load * n / MARGIN
    settings = EncodingSettings()
    assert settings.max_chain == AUTO
    for depth in range(deepest):
        assert plan_tensor("torch.float32", 1024, 4, _record(depth), settings, COSTS).base is not None
    stopped = plan_tensor("torch.float32", 1024, 4, _record(deepest), settings, COSTS)  # no anchor given
    assert stopped.base is None and stopped.limit == deepest


def test_more_decoding_threads_or_cheaper_levels_allow_longer_chains():
    assert ChainCosts(1e-9, 1e-9, 5e-9, workers=2).deepest() == 7
    assert ChainCosts(1e-9, 0.5e-9, 5e-9).deepest() == 6
    assert ChainCosts(1e-9, 0.0, 5e-9).deepest() == AUTO_CAP  # levels that cost nothing: the cap
    assert ChainCosts(5e-9, 1e-9, 5e-9).deepest() == 0  # a keyframe already slower: no residuals


def test_a_width_takes_the_costs_of_the_nearest_width_measured_at_or_below_it():
    """bf16 tensors took fp32's costs and 8-byte ones bf16's where the comparison was turned round (mutation audit)."""
    costs = {2: ChainCosts(keyframe=1e-9, level=1e-10, load=1e-8), 4: ChainCosts(keyframe=5e-9, level=5e-9, load=1e-8)}
    assert costs[2].deepest() != costs[4].deepest()
    limits = {width: chain_limit(AUTO, width, costs) for width in (1, 2, 4, 8)}
    assert limits == {1: costs[2].deepest(), 2: costs[2].deepest(), 4: costs[4].deepest(), 8: costs[4].deepest()}


def test_a_user_max_chain_is_a_hard_cap_and_auto_without_costs_falls_back():
    capped = EncodingSettings(max_chain=1)
    assert chain_limit(capped.max_chain, 4, COSTS) == 1
    assert plan_tensor("torch.float32", 1024, 4, _record(1), capped, COSTS).base is None
    assert chain_limit(AUTO, 4, None) == FALLBACK
    assert chain_limit(AUTO, 8, COSTS) == 3 and chain_limit(AUTO, 2, COSTS) == 3  # nearest width measured
    assert EncodingSettings(max_chain="5").max_chain == 5  # as the CLI hands it
    with pytest.raises(CkptError, match="max_chain"):
        EncodingSettings(max_chain="often")


def test_at_the_limit_the_residual_goes_against_the_parents_base_until_a_keyframe_pays():
    settings = EncodingSettings(max_chain=2)
    anchor = _record(1, tid="b", base="k", stored=300)
    # a keyframe of 1000 bytes, then residuals of 300 and 320: the cycle averages 540 a commit
    parent = _record(2, tid="t", base="b", stored=320, cycle=[1620, 3])
    plan = plan_tensor("torch.float32", 1024, 4, parent, settings, anchor=anchor)
    assert plan.base is anchor and plan.params["cycle"] == [1620, 3]
    # the last residual grew past the cycle's average: a new keyframe lowers it
    grown = _record(2, tid="t", base="b", stored=600, cycle=[1620 + 600, 4])
    assert plan_tensor("torch.float32", 1024, 4, grown, settings, anchor=anchor).base is None
    # records written before cycles were kept keyframe at the limit, as chains used to
    assert plan_tensor("torch.float32", 1024, 4, _record(2, base="b"), settings, anchor=anchor).base is None
    # only the parent's own base, one level down, with the same layout, may be the anchor
    assert plan_tensor("torch.float32", 1024, 4, parent, settings, anchor=_record(1, tid="x", base="k")).base is None
    assert plan_tensor("torch.float32", 1024, 4, parent, settings, anchor=_record(0, tid="b")).base is None
    assert plan_tensor("torch.float32", 2048, 4, parent, settings, anchor=anchor).base is None


def test_a_cycle_adds_each_residuals_bytes_and_a_keyframe_starts_a_new_one():
    assert cycle_after({"cycle": [1000, 1]}, 300, residual=True) == [1300, 2]
    assert cycle_after({"cycle": [1300, 2]}, 900, residual=False) == [900, 1]  # the residual did not pay
    assert cycle_after({}, 1000, residual=False) == [1000, 1]
    first = plan_tensor("torch.float32", 1024, 4, _record(0, stored=1000), EncodingSettings(max_chain=2))
    assert first.params["cycle"] == [1000, 1]  # a keyframe written before cycles: its own bytes start one
