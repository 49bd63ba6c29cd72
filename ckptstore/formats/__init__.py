"""Checkpoint inputs and outputs: torch.save files, safetensors files and Trainer-style folders.

A checkpoint is read into `CheckpointFile` records (one per file, each with a JSON skeleton) and
one flat dict of raw tensors keyed by logical path; checkout reverses it. The readers and writers
(`checkpoint_io`, numpy and the parsers) load on first use: `ckpt status` needs neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CheckpointFormatError

if TYPE_CHECKING:
    from ckptstore.state import RawTensor

TORCH, SAFETENSORS, BLOB = "torch", "safetensors", "blob"
TORCH_SUFFIXES = {".pt", ".pth", ".bin", ".ckpt", ".tar"}
BLOB_PATH = "%blob"


@dataclass
class CheckpointFile:
    """One file of a checkpoint: its name inside the checkpoint ("" for a lone file) and skeleton."""

    name: str
    format: str
    skeleton: Any
    size: int = 0
    opaque_reason: str = ""
    mode: int | None = None  # permission bits on disk (folder.MODE_BITS); None: a state, an older manifest, FAT
    # a torch.save zip's bytes that are not tensors, and where its tensors go (torchcontainer.py)
    container: dict[str, Any] | None = None
    of_state: bool = field(default=False, compare=False)  # an in-memory state's (not stored: its manifest's kind)

    @property
    def storage_bound(self) -> int | None:
        """The bytes a file's storages come from (views.StorageBudget); none for a state, which holds no file."""
        return None if self.of_state else self.size

    def to_json(self) -> dict[str, Any]:
        record = {"name": self.name, "format": self.format, "skeleton": self.skeleton, "size": self.size}
        if self.opaque_reason:
            record["opaque_reason"] = self.opaque_reason
        if self.container is not None:
            record["container"] = self.container
        if self.mode is not None:
            record["mode"] = self.mode
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> CheckpointFile:
        mode = record.get("mode")
        return cls(record["name"], record["format"], record["skeleton"], record.get("size", 0),
                   record.get("opaque_reason", ""), None if mode is None else int(mode), record.get("container"))


@dataclass
class Checkpoint:
    """A checkpoint split for storage: kind is "file", "folder" or "state" (an in-memory object)."""

    kind: str
    files: list[CheckpointFile]
    tensors: dict[str, RawTensor] = field(default_factory=dict)
    empty_folders: list[str] = field(default_factory=list)  # a folder's sub-folders holding no file (folder.py)


def kind_on_disk(path: Path, shown: str | os.PathLike | None = None) -> str:
    """"file" or "folder"; a missing path, or one that is neither (a FIFO, a device), refused naming `shown`."""
    if not path.exists():
        raise CheckpointFormatError(f"{shown or path} does not exist")
    if path.is_file():
        return "file"
    if not path.is_dir():
        raise CheckpointFormatError(f"{shown or path} is neither a file nor a folder")
    return "folder"


def destination(kind: str, record: CheckpointFile, dest: Path) -> Path:
    """Where a file of the checkpoint goes when the checkpoint is written to `dest`."""
    return dest / record.name if kind == "folder" else dest


_IO_NAMES = {"from_state", "read_checkpoint", "file_state", "to_state", "write_file"}


def __getattr__(name: str) -> Any:
    """`formats.read_checkpoint` and the other readers and writers, from `checkpoint_io` once asked for."""
    if name in _IO_NAMES:
        from ckptstore.formats import checkpoint_io

        return getattr(checkpoint_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
