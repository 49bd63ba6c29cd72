"""The promise's quantities and the writer's retry rule, on known arrays."""

import numpy as np
import pytest

from ckptstore.errors import CkptError
from ckptstore.policy import fidelity, level_named


def _bytes(values):
    return np.asarray(values, np.float32).view(np.uint8)


def test_weights_are_judged_by_their_relative_error():
    original, rebuilt = np.array([3.0, 4.0]), np.array([3.0, 4.5])
    error_sq, norm_sq = fidelity.chunk_error("deadzone", _bytes(original), _bytes(rebuilt), {"dtype": "torch.float32"})
    assert (error_sq, norm_sq) == pytest.approx((0.25, 25.0))
    assert fidelity.within(error_sq, norm_sq, 0.1) and not fidelity.within(error_sq, norm_sq, 0.099)


def test_first_moments_are_judged_by_the_update_each_commit_takes():
    """u = m / sqrt(v + eps) with the original's v and the restored v: a coarse v with an exact m is an error."""
    params = {"dtype": "torch.float32", "v_dtype": "torch.float32", "eps": 0.0}
    m, v, v_restored = [1.0, 2.0], [4.0, 16.0], [16.0, 16.0]
    error_sq, norm_sq = fidelity.chunk_error("normmoment", _bytes(m), _bytes(m), params, _bytes(v), _bytes(v_restored))
    assert norm_sq == pytest.approx(0.5) and error_sq == pytest.approx(0.25 ** 2)


def test_second_moments_are_judged_by_their_relative_error():
    error_sq, norm_sq = fidelity.chunk_error("log2moment", _bytes([4.0]), _bytes([16.0]), {"dtype": "torch.float32"})
    assert (error_sq, norm_sq) == pytest.approx((144.0, 16.0))


def test_a_weights_bulk_is_judged_only_where_its_outliers_hold_most_of_its_norm():
    """Past 1 - 1/BULK_ALLOWANCE**2 of the norm the bulk may miss its allowance though the chunk keeps its bound;
    below, it cannot, and nothing is measured: a trained matrix's encoding stays as it was."""
    params = {"dtype": "torch.float32"}
    rest = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    spiked = rest.copy()
    spiked[7] = 1e4
    zeroed = np.where(np.arange(4096) == 7, spiked, 0).astype(np.float32)  # the rest rounded to zero
    error_sq, norm_sq = fidelity.chunk_error("deadzone", _bytes(spiked), _bytes(zeroed), params)
    assert fidelity.within(error_sq, norm_sq, 0.01)  # ||W'-W|| / ||W|| is 0.6%
    bulk = fidelity.bulk_error("deadzone", _bytes(spiked), _bytes(zeroed), params, 0.01, norm_sq)
    assert bulk is not None and not fidelity.within(*bulk, 0.01)  # the rest is all error
    assert bulk[1] == pytest.approx(float(np.dot(np.delete(rest, 7), np.delete(rest, 7))) * 4, rel=1e-5)
    assert fidelity.bulk_error("deadzone", _bytes(rest), _bytes(rest * 0.99), params, 0.01,
                               float(np.dot(rest, rest))) is None  # a Gaussian's far entries hold nothing
    sparse = np.where(np.arange(4096) % 10 < 6, 0, rest).astype(np.float32)  # 60% pruned: its median is 0
    assert fidelity.bulk_error("deadzone", _bytes(sparse), _bytes(sparse * 0.99), params, 0.01,
                               float(np.dot(sparse, sparse))) is None  # its nonzero values set the scale
    assert fidelity.bulk_error("deadzone", _bytes(spiked), _bytes(zeroed), params, None, norm_sq) is None
    assert fidelity.bulk_error("normmoment", _bytes(spiked), _bytes(zeroed), params, 0.01, norm_sq) is None


def test_no_bound_or_an_exact_zero_chunk_keeps_it():
    assert fidelity.within(1.0, 1.0, None) and fidelity.within(1.0, 1.0, 0.0)
    assert fidelity.within(0.0, 0.0, 0.01) and not fidelity.within(1e-9, 0.0, 0.01)


@pytest.mark.parametrize("measured", [0.011, 0.05, 1.0, 1e6])
def test_each_retry_at_least_halves_the_step_and_at_most_sixteenths_it(measured):
    factor = fidelity.finer(1.0, measured**2, 1.0, 0.01)
    assert 1 / 16 <= factor <= 0.5
    assert factor == pytest.approx(min(0.5, max(1 / 16, 0.009 / measured)))
    assert fidelity.finer(0.25, 1.0, 0.0, 0.01) == 0.125  # an all-zero chunk kept inexactly: halve


@pytest.mark.parametrize("knob, value", [("max_weight_error", "abc"), ("max_weight_error", -1.0), ("prune", 5),
                                         ("weights_lossy", "maybe"), ("max_chain", -3), ("min_elements", 1.5),
                                         ("moment_step", float("nan")), ("v_levels_log2", 30),
                                         ("fine_v_levels_log2", -40), ("moment_step", 0), ("frozen_step", 0.0),
                                         ("weight_keyframe_step", 0), ("weight_residual_step", 0),
                                         ("embedding_factor", 0)])
def test_a_knob_of_the_wrong_kind_or_range_is_refused_before_anything_is_encoded(knob, value):
    """A negative bound used to switch the level's promise off silently ('no bound' in ckpt show)."""
    with pytest.raises(CkptError, match=f"lossy knob {knob}="):
        level_named("balanced", **{knob: value})
    assert level_named("extreme", v_levels_log2=-3, prune=0.6, max_weight_error=0.0).prune == 0.6  # the presets' ranges
    off = level_named("balanced", prune=0, fast_move=0, settled_step=0, relative_step=0, max_update_error=0)
    assert (off.prune, off.fast_move, off.settled_step, off.relative_step, off.max_update_error) == (0, 0, 0, 0, 0)
    with pytest.raises(CkptError, match="unknown lossy knob 'name'"):  # the level's name is no knob
        level_named("balanced", name="extreme")
    with pytest.raises(CkptError, match="unknown lossy knob 'no_such_knob'; the knobs are listed in docs"):
        level_named(level_named("balanced"), no_such_knob=1)  # a level given as itself, a knob it lacks
    with pytest.raises(CkptError, match="unknown lossy knob 'momentstep' \\(did you mean 'moment_step'\\?\\)"):
        level_named("balanced", momentstep=2)  # not "LossyLevel.__init__() got an unexpected keyword argument"
    import numpy as np  # numpy scalars and what `--knob min_elements=1e4` parses to stand for plain numbers

    taken = level_named("balanced", min_elements=np.int64(1024), max_chain=1e1, codebooks=1, moment_step=np.float32(2))
    assert (taken.min_elements, taken.max_chain, taken.codebooks, taken.moment_step) == (1024, 10, True, 2.0)
    assert type(taken.min_elements) is int and type(taken.moment_step) is float
