"""Small payloads of a commit share pack objects; they read back bit-exact and fail loudly when damaged."""

import pytest
import torch

from ckptstore.codecs.bytegroup import XOR_MODES
from ckptstore.errors import CorruptObjectError
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore import pack
from ckptstore.repo import fsck
from tests.conftest import assert_same


def _state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    small = {f"layer{i}.bias": torch.randn(64 + i, generator=generator) for i in range(40)}
    small["steps"] = torch.arange(10, dtype=torch.int64)
    return {"small": small, "big": torch.randn(1 << 19, generator=generator)}  # 2 MiB: its own object


def _chunks_by_path(repo, cid):
    manifest = repo.manifest(cid)
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()}, with_bases=False)
    return {path: records[entry.tensor].chunks for path, entry in manifest.entries.items()}


def _object_files(repo):
    return sorted(p for p in (repo.dir / "objects").rglob("*") if p.is_file())


def test_small_tensors_share_one_pack_and_round_trip(repo):
    state = _state()
    cid = repo.commit(state)
    chunks = _chunks_by_path(repo, cid)
    small = [c for path, cs in chunks.items() if "small" in path for c in cs]
    assert {c.object_id for c in small} == {small[0].object_id} and all(c.length is not None for c in small)
    assert all(c.length is None for c in chunks["big"])
    assert len(_object_files(repo)) == 1 + len(chunks["big"]) + 1  # pack, big chunks, manifest
    assert_same(state, repo.checkout(cid))


def test_packs_split_at_their_size_limit(repo, monkeypatch):
    monkeypatch.setattr(pack, "PACK_BYTES", 1024)
    state = _state()
    cid = repo.commit(state)
    packs = {c.object_id for path, cs in _chunks_by_path(repo, cid).items() if "small" in path for c in cs}
    assert len(packs) > 5
    assert_same(state, repo.checkout(cid))
    state2 = _state(seed=1)  # residuals against packed parents, packed again
    assert_same(state2, repo.checkout(repo.commit(state2)))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_pack_names_the_pack_and_its_commits(repo, damage):
    cid = repo.commit(_state())
    pack = _chunks_by_path(repo, cid)["small/layer0.bias"][0].object_id
    path = repo.store.path_of(pack)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptObjectError) as info:
        repo.checkout(cid)
    assert pack in str(info.value) and cid[:12] in str(info.value)
    report = fsck(repo)
    assert pack in report.damaged_objects and cid in report.broken_commits


def test_residual_chains_record_plane_modes_and_round_trip(repo):
    states = [_state(seed=0)]
    for step in range(1, 4):
        states.append({"small": states[0]["small"], "big": states[0]["big"] + step * 1e-4})
    cids = [repo.commit(s) for s in states]
    with repo.db.read() as tx:
        tid = repo.manifest(cids[2]).entries["big"].tensor
        record = tensor_rows.load_records(tx, [tid], with_bases=False)[tid]
    assert record.depth == 2 and "plane_hints" not in record.params
    assert len(record.params["plane_modes"]) == len(record.chunks)
    assert set(record.params["plane_modes"][0]) & set(XOR_MODES)  # planes stored as residuals
    for cid, state in zip(cids, states):
        assert_same(state, repo.checkout(cid))
