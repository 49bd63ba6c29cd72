"""Named queries on tensor records, their chunks and the objects that hold them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Set
from typing import Any

from ckptstore.errors import CorruptRecordError
from ckptstore.hashing import ObjectId, TensorId
from ckptstore.metadata.db import Tx
from ckptstore.records import Chunk, TensorRecord

RECORD_COLUMNS = ("id", "dtype", "shape", "codec", "params", "base_id", "depth", "raw_bytes", "stored_bytes")
CHUNK_COLUMNS = ("tensor_id", "position", "object_id", "raw_bytes", "offset", "length", "checksum")
_RECORDS = ("SELECT id, dtype, shape, codec, params, base_id, depth, raw_bytes, stored_bytes "
            "FROM tensors WHERE id IN ({ids})")  # RECORD_COLUMNS
_CHUNKS = ('SELECT tensor_id, position, object_id, raw_bytes, "offset", length, checksum FROM tensor_chunks '
           "WHERE tensor_id IN ({ids}) ORDER BY tensor_id, position")  # CHUNK_COLUMNS


def load_records(tx: Tx, ids: Iterable[TensorId], with_bases: bool = True,
                 problems: dict[TensorId, str] | None = None) -> dict[TensorId, TensorRecord]:
    """Records for `ids` and, with `with_bases`, every record down their chains.

    A record whose rows cannot be read as written (chunk positions not 0, 1, 2..., JSON that does
    not parse) is damaged: it goes into `problems` when given, else raises CorruptRecordError.
    """
    found: dict[TensorId, TensorRecord] = {}
    damaged: dict[TensorId, str] = {} if problems is None else problems
    parsed: dict[str, Any] = {}  # a checkpoint's tensors share a few shapes and params: parse each text once
    pending = {i for i in ids if i}
    while pending:
        batch, pending = sorted(pending, key=str), set()
        chunks = _chunks(tx, batch, damaged)
        for row in tx.rows_in(_RECORDS, batch):
            record = _record(row, chunks, parsed, damaged)
            if record is not None and record.id not in damaged:
                found[record.id] = record
                if with_bases and record.base_id and record.base_id not in found:
                    pending.add(record.base_id)
    if problems is None and damaged:
        tid, problem = next(iter(damaged.items()))
        raise CorruptRecordError(f"tensor {tid}", problem, tensors=[tid])
    return found


def parse_records(rows: Iterable[tuple], chunk_rows: Iterable[tuple], problems: dict[TensorId, str]
                  ) -> dict[TensorId, TensorRecord]:
    """Records from rows already read, made as load_records makes them: what push and fetch check before sending.

    `rows` hold RECORD_COLUMNS; `chunk_rows` CHUNK_COLUMNS, by tensor and position. A damaged one goes to `problems`.
    """
    chunks, parsed = _chunk_lists(chunk_rows, problems), {}
    records = (_record(row, chunks, parsed, problems) for row in rows)
    return {record.id: record for record in records if record is not None and record.id not in problems}


def _chunks(tx: Tx, batch: list[TensorId], problems: dict[TensorId, str]) -> dict[str, list[Chunk]]:
    """The chunks of the tensors in `batch` in order; a tensor whose positions skip or repeat goes to `problems`."""
    return _chunk_lists(tx.rows_in(_CHUNKS, batch), problems)


def _chunk_lists(rows: Iterable[tuple], problems: dict[TensorId, str]) -> dict[str, list[Chunk]]:
    """Chunk rows (by tensor and position) as each tensor's list; positions that skip or repeat go to `problems`."""
    chunks: dict[str, list[Chunk]] = {}
    for tensor, position, object_id, raw_bytes, offset, length, checksum in rows:
        listed = chunks.setdefault(tensor, [])
        if position != len(listed):
            problems.setdefault(TensorId(tensor), f"its chunk records jump to position {position!r} after "
                                                  f"{len(listed)} chunks (chunk rows were lost or damaged)")
        listed.append(Chunk(ObjectId(object_id), raw_bytes, offset, length, checksum))
    return chunks


