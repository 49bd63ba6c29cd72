"""CPU replay: packs shared through a bounded cache, verification, mixed chains."""

import contextlib
import dataclasses
import sqlite3
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ckptstore import Repository
from ckptstore.errors import CkptError, CorruptObjectError, CorruptRecordError, StoreUnavailableError
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore import pack
from ckptstore.replay import ChainSource, one_coding, replay, run_here_and_on
from ckptstore.repo import remote
from tests.conftest import assert_same, received_lie


def test_pack_cache_bound_evicts_and_replay_stays_exact(repo, monkeypatch):
    monkeypatch.setattr(pack, "PACK_BYTES", 4096)  # many small packs
    generator = torch.Generator().manual_seed(0)
    states = [{f"t{i}": torch.randn(500, generator=generator) for i in range(60)}]
    states.append({k: v + 1e-3 for k, v in states[0].items()})
    cids = [repo.commit(s) for s in states]
    manifest = repo.manifest(cids[-1])
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()})
    wanted = [records[e.tensor] for e in manifest.entries.values()]
    packs = {c.object_id for r in records.values() for c in r.chunks if c.length is not None}
    assert len(packs) > 10
    store = _CountingStore(repo.store)
    with ThreadPoolExecutor(2) as pool:  # objects verified as read: packs are read whole and cached
        unbounded = replay(ChainSource(store, records), wanted, pool, verify=False)
        bounded_source = ChainSource(store, records, pack_cache_bytes=0)
        bounded = replay(bounded_source, wanted, pool, verify=False)
        mapped = replay(ChainSource(repo.store, records), wanted, pool)  # chunks verified: each payload read alone
    assert len(bounded_source.packs._packs) <= 2  # the newest pack, and one a second thread may be reading
    assert all(np.array_equal(mapped[t], unbounded[t]) for t in unbounded)
    for path, entry in manifest.entries.items():
        assert np.array_equal(bounded[entry.tensor], unbounded[entry.tensor])
        assert bounded[entry.tensor].tobytes() == states[-1][path].numpy().tobytes()


@pytest.mark.parametrize("param, value", [("level", 9), ("chunk_bytes", 1 << 20)], ids=["bookkeeping", "coding"])
def test_replay_planes_of_a_chain_with_mixed_params_matches_the_one_pass_decode(repo, param, value):
    """A base differing in bookkeeping (`level`) still decodes with its chain in one pass; one differing in a coding
    param is decoded level by level, then grouped into planes: a branch no test ran, since `level` is bookkeeping
    (mutation audit round 8). Either way, the planes are the tensor's bytes grouped by position."""
    base = torch.randn(1 << 18, generator=torch.Generator().manual_seed(1))
    cids = [repo.commit({"w": base}), repo.commit({"w": base + 1e-4})]
    tid = repo.manifest(cids[-1]).entries["w"].tensor
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, [tid])
    top = records[tid]
    assert top.depth == 1
    expected = ChainSource(repo.store, records).replay_planes(top, 0)
    mixed = dict(records)
    mixed[top.base_id] = dataclasses.replace(records[top.base_id],
                                             params=dict(records[top.base_id].params, **{param: value}))
    source = ChainSource(repo.store, mixed)
    assert one_coding(source.levels(top, 0)) == (param == "level")
    got = source.replay_planes(top, 0)
    assert [p.tobytes() for p in got] == [p.tobytes() for p in expected]
    grouped = (base + 1e-4).numpy().view(np.uint8).reshape(-1, 4).T
    assert [p.tobytes() for p in got] == [p.tobytes() for p in grouped]


