"""The device replay (torch ops after CPU entropy decoding), checked bit for bit on the CPU."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ckptstore import Repository, replay_torch
from ckptstore.errors import CorruptObjectError
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.policy import EncodingSettings
from ckptstore.replay import ChainSource, replay
from ckptstore.repo import checkout as checkout_module
from tests.conftest import Trainer, assert_same


def _chained_repo(tmp_path, lossy=None):
    """Four commits of a real run with 64 KiB chunks and chains up to 3 deep, plus its last state."""
    repo = Repository.init(tmp_path / "r", encoding=EncodingSettings(max_chain=3, chunk_bytes=64 << 10))
    trainer = Trainer()
    for _ in range(4):
        trainer.train(2)
        state = trainer.state()
        state["big"] = torch.arange(300_000, dtype=torch.float32) * (1 + trainer.step * 1e-6)
        state["half"] = state["big"].to(torch.bfloat16)
        cid = repo.commit(state, lossy=lossy)
    return repo, cid


def _records(repo, cid):
    manifest = repo.manifest(cid)
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()})
    wanted = [records[e.tensor] for e in manifest.entries.values() if e.dtype.startswith("torch.")]
    return records, wanted


@pytest.mark.parametrize("batch_bytes", [None, 150_000])  # small batches: both staging buffers reused
@pytest.mark.parametrize("lossy", [None, "balanced"])
def test_torch_replay_on_cpu_matches_numpy_replay_bit_for_bit(tmp_path, monkeypatch, lossy, batch_bytes):
    if batch_bytes:
        monkeypatch.setattr(replay_torch, "BATCH_BYTES", batch_bytes)
    repo, cid = _chained_repo(tmp_path, lossy)
    records, wanted = _records(repo, cid)
    assert max(r.depth for r in wanted) >= 2 and any(len(r.chunks) > 1 for r in wanted)
    with ThreadPoolExecutor(2) as pool:
        expected = replay(ChainSource(repo.store, records), wanted, pool)
        got = replay_torch.replay_on(ChainSource(repo.store, records), wanted, pool, "cpu", verify=True)
    assert set(got) == set(expected)
    for tid, array in expected.items():
        assert got[tid].dtype == torch.uint8 and np.array_equal(got[tid].numpy(), array)
    repo.close()


def test_checkout_through_the_device_path_equals_cpu_checkout(tmp_path, monkeypatch):
    repo, cid = _chained_repo(tmp_path)
    expected = repo.checkout(cid)
    monkeypatch.setattr(checkout_module, "is_accelerator", lambda device: device is not None)
    assert_same(expected, repo.checkout(cid, device="cpu"))
    repo.close()


def test_damaged_object_on_the_device_path_names_object_and_commit(tmp_path, monkeypatch):
    repo, cid = _chained_repo(tmp_path)
    _, wanted = _records(repo, cid)
    oid = max(wanted, key=lambda r: r.raw_bytes).chunks[-1].object_id  # a pack: chunks are small here
    path = repo.store.path_of(oid)
    path.write_bytes(path.read_bytes()[:-1])
    monkeypatch.setattr(checkout_module, "is_accelerator", lambda device: device is not None)
    with pytest.raises(CorruptObjectError) as info:
        repo.checkout(cid, device="cpu")
    assert oid in str(info.value) and cid[:12] in str(info.value)
    repo.close()
