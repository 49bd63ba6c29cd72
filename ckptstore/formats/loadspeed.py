"""torch.load's time to read a tensor's raw bytes: the yardstick a lossless chain's checkout must beat."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def torch_load_seconds(data: np.ndarray, repeats: int = 3) -> float:
    """Best of `repeats` torch.load calls (weights_only) of a torch.save file of `data`, from the page cache.

    The file holds `data` as 16 tensors, as a checkpoint holds many; the page cache is where a
    checkpoint just written, or read before, sits.
    """
    with torch_load_timer(data) as load_once:
        return min(load_once() for _ in range(repeats))


@contextmanager
def torch_load_timer(data: np.ndarray) -> Iterator[Callable[[], float]]:
    """A function timing one torch.load of a torch.save file of `data` (as above), while the file exists.

    For measurements that take turns with it, so that the machine's load at the time weighs on all alike.
    Every load's tensors are kept until the file goes, as a loaded checkpoint is: each load fills new
    memory (page faults and all) instead of the blocks the allocator would hand back from the last one.
    """
    import torch

    parts = np.array_split(np.ascontiguousarray(data).reshape(-1), 16)
    with tempfile.TemporaryDirectory(prefix="ckpt-loadspeed-") as folder:
        path = Path(folder) / "sample.pt"
        torch.save({f"t{i}": torch.from_numpy(part.copy()) for i, part in enumerate(parts)}, path)

        loaded = []

        def load_once() -> float:
            start = time.perf_counter()
            loaded.append(torch.load(path, map_location="cpu", weights_only=True))
            return time.perf_counter() - start

        try:
            yield load_once
        finally:
            loaded.clear()
