"""CPU replay: packs shared through a bounded cache, verification, mixed chains."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ckptstore.errors import CorruptObjectError
from ckptstore.replay import ChainSource, replay
from ckptstore.repo import catalog, writer


def test_pack_cache_bound_evicts_and_replay_stays_exact(repo, monkeypatch):
    monkeypatch.setattr(writer, "PACK_BYTES", 4096)  # many small packs
    generator = torch.Generator().manual_seed(0)
    states = [{f"t{i}": torch.randn(500, generator=generator) for i in range(60)}]
    states.append({k: v + 1e-3 for k, v in states[0].items()})
    cids = [repo.commit(s) for s in states]
    manifest = repo.manifest(cids[-1])
    with repo.engine.connect() as conn:
        records = catalog.load_records(conn, {e.tensor for e in manifest.entries.values()})
    wanted = [records[e.tensor] for e in manifest.entries.values()]
    packs = {c.object_id for r in records.values() for c in r.chunks if c.length is not None}
    assert len(packs) > 10
    with ThreadPoolExecutor(2) as pool:
        unbounded = replay(ChainSource(repo.store, records), wanted, pool)
        bounded_source = ChainSource(repo.store, records, pack_cache_bytes=0)
        bounded = replay(bounded_source, wanted, pool)
    assert len(bounded_source._packs) <= 2  # the newest pack, and one a second thread may be reading
    for path, entry in manifest.entries.items():
        assert np.array_equal(bounded[entry.tensor], unbounded[entry.tensor])
        assert bounded[entry.tensor].tobytes() == states[-1][path].numpy().tobytes()


def test_replay_planes_of_a_chain_with_mixed_params_matches_the_one_pass_decode(repo):
    base = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    cids = [repo.commit({"w": base}), repo.commit({"w": base + 1e-4})]
    tid = repo.manifest(cids[-1]).entries["w"].tensor
    with repo.engine.connect() as conn:
        records = catalog.load_records(conn, [tid])
    top = records[tid]
    assert top.depth == 1
    expected = ChainSource(repo.store, records).replay_planes(top, 0)
    mixed = dict(records)
    mixed[top.base_id] = dataclasses.replace(records[top.base_id], params=dict(records[top.base_id].params, level=9))
    got = ChainSource(repo.store, mixed).replay_planes(top, 0)  # decoded level by level, then grouped
    assert [p.tobytes() for p in got] == [p.tobytes() for p in expected]
    assert np.concatenate(got).size == top.chunks[0].raw_bytes


class _CountingStore:
    """The repository's store, recording whether each read asked for verification."""

    def __init__(self, store):
        self.store, self.reads = store, []

    def get(self, oid, verify=True):
        self.reads.append(verify)
        return self.store.get(oid, verify)


def test_verified_replay_hashes_tensors_not_objects_and_still_names_a_damaged_object(repo):
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(1 << 19, generator=generator)  # 2 MiB: an object of its own, not packed
    cids = [repo.commit({"w": base}), repo.commit({"w": base + 1e-3})]
    tid = repo.manifest(cids[-1]).entries["w"].tensor
    with repo.engine.connect() as conn:
        records = catalog.load_records(conn, [tid])
    store = _CountingStore(repo.store)
    with ThreadPoolExecutor(2) as pool:
        out = replay(ChainSource(store, records), [records[tid]], pool)
        assert out[tid].tobytes() == (base + 1e-3).numpy().tobytes()
        assert store.reads and not any(store.reads)  # the tensor hash covered every byte
        oid = records[records[tid].base_id].chunks[0].object_id
        path = repo.store.path_of(oid)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptObjectError, match=oid):
            replay(ChainSource(store, records), [records[tid]], pool)
