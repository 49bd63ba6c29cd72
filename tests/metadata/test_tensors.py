"""Tensor records, their chunks and the objects that hold them (metadata/tensors.py)."""

import pytest

from ckptstore.hashing import ObjectId, TensorId
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.records import Chunk, TensorRecord

pytestmark = pytest.mark.both_backends


def _record(tid: str, objects: list[str], chunk_bytes: int) -> TensorRecord:
    """A float32 tensor of 4 * chunk_bytes bytes cut into one chunk per object of `objects`."""
    raw = 4 * chunk_bytes
    size = raw // len(objects)
    return TensorRecord(id=TensorId(tid), dtype="float32", shape=(raw // 4,), codec="raw", params={}, base_id=None,
                        depth=0, raw_bytes=raw, stored_bytes=raw,
                        chunks=[Chunk(ObjectId(oid), size, checksum=f"{i:032x}") for i, oid in enumerate(objects)])


def test_a_tensor_another_writer_recorded_meanwhile_keeps_its_own_record_and_chunks(db):
    """Two writers that both took a tensor for new, each cutting it into chunks of its own size: the second one's
    chunk rows from position 1 on joined the first one's record, which then covered more bytes than the tensor."""
    tid, other = "a" * 64, "b" * 64
    first = _record(tid, ["1" * 64], 1024)  # one chunk, as a writer with a large chunk_bytes cuts it
    second = _record(tid, [c * 64 for c in "2345"], 1024)  # four, as one with a quarter of that cuts it
    with db.write() as tx:
        tensor_rows.insert_records(tx, [first], {ObjectId("1" * 64): 4096})
    with db.write() as tx:  # the second writer decided the tensor was new before the first one's record went in
        tensor_rows.insert_records(tx, [second, _record(other, ["6" * 64], 256)],
                                   {ObjectId(c * 64): 1024 for c in "23456"})
    with db.read() as tx:
        assert tx.rows("SELECT tensor_id, position, object_id FROM tensor_chunks ORDER BY tensor_id, position") == [
            (tid, 0, "1" * 64), (other, 0, "6" * 64)]
        assert tensor_rows.load_records(tx, [tid, other]) == {tid: first, other: _record(other, ["6" * 64], 256)}


def test_records_whose_bases_loop_are_loaded_once_each(db):
    """Forged or damaged rows whose bases loop (t1 on t2, t2 on t1) load each record once: the loading queried the
    loop forever, a hang of every command that loads those records (mutation audit round 11)."""
    first, second = _record("a" * 64, ["1" * 64], 256), _record("b" * 64, ["2" * 64], 256)
    with db.write() as tx:
        tensor_rows.insert_records(tx, [first, second], {ObjectId(c * 64): 1024 for c in "12"})
        for tid, base in ((first.id, second.id), (second.id, first.id)):
            tx.execute("UPDATE tensors SET base_id = ?, depth = 1 WHERE id = ?", (base, tid))
    asked: list[str] = []
    with db.read() as tx:
        rows_in = tx.rows_in

        def once_each(sql, ids, *args):  # a record asked for again is the loop going round: stop it here
            if sql == tensor_rows._RECORDS:
                assert not set(ids) & set(asked), f"records {sorted(ids)} asked for again after {asked}"
                asked.extend(ids)
            return rows_in(sql, ids, *args)

        tx.rows_in = once_each
        assert set(tensor_rows.load_records(tx, [second.id])) == {first.id, second.id}
    assert sorted(asked) == sorted([first.id, second.id])