def test_a_received_chain_whose_bases_loop_makes_a_commit_encode_anew_not_hang(tmp_path):
    """Two received records resting on each other, every payload a residual: the diagnosis of their failed check
    walked the loop for ever, where chain_problem never saw it (it checks the records the commit names), and the
    clone's first commit hung (mutation audit round 8)."""
    generator = torch.Generator().manual_seed(5)
    w0 = torch.randn(4096, generator=generator)
    w1 = w0 + 1e-4 * torch.randn(4096, generator=generator)
    w2 = w1 + 1e-4 * torch.randn(4096, generator=generator)
    with Repository.init(tmp_path / "origin") as origin:
        a = origin.manifest(origin.commit({"w": w0})).entries["w"].tensor
        b = origin.manifest(origin.commit({"w": w1})).entries["w"].tensor
    remote.clone(str(tmp_path / "origin"), tmp_path / "copy").close()
    for folder in (tmp_path / "origin", tmp_path / "copy"):  # the copy as a crafted remote's fetch left it
        received_lie(folder / ".ckpt", a, b, listed=folder.name == "copy")  # a holds b's residual chunks...
        with contextlib.closing(sqlite3.connect(folder / ".ckpt" / "ckpt.db")) as db, db:
            assert db.execute("SELECT base_id FROM tensors WHERE id = ?", (b,)).fetchone()[0] == a
            db.execute("UPDATE tensors SET base_id = ?, depth = 1 WHERE id = ?", (b, a))  # ...and rests on b
    with pytest.raises(CkptError, match="its chain loops back"):  # such records no longer travel (helper 314)
        remote.clone(str(tmp_path / "origin"), tmp_path / "second")
    restored = []

    def commit_in_a_clone():
        with Repository.open(tmp_path / "copy") as copy:
            restored.append(copy.checkout(copy.commit({"w": w2}))["w"])

    worker = threading.Thread(target=commit_in_a_clone, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the commit hangs"
    assert len(restored) == 1, "the commit failed"
    assert_same(w2, restored[0])


class _CountingStore:
    """The repository's store, recording whether each read asked for verification."""

    def __init__(self, store):
        self.store, self.reads = store, []

    def get(self, oid, verify=True):
        self.reads.append(verify)
        return self.store.get(oid, verify)

    def open_ranges(self):
        return self.store.open_ranges()


def test_verified_replay_hashes_tensors_not_objects_and_still_names_a_damaged_object(repo):
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(1 << 19, generator=generator)  # 2 MiB: an object of its own, not packed
    moved = base.clone()
    moved[:1000] += 1e-3  # every plane of the residual is an XOR against the base
    cids = [repo.commit({"w": base}), repo.commit({"w": moved})]
    tid = repo.manifest(cids[-1]).entries["w"].tensor
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, [tid])
    store = _CountingStore(repo.store)
    with ThreadPoolExecutor(2) as pool:
        out = replay(ChainSource(store, records), [records[tid]], pool)
        assert out[tid].tobytes() == moved.numpy().tobytes()
        assert store.reads and not any(store.reads)  # the tensor hash covered every byte
        oid = records[records[tid].base_id].chunks[0].object_id
        path = repo.store.path_of(oid)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptObjectError, match=oid):
            replay(ChainSource(store, records), [records[tid]], pool)


def test_a_replay_that_could_not_read_its_store_is_not_diagnosed_by_reading_it_again(repo):
    """The diagnosis of a lazy checkout whose origin was down fetched each object of the chain once more, each for
    the whole retry budget, only to end in the same error (auditor)."""
    tid, records = _records_of(repo, [{"w": torch.arange(100.0)}])
    store = _CountingStore(repo.store)
    down = StoreUnavailableError("object abc is not held here, and the origin it comes from cannot be read")
    assert ChainSource(store, records).diagnose(records[tid], down) is down
    assert store.reads == []


def _records_of(repo, states):
    cids = [repo.commit(s) for s in states]
    tid = repo.manifest(cids[-1]).entries["w"].tensor
    with repo.db.read() as tx:
        return tid, tensor_rows.load_records(tx, [tid])


def _without_checksums(records):
    return {k: dataclasses.replace(r, chunks=[dataclasses.replace(c, checksum=None) for c in r.chunks])
            for k, r in records.items()}