def _record(row: tuple, chunks: dict[str, list[Chunk]], parsed: dict[str, Any], problems: dict[TensorId, str]
            ) -> TensorRecord | None:
    """One tensor record from its row and chunks; None (and a problem) when its JSON does not parse."""
    tid, dtype, shape, codec, param_text, base_id, depth, raw_bytes, stored_bytes = row
    try:
        for text in (shape, param_text):
            if text not in parsed:
                parsed[text] = json.loads(text)
        shape_value, params = tuple(parsed[shape]), parsed[param_text]
        if not isinstance(params, dict) or not all(isinstance(n, int) and n >= 0 for n in shape_value):
            raise ValueError(f"shape {shape!r}")
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: forged nesting
        problems[TensorId(tid)] = f"its shape or params do not parse ({exc})"
        return None
    return TensorRecord(id=TensorId(tid), dtype=dtype, shape=shape_value, codec=codec, params=dict(params),
                        base_id=TensorId(base_id) if base_id else None, depth=depth, raw_bytes=raw_bytes,
                        stored_bytes=stored_bytes, chunks=chunks.get(tid, []))


def existing_tensor_ids(tx: Tx, ids: Iterable[TensorId]) -> set[TensorId]:
    """The `ids` that already have a record."""
    return {TensorId(row[0]) for row in tx.rows_in("SELECT id FROM tensors WHERE id IN ({ids})", ids)}


def newly_stored(tx: Tx, records: Iterable[TensorRecord], object_sizes: Mapping[ObjectId, int],
                 replace: Set[TensorId] = frozenset()) -> int:
    """The bytes a commit adds to the repository: the objects it wrote (manifest included) no row holds yet.

    Counted by object, not by record: records share objects (a pack, identical chunks), and a
    record whose id is known (a lossy re-encoding that gave the parent's values, a received record
    kept) adds nothing of its own: objects only such records name are left to gc. Objects written
    anew for records in `replace` (their objects were lost) count, though their rows remain.
    """
    records = list(records)
    recorded = existing_tensor_ids(tx, [r.id for r in records]) - set(replace)
    named = lambda rs: {chunk.object_id for r in rs for chunk in r.chunks}  # noqa: E731
    unnamed = named(r for r in records if r.id in recorded) - named(r for r in records if r.id not in recorded)
    rewritten = named(r for r in records if r.id in replace)
    known = {row[0] for row in tx.rows_in("SELECT id FROM objects WHERE id IN ({ids})", list(object_sizes))}
    return sum(size for oid, size in object_sizes.items()
               if oid not in unnamed and (oid not in known or oid in rewritten))


def insert_records(tx: Tx, records: list[TensorRecord], object_sizes: dict[ObjectId, int]) -> None:
    """Record new tensors, their chunks and the objects those chunks live in.

    A tensor another writer recorded meanwhile keeps its own record: none of this writer's chunk
    rows join it (two machines may cut one tensor into chunks differently); gc collects the rest.
    """
    known = existing_tensor_ids(tx, [r.id for r in records])
    _insert_rows(tx, [r for r in records if r.id not in known], object_sizes)


def _insert_rows(tx: Tx, records: list[TensorRecord], object_sizes: dict[ObjectId, int]) -> None:
    tx.insert_ignore("tensors", ("id", "dtype", "shape", "codec", "params", "base_id", "depth", "raw_bytes",
                                  "stored_bytes"),
                  [(r.id, r.dtype, json.dumps(list(r.shape)), r.codec, json.dumps(r.params, sort_keys=True),
                    r.base_id, r.depth, r.raw_bytes, r.stored_bytes) for r in records])
    tx.insert_ignore("tensor_chunks", ("tensor_id", "position", "object_id", "raw_bytes", "offset", "length",
                                        "checksum"),
                  [(r.id, i, c.object_id, c.raw_bytes, c.offset, c.length, c.checksum)
                   for r in records for i, c in enumerate(r.chunks)])
    tx.insert_ignore("objects", ("id", "size"), list(object_sizes.items()))


def some_objects(tx: Tx, count: int) -> list[ObjectId]:
    """Up to `count` objects the metadata names (any; ordered so the same ones come each time)."""
    return [ObjectId(o) for o in tx.column("SELECT id FROM objects ORDER BY id LIMIT ?", (count,))]


def object_sizes(tx: Tx) -> dict[ObjectId, int]:
    """The size of every object, as recorded when a commit wrote it; a size that is no number is damage."""
    sizes = {}
    for oid, size in tx.rows("SELECT id, size FROM objects"):
        if not isinstance(size, int):  # a page of another table where this one's was (a misdirected write)
            raise CorruptRecordError(f"object {oid}", f"its recorded size {size!r} is not a number")
        sizes[ObjectId(oid)] = size
    return sizes


