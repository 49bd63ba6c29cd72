"""DCP directories on disk: what `torch.distributed.checkpoint.FileSystemWriter` writes (torchtitan and others).

A DCP directory holds `.metadata`, a pickle of DCP's `Metadata` whose storage_data says where
each item lies (file, offset, length), and the `__<rank>_<n>.distcp` files: each tensor item a
`torch.save` of the shard, each bytes item the bytes DCP's planner wrote (its own pickle).

Reading never runs code of the file's choosing: `.metadata` is unpickled allowing only DCP's
metadata classes and torch's dtypes, sizes and layouts (`trust_pickle` lifts that), tensors are
read with `torch.load(weights_only=True)`, and bytes items are kept as the bytes stored. Writing
builds `Metadata` from a sharded commit's JSON (dcpmeta.py) and pickles it: that pickle is the
format plain `dcp.load` reads.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptstore.errors import (
    CheckpointFormatError,
    CorruptRecordError,
    MalformedSkeletonError,
    PickledObjectsError,
    UnsupportedStateError,
    listing,
    out_of_resources,
)
from ckptstore.formats import dcpmeta, filemap
from ckptstore.formats.atomic import atomic_write, missing_folder
from ckptstore.formats.dtypestate import bad_dtype_state
from ckptstore.formats.folder import is_temp_name
from ckptstore.formats.torchfile import numpy_safe_globals, refusal_reason
from ckptstore.state import RawTensor, flatten, materialize, raw_from_bytes, raw_from_torch, unflatten
from ckptstore.warn import warn_caller

METADATA = dcpmeta.METADATA_FILE
DATA_FILE = "__0_0.distcp"  # checkout writes every item into one file (FileSystemWriter's name for rank 0)

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name: a lookup, nothing more
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


# the records BUILD may fill in: DCP's dataclasses (not its enum, whose members every reader shares)
_BUILDABLE = {OrderedDict, _StorageInfo, *(getattr(dcp_metadata, name) for name in
                                           _METADATA_CLASSES[dcp_metadata.__name__] - {"_MEM_FORMAT_ENCODING"})}


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (told apart from a damaged pickle)."""


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's `.metadata`: its classes, torch's dtypes, sizes and layouts, and nothing else.

    Python's own unpickler, not the C one: the C unpickler sizes its memo by the largest index a
    pickle names (9 bytes naming 2**28 took 4 GiB before failing); this one keeps a dict. On a
    3,000-tensor metadata it took 0.29 s where the C one took 0.25 s.
    """

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name} is not one of DCP's metadata classes")

    def load_build(self) -> None:
        # BUILD sets attributes: on a class, an enum member or a dtype it would change every later
        # read in this process, so only DCP's fresh records (and OrderedDicts) may be built.
        if type(self.stack[-2]) not in _BUILDABLE:
            raise _Refused(f"BUILD on a {type(self.stack[-2]).__name__}")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


def read_metadata(path: str | os.PathLike, trust_pickle: bool = False) -> Metadata:
    """DCP's `Metadata` from the `.metadata` file of the DCP directory at `path`."""
    where = Path(path) / METADATA
    with open(where, "rb") as handle:
        try:
            metadata = pickle._Unpickler(handle).load() if trust_pickle else _MetadataUnpickler(handle).load()
        except _Refused as exc:
            raise PickledObjectsError(f"{where} holds objects beyond DCP's metadata ({exc}); commit it with "
                                      "--trust-pickle (trust_pickle=True from Python) only if you trust who "
                                      "wrote it") from None
        except Exception as exc:  # truncated, mangled or from another torch: many kinds, one answer
            if out_of_resources(exc):  # a limit met (memory, open files), not damage: the CLI names the limit
                raise
            raise CheckpointFormatError(f"{where} is not DCP metadata this torch {torch.__version__} reads "
                                        f"({exc!r})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def read(path: str | os.PathLike, trust_pickle: bool = False, used: list[Path] | None = None
         ) -> tuple[dict[str, Any], Iterator[tuple[str, RawTensor]]]:
    """A DCP directory as a sharded commit's parts: its metadata as JSON, and its stored items by manifest path.

    Where every item lies is checked first (files present, long enough); the items are then
    read one at a time as the iterator is consumed, so a commit holds a batch in memory, not all.
    `used` receives the data files `.metadata` names (mapped, not read yet).
    """
    path = Path(path)
    metadata = read_metadata(path, trust_pickle)
    filemap.allow_open_files(len(os.listdir(path)))  # a map per data file, kept until the commit is recorded
    files: dict[str, np.ndarray] = {}
    try:
        described, where = _locate(path, metadata, files)
    except (TypeError, AttributeError, ValueError, KeyError, IndexError) as exc:  # a field of the wrong kind
        raise CheckpointFormatError(f"{path / METADATA} is not DCP metadata: a field is mangled ({exc!r})") from None
    _warn_unstored(path, {METADATA, *(Path(name).parts[0] for name in files)})
    if used is not None:
        used.extend(path / name for name in files)

    def items() -> Iterator[tuple[str, RawTensor]]:
        for key, blob, item, sizes in where:
            yield key, (_pickled(blob, key, path, trust_pickle) if item is None else
                        _tensor(blob, item, sizes, f"{path}: {item['fqn']} at {key.rsplit('/', 2)[-2]}"))

    return described, items()


