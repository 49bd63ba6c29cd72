from ckptstore.policy import EncodingSettings, after_attempt, plan_tensor
from ckptstore.records import TensorRecord

SETTINGS = EncodingSettings(max_chain=3, chunk_bytes=1 << 20)


def _record(depth=0, **params):
    return TensorRecord("t", "torch.float32", (256,), "bytegroup", dict({"width": 4, "chunk_bytes": 1 << 20}, **params),
                        None, depth, 1024, 100)


def test_residual_against_a_parent_of_the_same_layout_until_the_chain_is_full():
    assert plan_tensor("torch.float32", 1024, 4, _record(depth=2), SETTINGS).base is not None
    assert plan_tensor("torch.float32", 1024, 4, _record(depth=3), SETTINGS).base is None
    assert plan_tensor("torch.float16", 1024, 2, _record(), SETTINGS).base is None
    assert plan_tensor("torch.float32", 2048, 4, _record(), SETTINGS).base is None
    assert plan_tensor("torch.float32", 1024, 4, None, SETTINGS).base is None


def test_tensors_whose_residuals_do_not_pay_back_off_then_retry():
    params = after_attempt({"width": 4, "chunk_bytes": 1 << 20}, residual_paid=False)
    attempts = []
    for _ in range(8):
        plan = plan_tensor("torch.float32", 1024, 4, _record(**params), SETTINGS)
        attempts.append(plan.base is not None)
        params = after_attempt(plan.params, residual_paid=False) if plan.base is not None else plan.params
    assert attempts == [False, True, False, False, True, False, False, False]
    paid = after_attempt(dict(params, residual_misses=3), residual_paid=True)
    assert "residual_misses" not in paid and plan_tensor("torch.float32", 1024, 4, _record(**paid), SETTINGS).base


def test_encoding_settings_take_zstds_own_levels_and_small_chunks():
    """Repositories made with these must open: zstd's fast negative levels and level 0 are its own."""
    for level in (-3, 0, 22):
        assert EncodingSettings(zstd_level=level).zstd_level == level
    assert EncodingSettings(chunk_bytes=512).chunk_bytes == 512
