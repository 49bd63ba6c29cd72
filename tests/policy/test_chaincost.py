"""The lossless chain-length rule: chain while the modelled checkout stays faster than torch.load."""

import pytest

from ckptstore.errors import CkptError
from ckptstore.policy import AUTO, ChainCosts, EncodingSettings, chain_limit, plan_tensor
from ckptstore.policy.chaincost import AUTO_CAP, FALLBACK, MARGIN
from ckptstore.records import TensorRecord

# per byte: a keyframe decodes in 1 ns, each level adds 1 ns, torch.load reads in 5 ns
COSTS = {4: ChainCosts(keyframe=1e-9, level=1e-9, load=5e-9)}


def _record(depth: int) -> TensorRecord:
    return TensorRecord("t", "torch.float32", (256,), "bytegroup", {"chunk_bytes": 1024}, "b" if depth else None,
                        depth, 1024, 100)


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
    stopped = plan_tensor("torch.float32", 1024, 4, _record(deepest), settings, COSTS)
    assert stopped.base is None and stopped.limit == deepest


def test_more_decoding_threads_or_cheaper_levels_allow_longer_chains():
    assert ChainCosts(1e-9, 1e-9, 5e-9, workers=2).deepest() == 7
    assert ChainCosts(1e-9, 0.5e-9, 5e-9).deepest() == 6
    assert ChainCosts(1e-9, 0.0, 5e-9).deepest() == AUTO_CAP  # levels that cost nothing: the cap
    assert ChainCosts(5e-9, 1e-9, 5e-9).deepest() == 0  # a keyframe already slower: no residuals


def test_a_user_max_chain_is_a_hard_cap_and_auto_without_costs_falls_back():
    capped = EncodingSettings(max_chain=1)
    assert chain_limit(capped.max_chain, 4, COSTS) == 1
    assert plan_tensor("torch.float32", 1024, 4, _record(1), capped, COSTS).base is None
    assert chain_limit(AUTO, 4, None) == FALLBACK
    assert chain_limit(AUTO, 8, COSTS) == 3 and chain_limit(AUTO, 2, COSTS) == 3  # nearest width measured
    assert EncodingSettings(max_chain="5").max_chain == 5  # as the CLI hands it
    with pytest.raises(CkptError, match="max_chain"):
        EncodingSettings(max_chain="often")