_Located = tuple[str, np.ndarray, dict[str, Any] | None, list[int] | None]  # path, bytes, tensor item, sizes


def _locate(path: Path, metadata: Metadata, files: dict[str, np.ndarray]) -> tuple[dict[str, Any], list[_Located]]:
    """The metadata as JSON, and each stored item's (manifest path, bytes, tensor item, shard sizes)."""
    described = dcpmeta.to_json(metadata)
    where: list[_Located] = []
    for item in described["items"]:
        if item["type"] == "bytes":
            where.append((item["key"], _slice(path, files, metadata, MetadataIndex(item["fqn"])), None, None))
            continue
        problem = dcpmeta.chunk_problem(item)
        if problem is not None:
            raise CheckpointFormatError(f"{path}: the DCP metadata of {item['fqn']!r} is impossible: {problem}")
        for offsets, sizes, key in item["chunks"]:
            where.append((key, _slice(path, files, metadata, MetadataIndex(item["fqn"], offsets)), item, sizes))
    return described, where


_EMPTY_SHARD = re.compile(r"__\d+_\d+\.distcp")


def _warn_unstored(path: Path, stored: set[str]) -> None:
    """Say which entries of the folder a sharded commit leaves out (it stores what `.metadata` names).

    Empty shard files are DCP's own (a writer thread or rank that got no items): nothing is lost.
    """
    others = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(path)
                    if e.name not in stored and not (_EMPTY_SHARD.fullmatch(e.name) and e.stat().st_size == 0))
    if others:
        warn_caller(f"{path}: {listing(others, 3)} not stored: a DCP commit keeps the files its .metadata names; "
                    "commit the others on their own", RuntimeWarning)


def _slice(root: Path, files: dict[str, np.ndarray], metadata: Metadata, index: MetadataIndex) -> np.ndarray:
    """The stored bytes of one item (a view of its memory-mapped file)."""
    info = (metadata.storage_data or {}).get(index)
    if not isinstance(info, _StorageInfo):
        raise CheckpointFormatError(f"{root / METADATA} does not say where {index.fqn} "
                                    f"{list(index.offset or [])} is stored")
    if info.transform_descriptors:
        raise CheckpointFormatError(f"{root}: {index.fqn} is stored through DCP extensions "
                                    f"({', '.join(info.transform_descriptors)}); ckptstore reads plain DCP "
                                    "directories: save without extensions, or load it and save it with dcp.save")
    name = Path(info.relative_path)
    if name.is_absolute() or ".." in name.parts:
        raise CheckpointFormatError(f"{root / METADATA} points outside its folder ({info.relative_path})")
    if info.relative_path not in files:
        file, real = root / name, Path(os.path.realpath(root / name))
        if not real.is_relative_to(os.path.realpath(root)):  # the file a link, or a folder on its path
            how = "is a symlink to" if file.is_symlink() else "is, through a symlinked folder,"
            raise CheckpointFormatError(f"{file} {how} {real}, outside the DCP directory: ckptstore follows only "
                                        "links that stay inside; copy the file in instead")
        if not file.is_file():
            raise CheckpointFormatError(f"{file} is missing: the DCP directory is incomplete")
        files[info.relative_path] = filemap.array(file)
    data = files[info.relative_path]
    if info.offset < 0 or info.length < 0 or info.offset + info.length > data.size:
        raise CheckpointFormatError(f"{root / info.relative_path} is shorter than its metadata says "
                                    f"({index.fqn} ends at byte {info.offset + info.length})")
    return data[info.offset:info.offset + info.length]


