"""Placing a restored tensor as one of several views of a shared storage, and checking a view record first.

Checkout rebuilds the views that shared a storage when they were committed (state.mark_shared_views);
a damaged or forged record must neither place a view outside its storage nor claim a storage larger
than the file that held it.
"""

from __future__ import annotations

import math
from typing import Any

from ckptstore.errors import CorruptRecordError

# deflate's largest ratio: torch reads a zip's records stored or deflated, so no storage exceeds its file by more
MAX_INFLATION = 1032


def as_bits(torch: Any, tensor: Any) -> Any:
    """`tensor` viewed as the integers of its element size (itself where none is: complex128), bits unchanged."""
    unit = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size())
    return tensor.view(unit) if unit is not None else tensor


def scatter(torch: Any, storage: Any, value: Any, offset: int, stride: list[int]) -> None:
    """Write `value` into `storage` at a self-overlapping view's places, element by element.

    torch refuses to copy into such a view; its elements that share a place hold equal values in
    any file torch.save wrote, so which of them lands last does not matter.
    """
    places = torch.full(tuple(value.shape), offset, dtype=torch.int64)
    for dim, (size, step) in enumerate(zip(value.shape, stride)):
        shape = [1] * value.dim()
        shape[dim] = size
        places = places + (torch.arange(size, dtype=torch.int64) * step).reshape(shape)
    # as bits: index_put has no kernel for uint16/32/64, float8_e8m0fnu or float4 (a checkout of them failed)
    value = as_bits(torch, value)
    flat = torch.empty(0, dtype=value.dtype, device=value.device)
    flat.set_(storage, 0, (storage.nbytes() // value.element_size(),), (1,))
    flat[places.reshape(-1).to(value.device)] = value.reshape(-1)


class StorageBudget:
    """The bytes a file's shared storages may take in all: its size times deflate's largest ratio.

    A file holds every storage whole (deflated at most): storages claiming more are a forgery that would have
    checkout allocate what they name. None: an in-memory state's, whose storages no file bounds.
    """

    def __init__(self, file_size: int | None) -> None:
        self.left = None if file_size is None else file_size * MAX_INFLATION
        self.file_size = file_size
        self.sizes: dict[str, int] = {}

    def take(self, storage: str, nbytes: int) -> None:
        """Charge `storage` the most bytes any of its views claims; CorruptRecordError past the budget.

        Views of one storage may claim sizes apart (two numpy arrays from one address, one a prefix of the
        other); torch grows the storage made for the first to fit a later view that claims more (reviewer 440
        forged one far past it), so each claim beyond the largest so far is charged.
        """
        known = self.sizes.get(storage, 0)
        if nbytes <= known:
            return
        self.sizes[storage] = nbytes
        if self.left is None:
            return
        self.left -= nbytes - known
        if self.left < 0:
            raise CorruptRecordError(f"the view at {storage}", f"its file's storages claim more bytes than the "
                                     f"{self.file_size}-byte file they were read from can hold")


def check_view(shape: tuple[int, ...], itemsize: int, storage: str, nbytes: int, offset: int, stride: list[int]
               ) -> None:
    """CorruptRecordError unless a view of `shape` at `offset` by `stride` lies inside its storage of `nbytes`."""
    # elements up to the view's last one; a damaged record must not place it outside its storage
    end = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if math.prod(shape) else offset
    if not (offset >= 0 and min(stride, default=0) >= 0 and end * itemsize <= nbytes):
        raise CorruptRecordError(f"the view at {storage}", f"it does not fit its storage of {nbytes} bytes "
                                 f"(offset {offset}, shape {shape}, strides {stride})")
