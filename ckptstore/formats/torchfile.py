"""torch.save files: loaded with weights_only=True (numpy RNG state allowed), written atomically."""

from __future__ import annotations

import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import CheckpointFormatError, CkptError, PickledObjectsError, out_of_resources
from ckptstore.formats import filemap
from ckptstore.formats.atomic import atomic_write
from ckptstore.formats.dtypestate import bad_dtype_state

ZIP_MAGIC = b"PK\x03\x04"
PICKLE_MAGIC = b"\x80"


# how a numpy scalar (np.float64(0.91)) is pickled: scalar(dtype, bytes), by numpy 2's name and numpy 1's
NUMPY_SCALAR_NAMES = ("numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar")
_SCALAR_REFUSAL = "only numeric and bool numpy scalars are read"  # refusal_reason finds it among torch's lines


def scalar_problem(args: tuple) -> str | None:
    """What keeps scalar(*`args`) from being a numeric or bool numpy scalar (never an object, string or record)."""
    if len(args) != 2:
        return f"{len(args)} arguments, not a dtype and its bytes"
    dtype, data = args
    if not (isinstance(dtype, np.dtype) and dtype.kind in "biufc" and dtype.fields is None and dtype.subdtype is None):
        return f"dtype {dtype!r:.60}"
    if type(data) is not bytes or len(data) != dtype.itemsize:
        size = f"{len(data)} bytes" if type(data) is bytes else f"a {type(data).__name__}"
        return f"data of {size}, not {dtype}'s {dtype.itemsize} bytes"
    return None


def numeric_scalar(*args: Any) -> np.generic:
    """The numpy scalar(dtype, bytes) for numeric and bool dtypes only: a checkout -o file of a state's np.float64."""
    problem = scalar_problem(args)
    if problem is not None:
        raise pickle.UnpicklingError(f"a numpy scalar with {problem}: {_SCALAR_REFUSAL}")
    dtype, data = args
    return np.frombuffer(data, dtype=dtype)[0]  # the bytes as that scalar, without numpy's own constructor


def numpy_safe_globals() -> list:
    """What torch needs to rebuild numpy arrays and scalars (numeric dtypes only, never object arrays)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    excluded = {"ObjectDType", "VoidDType", "StringDType"}
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType") and n not in excluded]
    return [np.ndarray, _reconstruct, np.dtype, *dtypes, *((numeric_scalar, name) for name in NUMPY_SCALAR_NAMES)]


def looks_like_torch_file(path: str | os.PathLike) -> bool:
    """A zip archive (torch >= 1.6) or a legacy pickle stream."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    return head == ZIP_MAGIC or head[:1] == PICKLE_MAGIC


# A legacy torch.save stream opens with this number pickled as a LONG1 (after the protocol and frame headers).
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def plain_pickle(path: str | os.PathLike) -> bool:
    """A pickle stream that does not open with torch's legacy magic number: some other program's pickle.

    A stream cut off before where the number would be may be a torch.save file: torch's reader says why.
    """
    with open(path, "rb") as handle:
        head = handle.read(32)
    at = 11 if head[2:3] == b"\x95" else 2  # protocol 4 and later frame the first pickle
    first = head[at : at + len(_LEGACY_MAGIC)]
    return head[:1] == PICKLE_MAGIC and len(first) == len(_LEGACY_MAGIC) and first != _LEGACY_MAGIC


def plain_zip(path: str | os.PathLike) -> bool:
    """A whole zip archive with no `<folder>/data.pkl` record: some other program's zip, not a torch.save file."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except ZIP_ERRORS:
        return False  # cut off or damaged: torch's reader says why
    return not any(name.count("/") == 1 and name.endswith("/data.pkl") for name in names)


def refusal_reason(reason: str, global_name: str = "") -> str:
    """torch.load(weights_only=True)'s refusal `reason` in a line: the global it refused, else its last line.

    Without terminal codes: torch highlights its advice with ANSI escapes.
    """
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+) "
                      r"|allowlisted via `add_safe_globals`, but got <class '([^']+)'>", reason)
    named = global_name or (found and (found.group(1) or found.group(2))) or ""
    named = named.removeprefix("builtins.")  # as torch names them
    if named:
        return f"{named} is not among the classes torch.load(weights_only=True) allows"
    scalar = re.search(r"a numpy scalar with .*?: " + _SCALAR_REFUSAL, reason)
    if scalar:  # numeric_scalar's own refusal, which torch puts amid its lines
        return scalar.group(0)
    operand = re.search(r"Unsupported operand (\d+)", reason)
    if operand:  # FRAME (149) first: torch.save(..., pickle_protocol=4 or 5)
        return (f"its pickle uses opcode {int(operand.group(1))}, which torch.load(weights_only=True) does not read: "
                "pickle protocol 4 or later")
    lines = re.sub(r"\x1b\[[0-9;]*m", "", reason).strip().splitlines()
    return lines[-1].strip()[:200] if lines else ""


def refused(path: str | os.PathLike, reason: str, global_name: str = "") -> PickledObjectsError:
    """The error for a file whose pickle holds more than plain training state; `reason` is torch's.

    It names the global torch refused (found in `reason` where not given), else torch's last line.
    """
    return PickledObjectsError(
        f"{path} holds objects that are not plain training state ({refusal_reason(reason, global_name)}); "
        "ckptstore loads checkpoints with weights_only=True. If you trust this file, commit it with "
        "--trust-pickle (trust_pickle=True from Python); its values must still be tensors, numbers, strings, "
        "bytes, numpy arrays or containers of them"
    )


def load(path: str | os.PathLike, trust_pickle: bool = False) -> Any:
    """Load a torch.save file onto the CPU without running arbitrary pickled code.

    `trust_pickle=True` is the user's explicit permission to unpickle any object in the file.
    """
    import torch

    path = Path(path)
    if not looks_like_torch_file(path):
        raise CheckpointFormatError(f"{path} is not a torch.save file (no zip or pickle header)")
    mmap = _mappable(path)
    if trust_pickle:
        return _adopted(path, mmap, _load_trusted(torch, path, mmap))
    walked = _walked(path)  # a crafted tuple key crashed Python in the dry run below, or in torch.load
    with open(path, "rb") as handle:  # a legacy file is five pickles: magic, protocol, system, state, storages
        problem = bad_dtype_state(handle if walked is None else walked, pickles=5)
    if problem is not None:
        raise CheckpointFormatError(f"{path} is not a readable torch.save file: {problem}")
    try:
        with torch.serialization.safe_globals(numpy_safe_globals()):
            return _adopted(path, mmap, torch.load(path, map_location="cpu", weights_only=True, mmap=mmap))
    except pickle.UnpicklingError as exc:
        raise refused(path, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - torch's loader raises IndexError, KeyError, struct.error... on damage
        if out_of_resources(exc):  # a limit met (open files, memory), not damage: the CLI names the limit
            raise
        reason = re.split(r"\s+Exception raised from ", str(exc))[0]  # torch's C++ errors append their stack
        raise CheckpointFormatError(
            f"{path} is not a readable torch.save file (truncated or corrupted?): {reason}"
        ) from None


def _walked(path: Path) -> bytes | None:
    """The file's pickles as far as torch.load would read them, once walked (torchzip.walked_pickles)."""
    from ckptstore.formats import torchzip  # it imports this module

    return torchzip.walked_pickles(path)


