"""Checking a commit's stored file structures (skeletons) without reading a tensor, for fsck.

Checkout finds a damaged or forged skeleton as it rebuilds the state (state.unflatten); fsck
decodes each one here with the same decoder, tensors replaced by their entries' dtype and shape,
so what checkout would refuse is found without replaying any tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptstore.errors import MalformedSkeletonError
from ckptstore.state import BYTES_DTYPE, TORCH_ITEMSIZE, _Unflattener, check_view


class _EntryUnflattener(_Unflattener):
    """state's decoder over stand-ins: a tensor node is checked against its entry, never built (no torch)."""

    def get(self, path: str) -> Any:
        entry = self.lookup(path)  # KeyError for a path the manifest lacks, as checkout's lookup raises
        return b"" if entry.dtype == BYTES_DTYPE else entry  # bytes and bytearray nodes decode as at checkout

    def decode(self, node: Any) -> Any:
        if isinstance(node, list) and node[:1] == ["tensor"]:  # state's table names _Unflattener.tensor itself
            return self.tensor(node)
        return super().decode(node)

    def tensor(self, node: list) -> Any:
        extras = node[2] if len(node) > 2 else {}
        entry = self.lookup(node[1])
        itemsize = TORCH_ITEMSIZE.get(entry.dtype)
        if "view" in extras and itemsize is not None:  # a dtype this table lacks: checkout's torch says so
            check_view(tuple(entry.shape), itemsize, *extras["view"])
        if extras.get("parameter"):
            _ = extras["requires_grad"]  # checkout reads it for an nn.Parameter: a KeyError there is damage
        return object()  # hashable and distinct, as a torch tensor is


def check_state_skeleton(skeleton: Any, entry_of: Callable[[str], Any]) -> None:
    """Decode a torch file's `skeleton` as checkout does; `entry_of(path)` gives each tensor's dtype and shape.

    MalformedSkeletonError where the structure is no flatten's (a list as a dict key, a path with no entry);
    a view placed outside its storage is the CorruptRecordError checkout raises.
    """
    try:
        _EntryUnflattener(entry_of).decode(skeleton)
    except MalformedSkeletonError.WALK_ERRORS as exc:
        raise MalformedSkeletonError.of(exc) from None
