"""Measured sensitivity: the empirical Fisher of a calibration batch, and the step factors it gives."""

import math

import pytest
import torch

from ckptstore.errors import CkptError
from ckptstore.policy.sensitivity import measure_fisher, step_factors
from tests.conftest import Trainer


def _calibration(model):
    tokens = torch.arange(16 * 8).reshape(16, 8) % 64
    return torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), ((tokens + 1) % 64).reshape(-1))


def test_fisher_is_the_mean_squared_gradient_and_leaves_the_model_as_it_was():
    trainer = Trainer()
    trainer.train(3)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    fisher = measure_fisher(model, _calibration)
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert set(fisher) == matrices
    grads = torch.autograd.grad(_calibration(model), [dict(model.named_parameters())[n] for n in sorted(fisher)])
    for name, grad in zip(sorted(fisher), grads):
        assert math.isclose(fisher[name], float(grad.double().pow(2).mean()), rel_tol=1e-9)
    assert model.training, "train mode restored"
    for name, param in model.named_parameters():
        assert param.grad is None and torch.equal(param.detach(), before[name])


@pytest.mark.parametrize("bad", [lambda m: torch.ones(2, requires_grad=True).sum() * torch.tensor([1.0, 2.0]),
                                 lambda m: _calibration(m) * float("nan")])
def test_a_calibration_loss_that_is_not_one_finite_number_is_refused(bad):
    model = Trainer().model
    model.eval()
    with pytest.raises(CkptError, match="calibration"):
        measure_fisher(model, bad)
    assert not model.training, "eval mode restored after the error too"


def test_step_factors_spend_bits_where_the_loss_is_sensitive():
    factors = step_factors({"a": 1.0, "b": 4.0, "c": 16.0, "d": 0.0})
    assert "d" not in factors  # nothing measured: the level's own step
    assert (factors["a"], factors["b"], factors["c"]) == pytest.approx((2.0, 1.0, 0.5))  # geometric mean 1
    assert step_factors({"x": 1.0, "y": 1e6}) == {"x": 8.0, "y": 1 / 8}  # clamped
