"""Checking a commit's stored file structures (skeletons) without reading a tensor, for fsck and checkout.

Checkout finds a damaged or forged torch skeleton as it rebuilds the state (state.unflatten); fsck
decodes each one here with the same decoder, tensors replaced by their entries' dtype and shape,
so what checkout would refuse is found without replaying any tensor. A safetensors or blob
file's skeleton is checked here by both before anything is rebuilt, and a safetensors header
against the entries written after it (safetensors_file.check_header).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptstore.errors import MalformedSkeletonError
from ckptstore.formats import BLOB, SAFETENSORS, CheckpointFile, safetensors_file
from ckptstore.formats.views import check_view
from ckptstore.state import BYTES_DTYPE, TORCH_ITEMSIZE, _Unflattener


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
            self.budget.take(extras["view"][0], extras["view"][1])
        if extras.get("parameter"):
            _ = extras["requires_grad"]  # checkout reads it for an nn.Parameter: a KeyError there is damage
        return object()  # hashable and distinct, as a torch tensor is


def check_state_skeleton(skeleton: Any, entry_of: Callable[[str], Any], file_size: int | None = None) -> None:
    """Decode a torch file's `skeleton` as checkout does; `entry_of(path)` gives each tensor's dtype and shape.

    MalformedSkeletonError where the structure is no flatten's (a list as a dict key, a path with no entry);
    a view placed outside its storage, or a storage larger than its file of `file_size` bytes, is the
    CorruptRecordError checkout raises.
    """
    try:
        _EntryUnflattener(entry_of, file_size).decode(skeleton)
    except MalformedSkeletonError.WALK_ERRORS as exc:
        raise MalformedSkeletonError.of(exc) from None


def check_file_layout(record: CheckpointFile, entry_of: Callable[[str], Any]) -> None:
    """MalformedSkeletonError unless a safetensors or blob file's skeleton is one the reader writes.

    A forged one named entries the manifest lacks (KeyError at checkout), was no list (TypeError), named a
    tensor as a blob's bytes, or one entry twice. Checked before anything is rebuilt: it is one pass over
    the file's entries. A torch file's skeleton is decoded where it is rebuilt (check_state_skeleton for fsck).
    """
    try:
        if record.format == SAFETENSORS:
            _check_safetensors_layout(record.skeleton, entry_of)
        elif record.format == BLOB:
            tag, entry = record.skeleton
            if tag != "blob" or entry_of(entry).dtype != BYTES_DTYPE:
                raise MalformedSkeletonError(f"a blob skeleton {record.skeleton!r:.80} naming no bytes entry")
    except MalformedSkeletonError.WALK_ERRORS as exc:
        raise MalformedSkeletonError.of(exc) from None


def _check_safetensors_layout(skeleton: Any, entry_of: Callable[[str], Any]) -> None:
    """A safetensors skeleton: its header and gaps are bytes entries, each name and entry appears once."""
    tag, header_path, order = skeleton
    if tag != "safetensors" or type(order) is not list:
        raise MalformedSkeletonError(f"a safetensors skeleton tagged {tag!r:.40} with order {order!r:.60}")
    names = [name for name, _ in order if name is not None]
    entries = [header_path, *(entry for _, entry in order)]
    if len(set(names)) != len(names) or len(set(entries)) != len(entries):
        raise MalformedSkeletonError("a safetensors skeleton that names one tensor or entry twice")
    for name, entry in [(None, header_path), *order]:
        dtype = entry_of(entry).dtype
        if not (isinstance(name, str) or name is None) or (name is None and dtype != BYTES_DTYPE):
            raise MalformedSkeletonError(f"a safetensors skeleton whose entry {entry!r:.80} is a {dtype} "
                                         f"{'header or gap' if name is None else 'tensor'} named {name!r:.60}")


def check_headers(files: list[CheckpointFile], entry_of: Callable[[str], Any],
                  header_of: Callable[[str], bytes | None]) -> None:
    """Each safetensors file's stored header (`header_of(path)`; None: not read) against the entries after it."""
    for record in files:
        if record.format == SAFETENSORS and (header := header_of(record.skeleton[1])) is not None:
            safetensors_file.check_header(record.skeleton, header, entry_of)
