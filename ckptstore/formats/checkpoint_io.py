"""Reading a checkpoint file or folder into records and raw tensors, and writing its files back."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ckptstore.errors import CheckpointFormatError, PickledObjectsError, UnsupportedStateError
from ckptstore.formats import (
    BLOB,
    BLOB_PATH,
    SAFETENSORS,
    TORCH,
    TORCH_SUFFIXES,
    Checkpoint,
    CheckpointFile,
    filemap,
    kind_on_disk,
    safetensors_file,
    torchcontainer,
    torchfile,
    torchzip,
)
from ckptstore.formats.atomic import write_parts
from ckptstore.formats.folder import file_mode, folder_listing
from ckptstore.state import RawTensor, escape, flatten, join, raw_from_bytes, unflatten


def from_state(obj: Any) -> Checkpoint:
    """An in-memory training state, stored as if it were one torch.save file."""
    flat = flatten(obj)
    return Checkpoint("state", [CheckpointFile("", TORCH, flat.skeleton, of_state=True)], flat.tensors)


def _read_blob(path: Path, prefix: str) -> tuple[Any, dict[str, RawTensor]]:
    data = filemap.array(path)
    entry = join(prefix, BLOB_PATH)
    return ["blob", entry], {entry: raw_from_bytes(data)}


def _read_file(path: Path, name: str, trust_pickle: bool, in_folder: bool) -> tuple[CheckpointFile, dict]:
    prefix = escape(name) if name else ""
    size = path.stat().st_size
    if size and safetensors_file.looks_like_safetensors(path):
        skeleton, tensors = safetensors_file.read(path, prefix)
        return CheckpointFile(name, SAFETENSORS, skeleton, size), tensors
    torch_like = size and torchfile.looks_like_torch_file(path)
    if torch_like and (not in_folder or path.suffix in TORCH_SUFFIXES):
        try:
            return _read_torch_file(path, name, prefix, size, trust_pickle)
        except (CheckpointFormatError, UnsupportedStateError) as exc:
            # in a folder, a file of objects (training_args.bin) is kept as its bytes; with
            # --trust-pickle that includes objects flatten cannot store or whose class is missing here
            pickled = isinstance(exc, PickledObjectsError) or (trust_pickle and isinstance(exc, UnsupportedStateError))
            if in_folder and pickled:
                skeleton, tensors = _read_blob(path, prefix)
                return CheckpointFile(name, BLOB, skeleton, size, "pickled objects, kept as bytes"), tensors
            # another program's zip or pickle with a torch suffix (a tokenizer's .bin): a plain file, below
            if not (torchfile.plain_zip(path) or torchfile.plain_pickle(path)):
                raise
    if not in_folder:
        raise CheckpointFormatError(
            f"{path} is not a checkpoint: expected a torch.save file, a safetensors file or a "
            "Hugging Face Trainer checkpoint folder"
        )
    skeleton, tensors = _read_blob(path, prefix)
    return CheckpointFile(name, BLOB, skeleton, size), tensors


def _read_torch_file(path: Path, name: str, prefix: str, size: int, trust_pickle: bool
                     ) -> tuple[CheckpointFile, dict[str, RawTensor]]:
    """A torch.save file: its state, and for a zip its container (so checkout can give its bytes back)."""
    is_zip = torchfile.is_zip(path)
    if is_zip and (why := torchfile.zip_not_whole(path)):
        raise CheckpointFormatError(f"{path} is not a whole torch.save file: {why} (cut off or damaged?)")
    # torch-free where the file is plain training state; torch's loader for everything else
    found = None if trust_pickle else torchzip.read_with_covers(path, prefix)
    flat, covers, orders, parts = found if found is not None else (
        flatten(torchfile.load(path, trust_pickle), prefix), None, {}, {})
    record = CheckpointFile(name, TORCH, flat.skeleton, size)
    split = torchcontainer.split(path, prefix, flat.tensors, covers, orders, parts) if is_zip else None
    if split is not None:
        record.container, flat.tensors[record.container["entry"]] = split
    return record, flat.tensors


def read_checkpoint(path: str | os.PathLike, trust_pickle: bool = False,
                    exclude: Iterable[str | os.PathLike] = ()) -> Checkpoint:
    """Read a checkpoint file or folder from disk without copying tensor data where avoidable.

    A folder's files are those `folder.folder_listing` finds (its links policy), less the folders in
    `exclude` (the repository's own directory); every file's permission bits are recorded, and its
    folders that hold no file are listed (a checkout makes them again).
    """
    path = Path(path)
    if kind_on_disk(path) == "file":
        record, tensors = _read_file(path, "", trust_pickle, in_folder=False)
        record.mode = file_mode(path, path.stat())
        return Checkpoint("file", [record], tensors)
    listing = folder_listing(path, exclude)
    found = listing.files
    if not found:
        raise CheckpointFormatError(f"{path} is an empty folder, not a checkpoint")
    checkpoint = Checkpoint("folder", [], empty_folders=listing.empty_folders)
    filemap.allow_open_files(len(found))  # the files' maps stay open until the commit is recorded
    for item in found:
        record, tensors = _read_file(item.path, item.name, trust_pickle, in_folder=True)
        record.mode = item.mode
        checkpoint.files.append(record)
        checkpoint.tensors.update(tensors)
    return checkpoint


def file_state(record: CheckpointFile, value_of: Callable[[str], Any]) -> Any:
    """The in-memory form of one file: nested state, dict of tensors, or bytes."""
    if record.format == SAFETENSORS:
        return safetensors_file.as_state(record.skeleton, value_of)
    if record.format == BLOB:
        return value_of(record.skeleton[1])
    return unflatten(record.skeleton, value_of, record.storage_bound)


def to_state(kind: str, files: list[CheckpointFile], value_of: Callable[[str], Any]) -> Any:
    """The whole checkpoint in memory; a folder becomes {file name: file state}."""
    if kind == "folder":
        return {record.name: file_state(record, value_of) for record in files}
    return file_state(files[0], value_of)


def write_file(record: CheckpointFile, dest: Path, value_of: Callable[[str], Any],
               raw_of: Callable[[str], RawTensor], exact: bool = False) -> None:
    """Write one file back: safetensors, blobs and torch zips byte for byte, other torch files via torch.save.

    `exact`: the tensors are the committed ones (a lossless commit); a torch zip's CRCs then stand as stored.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if record.format == TORCH and record.container is not None:
        torchcontainer.write(dest, record.container, raw_of, exact)
    elif record.format == TORCH:
        torchfile.save(unflatten(record.skeleton, value_of, record.storage_bound), dest)
    elif record.format == SAFETENSORS:
        safetensors_file.write(dest, record.skeleton, raw_of)
    else:
        write_parts(dest, [raw_of(record.skeleton[1]).data])
