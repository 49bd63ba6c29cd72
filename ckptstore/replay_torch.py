"""Replay onto a torch device: entropy decoding on CPU threads, the un-grouping where the tensor lands.

Chunks go in batches of about BATCH_BYTES: CPU threads decode each chunk of a batch into its slice
of a pinned staging buffer (a lossless byte-plane chain as its byte planes, one after another, the
XOR of its levels done on the CPU, where it costs less than moving every level's plane over the
bus; a lossy chain as its final bytes), then one host-to-device copy moves the batch and one
transposing copy per chunk interleaves its planes into the restored tensor on the device. Two
staging buffers alternate, so the CPU decodes the next batch while the device copies this one;
per chunk the device sees one operation and no synchronization (the previous design issued several
small operations and a stream sync per chunk from every thread: on an H200 that per-chunk cost,
not the bytes, set the pace).

Integrity: every object is verified against its id as it is read. Hashing the restored tensor
too (what CPU checkout does) would mean copying it back; pass `verify=True` to do that anyway.
The same code runs on device "cpu", which is how tests check it bit for bit without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from functools import partial

import numpy as np
import torch

from ckptstore.codecs import capabilities
from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import TensorId, tensor_id
from ckptstore.records import TensorRecord
from ckptstore.replay import ChainSource, object_ids_of, one_coding, run_here_and_on, unique

BATCH_BYTES = 16 << 20  # restored bytes per pinned staging buffer (a larger chunk gets a batch of its own)

Slot = tuple[TensorRecord, int, int, int]  # record, chunk index, offset in the tensor, size


def stage_chunk(source: ChainSource, record: TensorRecord, index: int, host: np.ndarray) -> int:
    """Decode chunk `index` of `record` into `host` (its size); returns the plane count, or 0 for final bytes.

    A lossless byte-plane chain lands as its planes one after another (XORed down its chain); the
    device interleaves them. Anything else lands as the chunk's bytes.
    """
    levels = source.levels(record, index)
    codec = capabilities(record.codec).planes
    if codec is not None and one_coding(levels):
        planes = codec.decode_planes([payload for _, payload in levels], host.size)
        grid = host.reshape(len(planes), -1)
        for j, plane in enumerate(planes):
            grid[j] = plane
        return len(planes) if len(planes) > 1 else 0
    source.decode_levels(levels, host)
    return 0


def _batches(slots: list[Slot], limit: int) -> list[list[Slot]]:
    """Consecutive slots grouped up to `limit` bytes each."""
    batches: list[list[Slot]] = []
    size = limit
    for slot in slots:
        if size + slot[3] > limit:
            batches.append([])
            size = 0
        batches[-1].append(slot)
        size += slot[3]
    return batches


def replay_on(source: ChainSource, wanted: Iterable[TensorRecord], pool: Executor, device: str | torch.device,
              verify: bool = False, on_chunk: Callable[[int], None] | None = None) -> dict[TensorId, torch.Tensor]:
    """Rebuild every wanted tensor as a flat uint8 torch tensor on `device`; chunks decode on `pool`."""
    target = torch.device(device)
    records = unique(wanted)
    outputs = {r.id: torch.empty(r.raw_bytes, dtype=torch.uint8, device=target) for r in records}
    slots = [(r, i, offset, chunk.raw_bytes) for r in records
             for i, (offset, chunk) in enumerate(zip(r.chunk_offsets(), r.chunks)) if chunk.raw_bytes]
    batches = _batches(slots, BATCH_BYTES)
    cuda = target.type == "cuda"
    capacity = max((sum(slot[3] for slot in batch) for batch in batches), default=0)
    staging = [torch.empty(capacity, dtype=torch.uint8, pin_memory=cuda) for _ in range(min(2, len(batches)))]
    stream = torch.cuda.Stream(target) if cuda else None
    released: list[torch.cuda.Event | None] = [None] * len(staging)
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for number, batch in enumerate(batches):
            buffer = number % len(staging)
            if released[buffer] is not None:
                released[buffer].synchronize()  # its previous batch has reached the device
            host = staging[buffer].numpy()
            starts = np.cumsum([0] + [slot[3] for slot in batch])
            jobs = [(Future(), partial(stage_chunk, source, record, index, host[start : start + size]))
                    for (record, index, _, size), start in zip(batch, starts)]
            run_here_and_on(pool, jobs)
            widths = [future.result() for future, _ in jobs]
            moved = staging[buffer][: starts[-1]].to(target, non_blocking=True)
            for (record, _, offset, size), start, width in zip(batch, starts, widths):
                into, part = outputs[record.id][offset : offset + size], moved[start : start + size]
                if width:
                    into.view(-1, width).copy_(part.view(width, -1).t())
                else:
                    into.copy_(part)
            if cuda:
                released[buffer] = torch.cuda.Event()
                released[buffer].record(stream)
            if on_chunk:
                for slot in batch:
                    on_chunk(slot[3])
    if cuda:
        stream.synchronize()
    if verify:
        for record in records:
            if tensor_id(record.dtype, record.shape, outputs[record.id].cpu().numpy()) != record.id:
                raise CorruptObjectError(object_ids_of(record),
                                         f"decoded on {target} to bytes that do not match tensor {record.id}")
    return outputs