def test_chunks_are_checked_by_checksum_and_tensors_hashed_only_without_one(repo, monkeypatch):
    from ckptstore import replay as replay_module

    base = torch.randn((1 << 20) + 1000, generator=torch.Generator().manual_seed(3))  # over 4 MiB: two chunks
    tid, records = _records_of(repo, [{"w": base}, {"w": base + 1e-3}])
    assert all(c.checksum and len(c.checksum) == 32 for r in records.values() for c in r.chunks)
    hashed = []
    real_tensor_id = replay_module.tensor_id
    monkeypatch.setattr(replay_module, "tensor_id", lambda *a: hashed.append(1) or real_tensor_id(*a))
    expected = (base + 1e-3).numpy().tobytes()
    with ThreadPoolExecutor(2) as pool:
        assert replay(ChainSource(repo.store, records), [records[tid]], pool)[tid].tobytes() == expected
        assert hashed == []  # the checksums covered every byte
        assert replay(ChainSource(repo.store, records), [records[tid]], pool, by_id=True)[tid].tobytes() == expected
        assert len(hashed) == 1
        old = _without_checksums(records)  # a repository written before schema 0005
        assert replay(ChainSource(repo.store, old), [old[tid]], pool)[tid].tobytes() == expected
        assert len(hashed) == 2
        wrong = dict(records)
        top = records[tid]
        bad_chunk = dataclasses.replace(top.chunks[1], checksum="0" * 32)
        wrong[tid] = dataclasses.replace(top, chunks=[top.chunks[0], bad_chunk])
        with pytest.raises(CorruptRecordError, match="chunk 1 of tensor .* do not match its checksum, though every "
                           "object of its chain is sound"):  # the objects are whole: the record is what is wrong
            replay(ChainSource(repo.store, wrong), [wrong[tid]], pool)


def test_damage_that_still_decodes_is_caught_with_and_without_checksums(repo):
    base = torch.randn(1 << 19, generator=torch.Generator().manual_seed(4))
    tid, records = _records_of(repo, [{"w": base}])
    oid = records[tid].chunks[0].object_id
    path = repo.store.path_of(oid)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # the lowest mantissa plane is stored raw: the payload still decodes
    path.write_bytes(bytes(data))
    with ThreadPoolExecutor(2) as pool:
        for source_records in (records, _without_checksums(records)):
            with pytest.raises(CorruptObjectError, match=oid):
                replay(ChainSource(repo.store, source_records), [source_records[tid]], pool)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_jobs_run_in_order_on_the_caller_and_the_pool_and_may_wait_on_earlier_ones(threads):
    """Later jobs may wait for earlier ones (a first moment's chunk for its second moment's)."""
    ran_on: list[str] = []
    jobs: list[tuple[Future, object]] = []
    second_started = threading.Event()

    def job(index: int):
        ran_on.append(threading.current_thread().name)
        if index == 1:
            second_started.set()
        if index == 0 and threads > 1:  # holds its thread until another one, the caller or a helper, takes job 1
            assert second_started.wait(timeout=10)
        if index % 3 == 2:
            assert jobs[index - 1][0].result(timeout=10) == index - 1  # taken earlier, so already running
        if index == 9:
            raise ValueError("job 9 failed")
        return index

    jobs.extend((Future(), lambda i=i: job(i)) for i in range(40))
    with ThreadPoolExecutor(threads, thread_name_prefix="pool") as pool:
        run_here_and_on(pool, jobs)
    assert all(future.done() for future, _ in jobs)
    assert [f.result() for f, _ in jobs if f.exception() is None] == [i for i in range(40) if i != 9]
    assert "job 9 failed" in str(jobs[9][0].exception())
    assert len(set(ran_on)) <= threads  # the caller and threads - 1 of the pool's
    if threads <= 2:  # with one helper at most, job 0 could only wait out job 1 if the caller took one
        assert threading.current_thread().name in ran_on


def test_what_prune_keeps_of_a_lossy_measurement_does_not_split_a_chain_into_codings():
    """Re-encoded records keep rel_error, max_error and measured_as: bookkeeping, not how their payloads decode."""
    from ckptstore.records import TensorRecord

    def record(**measured):
        params = {"width": 4, "level": 1, "chunk_bytes": 4096, **measured}
        return TensorRecord("t" * 64, "torch.float32", (1024,), "bytegroup", params, None, 0, 4096, 100)

    levels = [(record(rel_error=0.01, max_error=0.02, measured_as="deadzone"), b""), (record(), b"")]
    assert one_coding(levels)