def replace_records(tx: Tx, records: list[TensorRecord], object_sizes: dict[ObjectId, int]) -> None:
    """Give existing tensor ids new records (the same bytes, encoded anew): codec, params, base and chunks."""
    tx.executemany("UPDATE tensors SET codec = ?, params = ?, base_id = ?, depth = ?, stored_bytes = ? WHERE id = ?",
                   [(r.codec, json.dumps(r.params, sort_keys=True), r.base_id, r.depth, r.stored_bytes, r.id)
                    for r in records])
    tx.execute_in("DELETE FROM tensor_chunks WHERE tensor_id IN ({ids})", sorted(r.id for r in records))
    _insert_rows(tx, records, object_sizes)  # the tensor rows exist (kept); chunks and objects go in


def save_records(tx: Tx, records: list[TensorRecord], object_sizes: dict[ObjectId, int],
                 replace: Set[TensorId] = frozenset()) -> None:
    """Record a commit's new tensors; those in `replace` (encoded again for lost objects) take their ids' rows.

    The id names the same bytes, so every record chained on it decodes again. Any other id
    recorded meanwhile (by another writer) keeps its row.
    """
    again = [r for r in records if r.id in replace]
    if again:
        replace_records(tx, again, object_sizes)
    insert_records(tx, [r for r in records if r.id not in replace], object_sizes)


def dependents(tx: Tx, tensor_ids: set[TensorId]) -> set[TensorId]:
    """`tensor_ids` and every tensor whose chain passes through one of them."""
    found, frontier = set(tensor_ids), set(tensor_ids)
    while frontier:
        children = {TensorId(r[0]) for r in tx.rows_in("SELECT id FROM tensors WHERE base_id IN ({ids})", frontier)}
        frontier = children - found
        found |= frontier
    return found


def resting_on(tx: Tx, tensor_ids: Iterable[TensorId]) -> set[TensorId]:
    """Those of `tensor_ids` that another record names as its base."""
    return {TensorId(r[0]) for r in tx.rows_in("SELECT DISTINCT base_id FROM tensors WHERE base_id IN ({ids})",
                                               tensor_ids)}


def rebase(tx: Tx, old: TensorId, new: TensorId) -> None:
    """Make every record chained on `old` chain on `new` (which holds the same bytes, cut alike).

    Those records, and what rests on them, are then at least a level deeper than `new`: where `new`
    is deeper than `old` was, their recorded depth (which the chain limit reads) grows to match.
    """
    tx.execute("UPDATE tensors SET base_id = ? WHERE base_id = ?", (new, old))
    front, seen = [new], {new}
    while front:  # down the chains; `seen` stops at a loop only forged rows could make
        depth = dict(tx.rows_in("SELECT id, depth FROM tensors WHERE id IN ({ids})", front))
        shallow = [(tid, depth[base] + 1) for tid, base, level in tx.rows_in(
            "SELECT id, base_id, depth FROM tensors WHERE base_id IN ({ids})", front)
            if tid not in seen and depth.get(base) is not None and level <= depth[base]]
        tx.executemany("UPDATE tensors SET depth = ? WHERE id = ?", [(level, tid) for tid, level in shallow])
        front = [tid for tid, _ in shallow]
        seen.update(front)


def tensors_in_objects(tx: Tx, object_ids: Iterable[ObjectId]) -> set[TensorId]:
    """Tensors with a chunk in any of `object_ids`."""
    return {TensorId(r[0]) for r in tx.rows_in(
        "SELECT DISTINCT tensor_id FROM tensor_chunks WHERE object_id IN ({ids})", object_ids)}


def list_unchecked(tx: Tx, ids: Iterable[TensorId]) -> None:
    """Mark the records of `ids` (just received from another repository) as unchecked (repo/received.py)."""
    tx.insert_ignore("unchecked_tensors", ("tensor_id",), [(tid,) for tid in sorted(set(ids))])


def unchecked_among(tx: Tx, ids: Iterable[TensorId]) -> set[TensorId]:
    """Those of `ids` whose records came from elsewhere and no commit here has checked."""
    return {TensorId(r[0]) for r in tx.rows_in("SELECT tensor_id FROM unchecked_tensors WHERE tensor_id IN ({ids})",
                                               ids)}


def mark_checked(tx: Tx, ids: Iterable[TensorId]) -> None:
    """Take `ids` (checked, or encoded here) off the unchecked list."""
    tx.execute_in("DELETE FROM unchecked_tensors WHERE tensor_id IN ({ids})", sorted(set(ids)))