def _adopted(path: Path, mapped: bool, state: Any) -> Any:
    """`state`, with torch's map of `path` (its tensors' bytes) registered in the thread's guard (filemap.py).

    torch maps the file itself: the few reads while it loads stay unguarded, the hashing and
    encoding of its tensors afterwards do not.
    """
    active = filemap.current()
    if mapped and active is not None:
        active.adopt(path)
    return state


# What Python's zipfile raises on damaged archives (a multi-disk or version field gone wrong
# gives BadZipFile even from is_zipfile, an unknown version NotImplementedError): found by fuzzing.
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, OSError, ValueError, EOFError,
              struct.error)


def zip_not_whole(path: Path) -> str:
    """Why the zip at `path` is not one whole archive as torch's reader needs it, or "" when it is.

    Python's zipfile also reads an archive that has bytes before it, so a torch.save file cut off
    just after a record that is itself a zip (TransformerEngine's `_extra_state`) would read as
    that inner zip; torch.load refuses it. Bytes after the end record torch.load accepts, and so
    does this.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except ZIP_ERRORS:
        return "its zip central directory is not written yet"
    if infos and min(info.header_offset for info in infos) != 0:
        return "bytes come before its first zip record"
    return ""


def is_zip(path: Path) -> bool:
    """Whether the file ends like a zip; a damaged end record counts as not one (its reader says why)."""
    try:
        return zipfile.is_zipfile(path)
    except ZIP_ERRORS:
        return False


def _mappable(path: Path) -> bool:
    """A zip whose records are all stored: torch.load(mmap=True) fails on deflated ones, which it reads without.

    It also refuses a record flagged as a directory (DOS attribute 0x10): torch's reader returns
    such a record's tensor as uninitialised memory, with no error (found by fuzzing: one flipped
    attribute bit, every value garbage). One look at the zip's records serves both.
    """
    if not is_zip(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except ZIP_ERRORS:
        return True  # torch's own reader says what is wrong with it
    flagged = [i.filename for i in infos if i.external_attr & 0x10 and not i.filename.endswith("/")]
    if flagged:
        raise CheckpointFormatError(f"{path} is damaged: its zip marks {flagged[0]} as a directory, which "
                                    "torch.load would read as uninitialised memory")
    return all(info.compress_type == zipfile.ZIP_STORED for info in infos)


def _load_trusted(torch, path: Path, mmap: bool) -> Any:
    """torch.load with full unpickling: the file's own code runs, so any exception may come out of it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - trusted unpickling runs the file's code: anything can fail
        if out_of_resources(exc):  # a limit met (open files, memory), not damage: the CLI names the limit
            raise
        if isinstance(exc, (ImportError, AttributeError)):  # a class the pickle names is not importable here
            raise PickledObjectsError(
                f"{path} names a class that cannot be imported here ({type(exc).__name__}: {exc}); "
                "install the code that defines it to unpickle the file") from None
        raise CheckpointFormatError(
            f"{path} could not be unpickled (truncated, corrupted, or its objects failed to rebuild): "
            f"{type(exc).__name__}: {exc}") from None


def save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save to a temporary file beside `path`, fsync, then rename over it."""
    import torch

    try:
        atomic_write(path, lambda handle: torch.save(obj, handle))
    except RuntimeError as exc:
        if "as different types" not in str(exc):
            raise
        # torch.save refuses a storage shared by tensors of two dtypes (x and x.view(torch.int32))
        raise CkptError("torch.save cannot write this state to a file: two of its tensors of different dtypes "
                        "share one storage; load it into memory instead (ckptstore.load), which keeps them shared"
                        ) from None
