"""Checkout onto CUDA: bit-identical to the CPU checkout. Runs only where CUDA is present."""

import pytest
import torch

import ckptstore
from ckptstore.policy import EncodingSettings
from tests.conftest import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tensors(state, prefix=""):
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}/{i}")
    elif torch.is_tensor(state):
        yield prefix, state


@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_cuda_checkout_matches_cpu_bit_for_bit(tmp_path, lossy):
    repo = ckptstore.Repository.init(tmp_path, encoding=EncodingSettings(max_chain=3, chunk_bytes=64 << 10))
    trainer = Trainer()
    for _ in range(4):
        trainer.train(3)
        state = trainer.state()
        state["big"] = torch.randn(600_000) * (1 + trainer.step)
        cid = repo.commit(state, lossy=lossy)
    cpu = dict(_tensors(repo.checkout(cid)))
    for gpu_state in (repo.checkout(cid, device="cuda"), ckptstore.load(cid, repo=repo, map_location="cuda")):
        gpu = dict(_tensors(gpu_state))
        assert gpu.keys() == cpu.keys()
        for name, tensor in cpu.items():
            assert gpu[name].is_cuda and gpu[name].dtype == tensor.dtype and gpu[name].shape == tensor.shape
            assert torch.equal(gpu[name].cpu().reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    repo.close()
