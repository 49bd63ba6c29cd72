"""Background commits of CUDA state: pinned host buffers, reused across commits, within the budget. Needs CUDA."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Repository

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(32, 256, device="cuda")).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _cpu(state):
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_cpu(v) for v in state]
    return state.cpu() if torch.is_tensor(state) else state


def _assert_bits(a, b) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_bits(a[key], b[key])
    elif isinstance(a, list):
        for x, y in zip(a, b, strict=True):
            _assert_bits(x, y)
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                         b.contiguous().view(-1).view(torch.uint8))
    else:
        assert a == b


def test_cuda_state_is_snapshotted_into_pinned_buffers_reused_across_commits(tmp_path: Path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optimizer, 2)
    release = tmp_path / "release"
    monkeypatch.setenv("CKPT_WAIT_AT", f"background:start={release}")
    with Repository.init(tmp_path / "repo") as repo:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        expected = _cpu(copy.deepcopy(state))
        handle = repo.commit(state, "one", blocking=False)
        while not Path(str(release) + ".reached").exists():
            time.sleep(0.01)
        _train(model, optimizer, 1)  # in place, on the GPU, while the commit waits to start
        release.touch()
        first = handle.result()
        _assert_bits(expected, repo.checkout(first))
        buffers = repo._background.buffers
        kept = {key: buffer.data_ptr() for key, (_, buffer) in buffers._owned.items()}
        assert kept and all(pinned for (_, pinned), _ in buffers._owned.values())
        expected = _cpu(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))
        second = repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "two",
                             blocking=False).result()
        assert {key: buffer.data_ptr() for key, (_, buffer) in buffers._owned.items()} == kept  # the same memory
        _assert_bits(expected, repo.checkout(second))
        third = repo.commit({"model": model.state_dict()}, "three", blocking=False, buffer_budget=0,
                            allow_empty=True).result()
        assert buffers.kept == 0  # past the budget: one-off buffers, freed after the commit
        _assert_bits(_cpu(model.state_dict()), repo.checkout(third)["model"])