def test_a_base_of_another_size_is_a_chain_problem():
    """A received record whose base was a float16 tensor failed checkout with a bare codec message, and fsck said ok
    (hostile-input auditor); a first moment coded on its second of the other 16-bit type is no problem (reader 14)."""
    from ckptstore.records import Chunk, TensorRecord
    from ckptstore.replay import chain_problem

    def record(tid, dtype, raw, base=None):
        params = {"width": 4, "level": 1, "chunk_bytes": raw}
        return TensorRecord(tid * 64, dtype, (raw,), "bytegroup", params, base and base * 64, 1 if base else 0, raw,
                            10, [Chunk("a" * 64, raw)])

    keyframe, same = record("k", "torch.bfloat16", 4096), record("s", "torch.bfloat16", 4096, "k")
    m_on_v = record("m", "torch.float16", 4096, "k")  # Adam's m in fp16 coded on its v in bf16 (reader 14)
    other = record("o", "bytes", 1525, "k")
    records = {r.id: r for r in (keyframe, same, m_on_v, other)}
    assert chain_problem(same, records) is None and chain_problem(m_on_v, records) is None
    assert chain_problem(other, records) == (f"its base tensor {'k' * 64} holds 4096 bytes of torch.bfloat16, not "
                                             "1525 of bytes")


def test_a_version_1_deadzone_chain_decodes_each_level_with_its_own_records_step():
    """Version-1 payloads kept their step in their record's params, and keyframe and residual steps differ: the
    one-pass chain decode read every level's step from the newest record's params, so an older repository's lossy
    chain came back as a false "metadata damaged" (auditor helper 277)."""
    from ckptstore.codecs import deadzone, get_codec
    from ckptstore.hashing import chunk_checksum
    from ckptstore.objectstore.memory import MemoryObjectStore
    from ckptstore.records import Chunk, TensorRecord

    codec, rng = get_codec("deadzone"), np.random.default_rng(0)
    first = rng.standard_normal(256).astype(np.float32)
    second = first + rng.standard_normal(256).astype(np.float32) * np.float32(0.05)
    key_params, residual_params = ({"dtype": "torch.float32", "step": step, "rounding": 0.5} for step in (0.09, 0.012))
    key_payload, key_values = codec.encode_lossy(first.view(np.uint8), None, key_params)
    residual_payload, values = codec.encode_lossy(second.view(np.uint8), key_values, residual_params)
    assert deadzone._HEAD_V1.size == 4  # version 1: magic and has-base, no step
    as_v1 = lambda p: deadzone.MAGIC_V1 + p[3:4] + p[deadzone._HEAD.size:]  # noqa: E731
    store = MemoryObjectStore()
    key = TensorRecord("k" * 64, "torch.float32", (256,), "deadzone", key_params, None, 0, 1024, 0,
                       [Chunk(store.put(as_v1(key_payload)), 1024, checksum=chunk_checksum(key_values))])
    residual = TensorRecord("r" * 64, "torch.float32", (256,), "deadzone", residual_params, key.id, 1, 1024, 0,
                            [Chunk(store.put(as_v1(residual_payload)), 1024, checksum=chunk_checksum(values))])
    source = ChainSource(store, {key.id: key, residual.id: residual})
    out = ChainSource.decode_levels(source.levels(residual, 0), np.empty(1024, np.uint8))
    assert out.tobytes() == values.tobytes()
    with ThreadPoolExecutor(2) as pool:
        restored = replay(source, [residual], pool)
    assert restored[residual.id].tobytes() == values.tobytes()