def _pickled(blob: np.ndarray, key: str, path: Path, trust_pickle: bool) -> RawTensor:
    """A non-tensor item's bytes, which DCP wrote with torch.save: checked to be that (read, never run) first.

    Bytes that are no such archive (a damaged file, metadata pointing elsewhere) would be stored and
    then refused at checkout as a pickle to trust; so, unless `trust_pickle`, would objects beyond
    plain data (a numpy scalar): refused here, as a torch.save file holding them is.
    """
    problem = _not_a_torch_save(blob)
    if problem:
        raise CheckpointFormatError(f"{path}: the non-tensor item {key.rsplit('/', 1)[0]} is not the torch.save "
                                    f"archive DCP writes ({problem}): the directory is damaged")
    if not trust_pickle:
        fqn = key.rsplit("/", 1)[0]
        try:
            item_value(fqn, bytes(blob))
            why = ""
        except PickledObjectsError as exc:
            why = exc.args[0].split("; DCP would", 1)[0]
        except Exception as exc:  # noqa: BLE001 - torch's restricted unpickler raises more kinds than it documents
            if out_of_resources(exc):
                raise
            why = f"{fqn}: torch's restricted unpickler cannot read this non-tensor item ({type(exc).__name__})"
        if why:
            raise PickledObjectsError(f"{path}: {why}; nothing was committed. Commit with --trust-pickle "
                                      "(trust_pickle=True from Python) only if you trust the directory (then load "
                                      "it with CkptStorageReader(..., trust_pickle=True) or `ckpt checkout "
                                      "--trust-pickle`), or save the value as a plain number or a tensor")
    return raw_from_bytes(blob)


def _not_a_torch_save(data: bytes | np.ndarray) -> str:
    """Why `data` is not a whole torch.save archive (its zip, CRCs and pickle read opcode by opcode, nothing run)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            pickled = next((name for name in archive.namelist() if name.endswith("/data.pkl")), None)
            if pickled is None:
                return "no data.pkl in it"
            for _ in pickletools.genops(io.BytesIO(archive.read(pickled))):
                pass
    except Exception as exc:  # zipfile and pickletools raise many kinds on what they cannot parse
        if out_of_resources(exc):
            raise
        return (str(exc) or type(exc).__name__)[:120]
    return ""


def _tensor(blob: np.ndarray, item: dict[str, Any], sizes: list[int], where: str) -> RawTensor:
    """One tensor shard from its `torch.save` bytes, checked against the metadata."""
    try:
        tensor = torch.load(io.BytesIO(blob.tobytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for damaged or non-tensor data
        if out_of_resources(exc):
            raise
        raise CheckpointFormatError(f"{where}: not a tensor torch reads with weights_only=True "
                                    f"({refusal_reason(str(exc)) or type(exc).__name__})") from None
    if not isinstance(tensor, torch.Tensor) or str(tensor.dtype) != item["dtype"] or list(tensor.shape) != sizes:
        found = f"a {tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else \
            f"a {type(tensor).__name__}"
        raise CheckpointFormatError(f"{where}: holds {found}, the metadata says a {item['dtype']} {sizes}")
    return raw_from_torch(tensor.contiguous(), item["fqn"])


def write(dest: str | os.PathLike, dcp: dict[str, Any], items: Iterable[tuple[str, RawTensor]], where: str,
          trust_pickle: bool = False) -> Path:
    """Write a sharded commit (its `dcp` JSON, its stored items by manifest path) as a DCP directory at `dest`.

    `trust_pickle` writes non-tensor items kept as DCP's pickles as they are stored (`item_pickle`).

    `dest` must not exist or be an empty folder; `items` may come in any order, a batch at a time.
    The data file is written first and `.metadata` last, both atomically, so a crash never
    leaves a directory that `dcp.load` would take as whole.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(not is_temp_name(p.name) for p in dest.iterdir())):
        raise CheckpointFormatError(f"{dest} exists and is not an empty folder; a DCP checkpoint is written into a "
                                    "new folder: pass another -o")  # a killed checkout's temporary files count as none
    metadata = dcpmeta.from_json(dcp, where)
    index_of = {key: index for index, key in metadata.storage_data.items()}
    storage: dict[MetadataIndex, _StorageInfo] = {}

    def fill(handle: BinaryIO) -> None:
        offset = 0
        for key, raw in items:
            index = index_of[key]
            blob = item_pickle(index.fqn, bytes(raw.data), trust_pickle) if index.offset is None else _saved(raw)
            handle.write(blob)
            storage[index] = _StorageInfo(DATA_FILE, offset, len(blob))
            offset += len(blob)

    if missing_folder(dest):
        raise CheckpointFormatError(missing_folder(dest))
    made = not dest.exists()
    dest.mkdir(exist_ok=True)
    try:
        atomic_write(dest / DATA_FILE, fill)
    except BaseException:
        if made:  # a refused item (or any failure) leaves no empty folder of ours behind
            dest.rmdir()
        raise
    if len(storage) != len(index_of):
        raise CheckpointFormatError(f"{dest}: {len(index_of) - len(storage)} of the commit's items were not written")
    metadata.storage_data = storage
    atomic_write(dest / METADATA, lambda handle: pickle.dump(metadata, handle))
    return dest


