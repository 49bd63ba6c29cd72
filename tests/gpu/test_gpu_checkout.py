"""Checkout onto CUDA: bit-identical to the CPU checkout. Runs only where CUDA is present."""

import pytest
import torch

from tests.conftest import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_checkout_matches_cpu_bit_for_bit(repo, tmp_path):
    trainer = Trainer()
    for _ in range(3):
        trainer.train(3)
        torch.save(trainer.state(), tmp_path / "ckpt.pt")
        cid = repo.commit(tmp_path / "ckpt.pt")
    cpu = repo.checkout(cid)
    gpu = repo.checkout(cid, device="cuda")
    for name, tensor in cpu["model"].items():
        assert gpu["model"][name].is_cuda
        assert torch.equal(gpu["model"][name].cpu().view(torch.uint8), tensor.view(torch.uint8))
