"""Pack compaction: copy the payloads still needed out of packs that also hold dead ones, so those packs can go.

A pack lives as long as any payload in it does (docs/format.md), so removing some tensors of a
commit frees nothing while others of the same commit stay. `prune` calls this after choosing
what stays: each staying tensor with a payload in such a pack gets the same payload bytes at a
new place (a new pack), and its record's chunk rows are switched with the rest of the prune.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ckptstore.hashing import ObjectId, TensorId
from ckptstore.metadata import tensors as tensor_rows
from ckptstore.objectstore.pack import PackSlot, PackWriter
from ckptstore.records import Chunk, TensorRecord

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository


def partial_packs(chunks: Mapping[TensorId, list[tuple[ObjectId, int | None]]], staying: set[TensorId]
                  ) -> set[ObjectId]:
    """Packs holding payloads of `staying` tensors and of others (which are about to go)."""
    users: dict[ObjectId, set[TensorId]] = {}
    for tid, listed in chunks.items():
        for oid, length in listed:
            if length is not None:
                users.setdefault(oid, set()).add(tid)
    return {oid for oid, found in users.items() if found & staying and found - staying}


def compact(repo: Repository, chunks: Mapping[TensorId, list[tuple[ObjectId, int | None]]],
            staying: set[TensorId]) -> tuple[list[TensorRecord], dict[ObjectId, int]]:
    """Move the `staying` tensors' payloads out of partial packs; their new records and the new packs' sizes.

    The records keep codec, params, base and payload bytes; the payloads are copied durably into
    new packs. Nothing is recorded here.
    """
    partial = partial_packs(chunks, staying)
    movers = sorted((t for t in staying if any(o in partial for o, _ in chunks.get(t, []))),
                    key=lambda t: (min(str(o) for o, _ in chunks[t] if o in partial), t))  # one pack read at a time
    if not movers:
        return [], {}
    with repo.db.read() as tx:
        records = tensor_rows.load_records(tx, movers, with_bases=False)
    writer = PackWriter(repo.store)
    slots: dict[TensorId, list[PackSlot | None]] = {}
    held: tuple[ObjectId | None, bytes] = (None, b"")
    with repo.store.batch():
        for tid in movers:
            slots[tid] = []
            for chunk in records[tid].chunks:
                if chunk.object_id not in partial or chunk.length is None:
                    slots[tid].append(None)
                    continue
                if held[0] != chunk.object_id:
                    held = (chunk.object_id, repo.store.get(chunk.object_id))  # verified against its id
                slots[tid].append(writer.add(held[1][chunk.offset : chunk.offset + chunk.length]))
        writer.close()
    moved, sizes = [], {}
    for tid in movers:
        new_chunks = []
        for chunk, slot in zip(records[tid].chunks, slots[tid]):
            if slot is None:
                new_chunks.append(chunk)
                continue
            new_chunks.append(Chunk(slot.object_id, chunk.raw_bytes, slot.offset, chunk.length, chunk.checksum))
            sizes[slot.object_id] = max(sizes.get(slot.object_id, 0), slot.offset + slot.length)
        moved.append(replace(records[tid], chunks=new_chunks))
    return moved, sizes
