"""The encoding half of a commit: new tensors become chunk objects, in parallel.

This is step 1 of the write path in DESIGN.md: no metadata is written until it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor

import numpy as np

from ckptstore.codecs import get_codec
from ckptstore.codecs.record import Chunk, TensorRecord
from ckptstore.hashing import ObjectId, TensorId
from ckptstore.objectstore import ObjectStore
from ckptstore.policy import EncodingSettings, after_attempt, chunk_sizes, plan_tensor
from ckptstore.replay import ChainSource
from ckptstore.state import RawTensor


def _encode_chunk(source: ChainSource, store: ObjectStore, codec_id: str, params: dict,
                  data: np.ndarray, base: TensorRecord | None, index: int) -> tuple[ObjectId, int, bool]:
    codec = get_codec(codec_id)
    base_chunk = None
    if base is not None:
        base_chunk = source.replay_chunk(base, index, np.empty(data.size, dtype=np.uint8))
    payload = codec.encode(np.ascontiguousarray(data), base_chunk, params)
    oid = store.put(payload)
    return oid, len(payload), base is not None and codec.needs_base(payload)


def encode_tensors(
    new: Mapping[TensorId, RawTensor],
    parents: Mapping[TensorId, TensorRecord | None],
    source: ChainSource,
    settings: EncodingSettings,
    pool: Executor,
    on_bytes: Callable[[int], None] | None = None,
) -> list[TensorRecord]:
    """Encode each new tensor (keyframe, or residual against `parents[id]`) and store its chunks."""
    jobs = []
    for tid, raw in new.items():
        plan = plan_tensor(raw.dtype, raw.nbytes, raw.itemsize, parents.get(tid), settings)
        sizes = chunk_sizes(raw.nbytes, plan.params["chunk_bytes"])
        futures, offset = [], 0
        for index, size in enumerate(sizes):
            piece = raw.data[offset : offset + size]
            futures.append((size, pool.submit(_encode_chunk, source, source.store, plan.codec,
                                              plan.params, piece, plan.base, index)))
            offset += size
        jobs.append((tid, raw, plan, futures))
    records = []
    for tid, raw, plan, futures in jobs:
        chunks, stored, uses_base = [], 0, False
        for size, future in futures:
            oid, length, needs_base = future.result()
            chunks.append(Chunk(oid, size))
            stored += length
            uses_base |= needs_base
            if on_bytes:
                on_bytes(size)
        base = plan.base if uses_base else None
        params = after_attempt(plan.params, uses_base) if plan.base is not None else plan.params
        records.append(TensorRecord(
            id=tid, dtype=raw.dtype, shape=raw.shape, codec=plan.codec, params=params,
            base_id=base.id if base else None, depth=base.depth + 1 if base else 0,
            raw_bytes=raw.nbytes, stored_bytes=stored, chunks=chunks,
        ))
    return records
