"""Named queries on tensor records, their chunks and the objects that hold them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ckptstore.hashing import ObjectId, TensorId
from ckptstore.metadata.db import Tx
from ckptstore.records import Chunk, TensorRecord

_RECORDS = ("SELECT id, dtype, shape, codec, params, base_id, depth, raw_bytes, stored_bytes "
            "FROM tensors WHERE id IN ({ids})")
_CHUNKS = ('SELECT tensor_id, object_id, raw_bytes, "offset", length, checksum FROM tensor_chunks '
           "WHERE tensor_id IN ({ids}) ORDER BY tensor_id, position")


def load_records(tx: Tx, ids: Iterable[TensorId], with_bases: bool = True) -> dict[TensorId, TensorRecord]:
    """Records for `ids` and, with `with_bases`, every record down their chains.

    A checkpoint's tensors share a few shapes and coding params, so each distinct JSON text is
    parsed once.
    """
    found: dict[TensorId, TensorRecord] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    params: dict[str, dict[str, Any]] = {}
    pending = {i for i in ids if i}
    while pending:
        batch, pending = sorted(pending), set()
        chunks: dict[str, list[Chunk]] = {}
        for tensor, object_id, raw_bytes, offset, length, checksum in tx.rows_in(_CHUNKS, batch):
            chunks.setdefault(tensor, []).append(Chunk(ObjectId(object_id), raw_bytes, offset, length, checksum))
        for row in tx.rows_in(_RECORDS, batch):
            tid, dtype, shape, codec, param_text, base_id, depth, raw_bytes, stored_bytes = row
            if shape not in shapes:
                shapes[shape] = tuple(json.loads(shape))
            if param_text not in params:
                params[param_text] = json.loads(param_text)
            found[TensorId(tid)] = TensorRecord(
                id=TensorId(tid), dtype=dtype, shape=shapes[shape], codec=codec,
                params=dict(params[param_text]), base_id=TensorId(base_id) if base_id else None,
                depth=depth, raw_bytes=raw_bytes, stored_bytes=stored_bytes, chunks=chunks.get(tid, []),
            )
            if with_bases and base_id and base_id not in found:
                pending.add(TensorId(base_id))
    return found


def existing_tensor_ids(tx: Tx, ids: Iterable[TensorId]) -> set[TensorId]:
    """The `ids` that already have a record."""
    return {TensorId(row[0]) for row in tx.rows_in("SELECT id FROM tensors WHERE id IN ({ids})", ids)}


def insert_records(tx: Tx, records: list[TensorRecord], object_sizes: dict[ObjectId, int]) -> None:
    """Record new tensors, their chunks and the objects those chunks live in."""
    tx.insert_ignore("tensors", ("id", "dtype", "shape", "codec", "params", "base_id", "depth", "raw_bytes",
                                  "stored_bytes"),
                  [(r.id, r.dtype, json.dumps(list(r.shape)), r.codec, json.dumps(r.params, sort_keys=True),
                    r.base_id, r.depth, r.raw_bytes, r.stored_bytes) for r in records])
    tx.insert_ignore("tensor_chunks", ("tensor_id", "position", "object_id", "raw_bytes", "offset", "length",
                                        "checksum"),
                  [(r.id, i, c.object_id, c.raw_bytes, c.offset, c.length, c.checksum)
                   for r in records for i, c in enumerate(r.chunks)])
    tx.insert_ignore("objects", ("id", "size"), list(object_sizes.items()))


def dependents(tx: Tx, tensor_ids: set[TensorId]) -> set[TensorId]:
    """`tensor_ids` and every tensor whose chain passes through one of them."""
    found, frontier = set(tensor_ids), set(tensor_ids)
    while frontier:
        children = {TensorId(r[0]) for r in tx.rows_in("SELECT id FROM tensors WHERE base_id IN ({ids})", frontier)}
        frontier = children - found
        found |= frontier
    return found


def tensors_in_objects(tx: Tx, object_ids: Iterable[ObjectId]) -> set[TensorId]:
    """Tensors with a chunk in any of `object_ids`."""
    return {TensorId(r[0]) for r in tx.rows_in(
        "SELECT DISTINCT tensor_id FROM tensor_chunks WHERE object_id IN ({ids})", object_ids)}
