"""Replay onto a torch device: entropy decoding on CPU threads, the rest where the tensor lands.

For lossless byte-plane chains, CPU threads only decompress each level's planes (zstd) into one
staging tensor per chunk (pinned when the target is CUDA); the copy to the device runs on the
thread's own CUDA stream, and the XOR of residual planes and the interleaving of bytes into
elements run there, so chunks decompress on the CPU while earlier ones replay on the GPU and the
intermediate chain steps never exist on the CPU. Other chains (lossy codecs) replay on the CPU
and are copied over.

Integrity: every object is verified against its id as it is read. Hashing the restored tensor
too (what CPU checkout does) would mean copying it back; pass `verify=True` to do that anyway.
The same code runs on device "cpu", which is how tests check it bit for bit without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

import numpy as np
import torch

from ckptstore.codecs import get_codec
from ckptstore.codecs.record import TensorRecord
from ckptstore.errors import CorruptObjectError
from ckptstore.hashing import TensorId, tensor_id
from ckptstore.replay import ChainSource, one_coding, unique

_local = threading.local()


def _stream(device: torch.device) -> contextlib.AbstractContextManager:
    """This thread's CUDA stream on `device` (a no-op context elsewhere)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(streams[device])


def replay_chunk_on(source: ChainSource, record: TensorRecord, index: int, out: torch.Tensor) -> None:
    """Rebuild chunk `index` of `record` into `out`, a flat uint8 slice on the target device."""
    nbytes = out.numel()
    if nbytes == 0:
        return
    levels = source.levels(record, index)
    codec = get_codec(record.codec)
    if not hasattr(codec, "plane_levels") or not one_coding(levels):
        host = source.decode_levels(levels, np.empty(nbytes, dtype=np.uint8))
        with _stream(out.device):
            out.copy_(torch.from_numpy(host))
            if out.is_cuda:
                torch.cuda.current_stream(out.device).synchronize()
        return
    planes = codec.plane_levels([payload for _, payload in levels], nbytes)
    width, rows = len(planes), nbytes // len(planes)
    staging = torch.empty((sum(len(p) for p in planes), rows), dtype=torch.uint8, pin_memory=out.is_cuda)
    rows_of = staging.numpy()
    position = 0
    for arrays in planes:
        for array in arrays:
            rows_of[position] = array
            position += 1
    with _stream(out.device):
        levels_on_device = staging.to(out.device, non_blocking=True)
        grid = out.view(rows, width)
        position = 0
        for j, arrays in enumerate(planes):
            plane = levels_on_device[position]
            for k in range(1, len(arrays)):
                plane = torch.bitwise_xor(plane, levels_on_device[position + k])
            grid[:, j] = plane
            position += len(arrays)
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()  # staging may be reused once this returns


def replay_on(source: ChainSource, wanted: Iterable[TensorRecord], pool: Executor, device: str | torch.device,
              verify: bool = False, on_chunk: Callable[[int], None] | None = None) -> dict[TensorId, torch.Tensor]:
    """Rebuild every wanted tensor as a flat uint8 torch tensor on `device`; chunks run on `pool`."""
    target = torch.device(device)
    outputs: dict[TensorId, torch.Tensor] = {}
    futures = []
    for record in unique(wanted):
        buffer = torch.empty(record.raw_bytes, dtype=torch.uint8, device=target)
        outputs[record.id] = buffer
        for index, offset in enumerate(record.chunk_offsets()):
            size = record.chunks[index].raw_bytes
            futures.append((size, pool.submit(replay_chunk_on, source, record, index, buffer[offset : offset + size])))
    for size, future in futures:
        future.result()
        if on_chunk:
            on_chunk(size)
    if verify:
        for record in unique(wanted):
            if tensor_id(record.dtype, record.shape, outputs[record.id].cpu().numpy()) != record.id:
                raise CorruptObjectError(",".join(c.object_id for c in record.chunks),
                                         f"decoded on {target} to bytes that do not match tensor {record.id}")
    return outputs
