"""Replay byte ranges of stored tensors: only the chunks covering them, down their chains.

A rank loading at another world size needs part of a stored shard. Chunks decode independently
and a residual's chunk i is coded against its base's chunk i (the same chunking down a lossless
chain), so cutting every record of a chain to the same run of chunks replays exactly those bytes,
each chunk still checked against its checksum.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ckptstore.hashing import TensorId
from ckptstore.policy.lossless import LOSSLESS_CODEC
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, replay
from ckptstore.repo import integrity, received
from ckptstore.repo.manifest import Manifest

if TYPE_CHECKING:
    from ckptstore.repo.repository import Repository

Span = tuple[int, int]  # [first chunk, end chunk)


def restore_ranges(repo: Repository, manifest: Manifest, ranges: dict[str, tuple[int, int]]
                   ) -> dict[str, tuple[int, np.ndarray]]:
    """For each path, the bytes [start, end) of its tensor (or more): (offset of the first byte, bytes).

    Whole chunks are replayed, so what comes back starts at or before `start` and ends at or after
    `end`. Records are checked as checkout checks them before anything is read.
    """
    paths = list(ranges)
    wanted = {manifest.entries[p].tensor for p in paths}

    def attempt(current: dict) -> tuple[dict, dict, dict]:
        spans = _spans(current, {p: manifest.entries[p].tensor for p in paths}, ranges)
        cut = {tid: _cut(record, spans.get(tid)) for tid, record in current.items()}
        return current, spans, replay(ChainSource(repo.store, cut), [cut[t] for t in wanted], repo.pool)

    records, spans, buffers = integrity.replay_current(repo, manifest, paths, attempt)
    received.check_whole(repo, records, wanted)
    out = {}
    for path in paths:
        tid = manifest.entries[path].tensor
        offsets = records[tid].chunk_offsets()
        first = spans.get(tid, (0, 0))[0]
        out[path] = (offsets[first] if first < len(offsets) else records[tid].raw_bytes, buffers[tid])
    return out


def _spans(records: dict[TensorId, TensorRecord], ids: dict[str, TensorId], ranges: dict[str, tuple[int, int]]
           ) -> dict[TensorId, Span]:
    """The run of chunks to replay for every record to cut; records left out are replayed whole.

    A residual's chunk i decodes against its base's chunk i, so every record of a chain gets the
    same run: the union of what the tensors through it need, widened across chains that share a
    base. A chain with a record that is not plainly lossless or chunked like the others, or a
    tensor with a chunk lacking a checksum, is replayed whole, and so is every chain touching it.
    """
    chains = {tid: _chain(records, tid) for tid in set(ids.values())}
    spans: dict[TensorId, Span] = {}
    whole: set[TensorId] = set()
    for path, tid in ids.items():
        need = _chunk_span(records[tid], *ranges[path])
        if need is None or not _cuttable(records, chains[tid]):
            whole.update(chains[tid])
            continue
        for member in chains[tid]:
            have = spans.get(member, need)
            spans[member] = (min(have[0], need[0]), max(have[1], need[1]))
    changed = True
    while changed:  # each pass only widens runs or grows `whole`: it ends
        changed = False
        for chain in chains.values():
            if any(member in whole for member in chain):
                changed |= not whole.issuperset(chain)
                whole.update(chain)
                continue
            union = (min(spans[m][0] for m in chain), max(spans[m][1] for m in chain))
            changed |= any(spans[m] != union for m in chain)
            spans.update(dict.fromkeys(chain, union))
    return {tid: span for tid, span in spans.items() if tid not in whole}


def _chain(records: dict[TensorId, TensorRecord], tid: TensorId) -> list[TensorId]:
    chain, current = [], records.get(tid)
    while current is not None and current.id not in chain:
        chain.append(current.id)
        current = records.get(current.base_id) if current.base_id else None
    return chain


def _cuttable(records: dict[TensorId, TensorRecord], chain: list[TensorId]) -> bool:
    """True when every record of the chain is lossless and chunked alike (chunk i codes against chunk i)."""
    layout = [c.raw_bytes for c in records[chain[0]].chunks]
    return all(records[t].codec == LOSSLESS_CODEC and [c.raw_bytes for c in records[t].chunks] == layout
               for t in chain)


def _chunk_span(record: TensorRecord, start: int, end: int) -> Span | None:
    """The chunks covering bytes [start, end) of `record`, or None when any chunk lacks a checksum."""
    if any(c.checksum is None for c in record.chunks):
        return None  # such a tensor is verified whole against its id: it must be replayed whole
    offsets = record.chunk_offsets()
    first = next((i for i, o in enumerate(offsets) if o + record.chunks[i].raw_bytes > start), len(offsets))
    last = next((i for i, o in reversed(list(enumerate(offsets))) if o < end), first - 1)
    return (first, max(first, last + 1))


def _cut(record: TensorRecord, span: Span | None) -> TensorRecord:
    """`record` reduced to the chunks of `span` (unchanged without one)."""
    if span is None or span == (0, len(record.chunks)):
        return record
    chunks = record.chunks[span[0]:span[1]]
    return replace(record, chunks=chunks, raw_bytes=sum(c.raw_bytes for c in chunks))