def test_a_record_claiming_far_more_than_its_payload_decodes_to_is_damage_before_any_allocation(repo):
    """A received record of a 16 KiB tensor claiming 1 PiB: replay allocated from the claim ('out of memory: Unable to
    allocate', and fsck --full stopped there), or decoding failed naming neither tensor nor commit (auditor helper
    308). The payload's own header says what it decodes to; a real all-zero tensor's tiny payloads still pass."""
    cid = repo.commit({"w": torch.randn(4096, generator=torch.Generator().manual_seed(0)),
                       "z": torch.zeros(80 << 20, dtype=torch.uint8)})  # 20 chunks of zeros, ~370 bytes each
    tw, tz = (repo.manifest(cid).entries[name].tensor for name in ("w", "z"))
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, [tw, tz])
    claimed = 1 << 50
    false = dataclasses.replace(records[tw], raw_bytes=claimed,
                                chunks=[dataclasses.replace(records[tw].chunks[0], raw_bytes=claimed)])
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(CorruptRecordError, match=f"chunk 0 claims {claimed} bytes, but its stored payload .* "
                                                     "decodes to 16384") as caught:
            replay(ChainSource(repo.store, {tw: false}), [false], pool)
        assert caught.value.tensors == [tw]
        zeros = replay(ChainSource(repo.store, records), [records[tz]], pool)[tz]
    assert zeros.size == 80 << 20 and not zeros.any()


def _lossy_record(store, name, codec_id, params, values, base=None, base_values=None, claimed=None):
    """A one-chunk record of `values` coded by `codec_id` (against `base`'s reconstruction) claiming `claimed` bytes."""
    from ckptstore.codecs import get_codec
    from ckptstore.hashing import chunk_checksum
    from ckptstore.records import Chunk, TensorRecord

    payload, rebuilt = get_codec(codec_id).encode_lossy(values.view(np.uint8), base_values, params)
    size = claimed or values.nbytes
    record = TensorRecord(name * 64, "torch.float32", (size // 4,), codec_id, params, base and base.id,
                          1 if base else 0, size, 0,
                          [Chunk(store.put(payload), size, checksum=chunk_checksum(rebuilt))])
    return record, rebuilt


def test_a_lossy_record_claiming_far_more_than_its_payload_decodes_to_is_damage_before_any_allocation():
    """Deadzone, log2moment and normmoment payloads did not say their sizes: a forged record (a hostile remote's,
    its bytes hashing right) of a 16 KiB tensor claiming 1 PiB was believed up to the allocation. Their payloads' own
    symbol counts bound the claim now, as a lossless one's header does; real zero tensors still pass (auditor helper
    356)."""
    from ckptstore.objectstore.memory import MemoryObjectStore

    store, rng, claimed = MemoryObjectStore(), np.random.default_rng(0), 1 << 50
    weights, second = rng.standard_normal(4096).astype(np.float32), rng.random(4096).astype(np.float32)
    v, v_values = _lossy_record(store, "v", "log2moment", {"dtype": "torch.float32", "k": 4}, second)
    forged = [_lossy_record(store, "w", "deadzone", {"dtype": "torch.float32", "step": 0.01}, weights,
                            claimed=claimed)[0],
              _lossy_record(store, "l", "log2moment", {"dtype": "torch.float32", "k": 4}, second, claimed=claimed)[0],
              _lossy_record(store, "m", "normmoment", {"dtype": "torch.float32", "v_dtype": "torch.float32",
                                                       "step": 0.01, "eps": 1e-8}, weights, v, v_values,
                            claimed=claimed)[0]]
    with ThreadPoolExecutor(2) as pool:
        for record in forged:
            with pytest.raises(CorruptRecordError, match=f"chunk 0 claims {claimed} bytes, but its stored payload "
                                                         r".* decodes to 16384\. Nothing was restored") as caught:
                replay(ChainSource(store, {v.id: v, record.id: record}), [record], pool)
            assert caught.value.tensors == [record.id]
        zeros = np.zeros((80 << 20) // 4, np.float32)  # real: a few hundred bytes for 80 MiB, each size declared
        for name, codec_id, params in [("z", "deadzone", {"dtype": "torch.float32", "step": 0.01}),
                                       ("y", "log2moment", {"dtype": "torch.float32", "k": 4})]:
            real = _lossy_record(store, name, codec_id, params, zeros)[0]
            assert store.size(real.chunks[0].object_id) * 64 < real.raw_bytes
            assert not replay(ChainSource(store, {real.id: real}), [real], pool)[real.id].any()
