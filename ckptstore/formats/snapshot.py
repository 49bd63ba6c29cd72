"""A snapshot of a live training state: what a background commit encodes while training goes on.

`snapshot(state, buffers)` flattens the state like `from_state`, but every tensor's bytes are a
copy in host memory that the training step cannot reach: CUDA tensors land in pinned buffers
(one synchronisation for all of them), CPU tensors in plain ones. The buffers are kept in
`HostBuffers` and lent again to the next snapshot of the same shapes, within a byte budget, so a
commit every few steps neither pins nor page-faults fresh memory each time. The skeleton, the
non-tensor state, is plain JSON built during the walk: a deep copy by construction.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptstore.formats import TORCH, Checkpoint, CheckpointFile
from ckptstore.state import RawTensor, flatten, raw_from_torch

DEFAULT_BUFFER_BUDGET = 4 << 30  # bytes of host buffers kept between snapshots


class HostBuffers:
    """Host buffers lent to snapshots and kept for the next one, up to `budget` bytes in all.

    A buffer past the budget is allocated for one snapshot and freed with it. Pinned buffers
    (for CUDA tensors) and plain ones are kept apart; both are uint8 torch tensors.
    """

    def __init__(self, budget: int = DEFAULT_BUFFER_BUDGET) -> None:
        self.budget = budget
        self.kept = 0  # bytes of the buffers this pool owns, lent or free
        self._free: dict[tuple[int, bool], list[Any]] = {}
        # each buffer counted in `kept`, by id: its (bytes, pinned) and itself (held, so no other buffer takes its id)
        self._owned: dict[int, tuple[tuple[int, bool], Any]] = {}
        # a kept buffer's typed view and numpy array, by (id, dtype, shape): making them costs 11 us a tensor
        self._views: dict[tuple[int, Any, tuple[int, ...]], tuple[Any, np.ndarray]] = {}

    def view(self, buffer: Any, dtype: Any, shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
        """`buffer` as a tensor of `dtype` and `shape`, and its bytes as numpy (RuntimeError where torch cannot)."""
        key = (id(buffer), dtype, shape)
        views = self._views.get(key)
        if views is None:
            views = (buffer.view(dtype).view(shape), buffer.numpy())
            if id(buffer) in self._owned:  # a one-off's id may be reused once it is freed
                self._views[key] = views
        return views

    def take(self, nbytes: int, pinned: bool) -> Any:
        """A buffer of `nbytes`: a kept one of that size, a new kept one within the budget, or a one-off.

        A one-off is never pinned: pinning costs more than the copy it would speed up.
        """
        import torch

        if self.kept > self.budget:  # the budget was lowered: what no snapshot holds goes now
            self.drop_free()
        free = self._free.get((nbytes, pinned))
        if free:
            return free.pop()
        while self.kept + nbytes > self.budget and self._free:  # free ones of other sizes: the state changed
            self._drop(next(iter(self._free)))
        if self.kept + nbytes > self.budget:
            return torch.empty(nbytes, dtype=torch.uint8)
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.kept += nbytes
        self._owned[id(buffer)] = ((nbytes, pinned), buffer)
        return buffer

    def give_back(self, buffers: list[Any]) -> None:
        """Buffers a finished commit no longer reads: kept ones wait for the next snapshot."""
        for buffer in buffers:
            owned = self._owned.get(id(buffer))
            if owned is not None:
                self._free.setdefault(owned[0], []).append(buffer)

    def drop_free(self) -> None:
        """Free the kept buffers no snapshot holds now (a snapshot took what it could use: the rest is stale)."""
        while self._free:
            self._drop(next(iter(self._free)))

    def _drop(self, key: tuple[int, bool]) -> None:
        dropped = set()
        for buffer in self._free.pop(key):
            del self._owned[id(buffer)]
            dropped.add(id(buffer))
            self.kept -= key[0]
        self._views = {k: v for k, v in self._views.items() if k[0] not in dropped}


class _Copier:
    """`to_raw` for flatten: each tensor copied into a lent host buffer."""

    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        self.lent: list[Any] = []
        self.devices: set[Any] = set()  # CUDA devices with copies in flight
        self.copied: set[str] = set()  # paths whose bytes are such copies
        self.targets: list[Any] = []  # CPU copies to make, in one call once the walk is done
        self.sources: list[Any] = []

    def __call__(self, tensor: Any, path: str) -> RawTensor:
        import torch

        if tensor.is_quantized or tensor.layout != torch.strided or tensor.is_meta or not tensor.numel():
            return raw_from_torch(tensor, path)  # its error, or an empty tensor (no bytes to share)
        # a plain tensor without grad is its own detach; a Parameter's detach is a plain tensor, copied batched
        source = tensor if type(tensor) is torch.Tensor and not tensor.requires_grad else tensor.detach()
        if source.is_conj() or source.is_neg():
            source = source.resolve_conj().resolve_neg()
        if source.dtype == torch.bool:  # copied as bytes: a bool copy writes each nonzero byte (2, 255) as 1
            source = source.view(torch.uint8)
        pinned = source.is_cuda
        buffer = self.buffers.take(source.numel() * source.element_size(), pinned)
        self.lent.append(buffer)
        try:
            target, data = self.buffers.view(buffer, source.dtype, source.shape)
        except RuntimeError:  # a dtype uint8 cannot be viewed as: copy its bytes as flatten reads them
            data = buffer.numpy()
            data[:] = raw_from_torch(source, path).data
        else:
            if source.device.type == "cpu" and type(source) is torch.Tensor:  # batched: wait() copies them
                self.targets.append(target)
                self.sources.append(source)
            else:  # CUDA into pinned memory, other devices and tensor subclasses: one copy each, now
                target.copy_(source, non_blocking=pinned)
                if pinned:
                    self.devices.add(source.device)
        self.copied.add(path)
        return RawTensor(f"torch.{str(tensor.dtype).removeprefix('torch.')}", tuple(tensor.shape), data)

    def wait(self) -> None:
        """Make the CPU copies and wait for the device-to-host ones: then the training step may change the tensors.

        The CPU copies go in one call once the walk is done (a 415-tensor MiniLM snapshot:
        51-56 ms, 57-63 ms copying each tensor as the walk reached it).
        """
        import torch

        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)
        for device in self.devices:
            torch.cuda.synchronize(device)


def _synchronize(device: Any) -> None:
    """Wait for `device`'s copies, as far as it can still say (it may be what failed)."""
    import torch

    try:
        torch.cuda.synchronize(device)
    except Exception:  # the original failure is the one to report
        pass


def snapshot(state: Any, buffers: HostBuffers) -> tuple[Checkpoint, list[Any]]:
    """`state` as a checkpoint that owns all its bytes, and the buffers lent to it (give them back when done).

    Tensors not copied into buffers (numpy arrays, bytes, empty tensors) are copied here: a
    numpy array in the state would otherwise still be the live one.
    """
    copier = _Copier(buffers)
    try:
        flat = flatten(state, to_raw=copier)
        copier.wait()
        buffers.drop_free()
        for path, raw in flat.tensors.items():
            if path not in copier.copied:
                raw.data = np.array(raw.data, copy=True)
        return Checkpoint("state", [CheckpointFile("", TORCH, flat.skeleton, of_state=True)], flat.tensors), copier.lent
    except BaseException:  # a Ctrl-C up to the return too: nobody else would give the buffers back
        for device in copier.devices:  # no copy may still be landing in a buffer given back
            _synchronize(device)
        buffers.give_back(copier.lent)
        raise