def _saved(raw: RawTensor) -> bytes:
    """A tensor shard as FileSystemWriter stores it: `torch.save` of the tensor."""
    out = io.BytesIO()
    torch.save(materialize(raw), out)
    return out.getvalue()


def item_pickle(fqn: str, data: bytes, trust_pickle: bool = False) -> bytes:
    """A stored bytes item as the pickle DCP's planner unpickles: written afresh, never the stored one as it is.

    Plain values are stored as a JSON skeleton and pickled here. An item kept as DCP's own pickle
    (one the skeleton could not hold) is loaded with torch's restricted unpickler and pickled
    again, so whatever later unpickles it in full runs no code of the stored bytes' choosing; what
    that refuses is refused here, unless `trust_pickle` hands the stored pickle over as it is.
    """
    if trust_pickle and not data.startswith(dcpmeta.SKELETON_MAGIC):
        return data
    out = io.BytesIO()
    torch.save(item_value(fqn, data), out)
    return out.getvalue()


def item_value(fqn: str, data: bytes) -> Any:
    """A stored bytes item's value: its JSON skeleton read, or DCP's pickle through torch's restricted unpickler."""
    if data.startswith(dcpmeta.SKELETON_MAGIC):
        return _from_skeleton(fqn, data[len(dcpmeta.SKELETON_MAGIC):])
    # DCP saves a BytesIO value by pickling the BytesIO, and numpy's RNG state holds an array: rebuilding
    # either runs no code of the file's choosing (numeric arrays only, as a torch.save file's)
    problem = bad_dtype_state(data)
    if problem is not None:
        raise CorruptRecordError(f"bytes item {fqn}", problem)
    try:
        with torch.serialization.safe_globals([io.BytesIO, *numpy_safe_globals()]):
            return torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        problem = _not_a_torch_save(data)
        if problem:  # not a trust question: the bytes are no torch.save archive at all
            raise CorruptRecordError(f"bytes item {fqn}", f"it is not a torch.save archive ({problem})") from None
        why = refusal_reason(str(exc)) or type(exc).__name__
        raise PickledObjectsError(f"{fqn}: this non-tensor item holds objects beyond plain data and tensors "
                                  f"({why}); DCP would unpickle them in full. Load it with "
                                  "CkptStorageReader(..., trust_pickle=True) or write it with `ckpt checkout "
                                  "--trust-pickle`, and only from repositories you trust") from None


def same_items(fqn: str, old: bytes, new: bytes) -> bool:
    """Whether two stored bytes items hold one plain value (one as a JSON skeleton, one as DCP's pickle, say)."""
    try:
        with warnings.catch_warnings():  # torch's own about pickles it cannot place: an answer of False, not a line
            warnings.simplefilter("ignore")
            old_text, new_text = _plain_text(item_value(fqn, old)), _plain_text(item_value(fqn, new))
    except Exception:  # torch's restricted unpickler raises more kinds than it documents (KeyError, struct.error)
        return False
    return old_text is not None and old_text == new_text


def _plain_text(value: Any) -> str | None:
    """A plain value's skeleton as JSON text; None for one that holds tensors or types the skeleton cannot."""
    try:
        flat = flatten(value)
    except UnsupportedStateError:
        return None
    return None if flat.tensors else json.dumps(flat.skeleton, allow_nan=True)


def _from_skeleton(fqn: str, text: bytes) -> Any:
    def no_tensors(path: str) -> Any:
        raise CorruptRecordError(f"bytes item {fqn}", f"its skeleton names a tensor ({path}) it does not hold")

    try:
        return unflatten(json.loads(text), no_tensors)
    except (ValueError, RecursionError, MalformedSkeletonError) as exc:  # the first two: JSON that does not parse
        problem = exc.problem if isinstance(exc, MalformedSkeletonError) else exc
        raise CorruptRecordError(f"bytes item {fqn}", f"its stored skeleton does not parse ({problem})") from None
