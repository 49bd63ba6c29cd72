"""torch.save zip files read without importing torch: a restricted unpickler and a memory map.

A torch.save file (torch >= 1.6) is a zip archive: `<archive>/data.pkl`, a small pickle of the
nested state in which every tensor is a call to a torch rebuild function over a persistent id naming
a storage, and `<archive>/data/<key>`, that storage's raw bytes, stored uncompressed (a repacked
zip may deflate them; those are inflated). This module unpickles data.pkl with an explicit
allow-list of globals that resolve to plain stand-ins (nothing from the file is ever executed),
then flattens the result into the same `FlatState` that `state.flatten(torchfile.load(path))`
gives, with tensor bytes sliced from a memory map of the file. It also tells which storage records
a stored tensor holds exactly, so torchcontainer.py can give the file back byte for byte.

It models what torch's `weights_only=True` loader accepts and no more, but for the plain opcodes of
pickle protocols 3-5 (which torch's refuses: `_NEWER_PROTOCOL_OPCODES`): globals from an
allow-list, and BUILD only on fresh objects (never on the shared stand-ins the allow-list hands
out, which a malicious file could otherwise rewrite for every later file in the process). Whenever it meets
something it does not model (an unknown global in torch's namespace, an unusual opcode, a
big-endian file, a stride it cannot prove in bounds) `read` returns None and the caller falls back
to torch, so results and error messages are the same on both paths. The verdicts it gives
itself are refusals: a global that torch's loader refuses too, with the same error, and tuples
nested so deep that hashing one would crash every unpickler, torch's included, or sharing tuples
so often that hashing one would never end (`_TooCostly`).
"""

from __future__ import annotations

import math
import mmap
import pickle
import pickletools
import struct
import sys
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import OrderedDict
from collections.abc import Callable
from functools import cache
from io import BytesIO
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ckptstore.errors import CheckpointFormatError, UnsupportedStateError, out_of_resources
from ckptstore.formats import filemap
from ckptstore.formats.dtypestate import dtype_state_problem, zipped_pickle
from ckptstore.formats.torchfile import (
    NUMPY_SCALAR_NAMES,
    numeric_scalar,
    numpy_safe_globals,
    refused,
    scalar_problem,
)
from ckptstore.formats.tuplecost import MAX_VISITS, tuple_cost
from ckptstore.state import (
    BOOKKEEPING_ATTRIBUTES,
    INT64_END,
    MAX_DEPTH,
    TORCH_ITEMSIZE,
    TORCH_PREFIX,
    FlatState,
    RawTensor,
    _Flattener,
    element_unit,
)

# The last line of every refusal of torch's weights_only loader; torchfile.refused keeps only it
TORCH_REFUSAL = (
    "Check the documentation of torch.load to learn more about types accepted by default with "
    "weights_only https://pytorch.org/docs/stable/generated/torch.load.html."
)

# The opcodes torch's weights_only unpickler implements (protocol 2); any other makes it refuse
_OPCODES = frozenset({
    "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE",
    "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE",
    "SHORT_BINSTRING", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1",
})
# What `torch.save(..., pickle_protocol=3, 4 or 5)` adds, which torch's weights_only loader refuses ("Unsupported
# operand 149"): bytes as such (protocol 3), framing, a memo put without an index, shorter and longer strings, and a
# global whose names are strings on the stack, resolved through the same allow-list as GLOBAL's; a set's items
# (ADDITEMS, with builtins.set's check; FROZENSET is refused as protocol 2's frozenset global is). The Python
# unpickler reads them; the C walk (_pickscan) takes protocol 2 only, so such pickles never reach the C unpickler.
_NEWER_PROTOCOL_OPCODES = frozenset({"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "FRAME", "MEMOIZE",
                                     "SHORT_BINUNICODE", "BINUNICODE8", "STACK_GLOBAL"})

# Legacy typed storage classes torch.save names, and the dtype each holds
_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
}
# dtypes torch lets require grad without question; anything else asking for grad goes to torch
_GRAD_DTYPES = frozenset(TORCH_PREFIX + n for n in ("float64", "float32", "float16", "bfloat16", "complex64",
                                                    "complex128"))
_DEVICE_TYPES = frozenset({"cpu", "cuda", "mps", "meta", "xpu"})
# Non-torch globals torch's loader accepts besides the numpy ones
_TORCH_ALSO_ALLOWS = frozenset({
    "collections.OrderedDict", "collections.Counter", "_codecs.encode",
    "builtins.bytearray", "builtins.set", "builtins.complex",
})
try:  # the opcode walk that lets plain pickles use the C unpickler (optional, like the codecs' C parts)
    from ckptstore.formats import _pickscan
except ImportError:  # pragma: no cover - built without a C compiler
    _pickscan = None
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
class _Fallback(Exception):
    """A case this reader does not model; torch's own loader decides instead."""


class _Refused(Exception):
    """A global that torch's weights_only loader refuses as well."""


class _TooCostly(Exception):
    """A tuple that hashing (as a dict key) would crash on or never finish, in every unpickler, torch's too.

    Its argument is the walk's verdict: "too deep" (nested past MAX_DEPTH: the C stack overflows) or
    "too big" (a hash would visit more than MAX_VISITS items, shared tuples counted each time).
    """


class _Damaged(Exception):
    """Damage torch.load refuses too; torch.load(mmap=True), the fallback, would read past it."""


def _need(condition: bool, what: str) -> None:
    if not condition:
        raise _Fallback(what)


# Stand-ins. Named and placed like torch's classes, so that flatten's errors about a value or a
# dict key of these types read the same on both paths.


class TypedStorage:
    """A storage record: its dtype, and its bytes: `nbytes` from `start` in `base`.

    `base` is the map of the whole file for a stored record, or the record's inflated bytes
    (start 0) for a deflated one; `member` names the record for a stored one, "" otherwise.
    """

    __module__ = "torch.storage"
    __slots__ = ("key", "dtype", "start", "nbytes", "base", "member")

    def __init__(self, key: str, dtype: str, start: int, nbytes: int, base: np.ndarray, member: str) -> None:
        self.key, self.dtype, self.start, self.nbytes = key, dtype, start, nbytes
        self.base, self.member = base, member

    def __setstate__(self, state: Any) -> None:
        raise _Fallback("BUILD on a storage")


class Tensor:
    """A strided view of a storage, as torch's rebuild functions would make it."""

    __module__ = "torch"
    __slots__ = ("storage", "offset", "shape", "stride", "dtype", "requires_grad")

    def __init__(self, storage: TypedStorage, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                 dtype: str, requires_grad: bool) -> None:
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride
        self.dtype, self.requires_grad = dtype, requires_grad

    def __setstate__(self, state: Any) -> None:
        raise _Fallback("BUILD on a tensor")


class Parameter(Tensor):
    """An nn.Parameter: a tensor whose requires_grad the skeleton records."""

    __module__ = "torch.nn.parameter"
    __slots__ = ()


class Size(tuple):
    """torch.Size: a tuple of ints (flatten stores it as a tuple, as it does a real one)."""

    __module__ = "torch"
    __slots__ = ()

    def __new__(cls, items: Any = ()) -> Size:
        items = tuple(items)
        _need(all(type(i) is int for i in items), "torch.Size of non-ints")
        return super().__new__(cls, items)


class dtype:  # noqa: N801 - the name torch's errors use
    """A torch dtype, by its full name ("torch.float32")."""

    __module__ = "torch"
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __setstate__(self, state: Any) -> None:
        raise _Fallback("BUILD on dtype")


class device:  # noqa: N801 - the name torch's errors use
    """A torch device, by the text str(torch.device) gives ("cpu", "cuda:1")."""

    __module__ = "torch"
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __setstate__(self, state: Any) -> None:
        raise _Fallback("BUILD on device")


class _StorageType:
    """The storage class a persistent id names; untyped storages hold bytes."""

    __slots__ = ("dtype",)

    def __init__(self, dtype_name: str) -> None:
        self.dtype = dtype_name

    def __setstate__(self, state: Any) -> None:
        raise _Fallback("BUILD on _StorageType")


class _Global:
    """What the allow-list hands out for a callable global: it calls `target`, and refuses BUILD.

    The C unpickler's BUILD sets attributes on whatever object it is given; plain functions and
    classes would take them, and the next file read in this process would see them. Every object
    the allow-list hands out is therefore an instance of a slotted class whose __setstate__ refuses.
    """

    __slots__ = ("name", "target")

    def __init__(self, name: str, target: Callable[..., Any] | None) -> None:
        self.name, self.target = name, target

    def __call__(self, *args: Any) -> Any:
        _need(self.target is not None, f"call of {self.name}")
        return self.target(*args)

    def __setstate__(self, state: Any) -> None:
        raise _Fallback(f"BUILD on {self.name}")


_NDARRAY = _Global("numpy.ndarray", None)  # numpy.ndarray as _reconstruct's first argument; never called


def _make_device(kind: Any, index: Any = None) -> device:
    _need(type(kind) is str, "device type")
    if ":" in kind and index is None:
        kind, _, digits = kind.partition(":")
        _need(digits.isdigit() and digits.isascii() and str(int(digits)) == digits, "device index")
        index = int(digits)
    _need(kind in _DEVICE_TYPES, f"device type {kind}")
    _need(index is None or (type(index) is int and index >= 0), "device index")
    return device(kind if index is None else f"{kind}:{index}")


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    # protocol 2 writes bytes as _codecs.encode(str, "latin1"); nothing else is modelled
    _need(type(text) is str and encoding in ("latin1", "latin-1"), "_codecs.encode")
    return text.encode("latin1")


def _refuse_deep_tuple(value: Any) -> None:
    """Refuse a value about to be hashed (a dict key, a set item) whose tuples cost too much to hash (_TooCostly)."""
    if isinstance(value, tuple):
        nesting, visits = tuple_cost(value, MAX_DEPTH)
        if nesting > MAX_DEPTH or visits > MAX_VISITS:
            raise _TooCostly("too deep" if nesting > MAX_DEPTH else "too big")


def _plain_set(items: Any = ()) -> set:
    # sets of anything but plain values sort differently (or fail differently) on the torch path
    _need(type(items) in (list, tuple), "set argument")
    for item in items:  # before any fallback: torch's set() would hash it
        _refuse_deep_tuple(item)
    _need(all(type(i) in (str, int, float, bool, bytes, type(None)) for i in items), "set of non-scalars")
    return set(items)


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    _need(type(real) in (int, float) and type(imag) in (int, float), "complex arguments")
    return complex(real, imag)


def _np_reconstruct(subtype: Any, shape: Any, typecode: Any) -> np.ndarray:
    # numpy pickles an array as _reconstruct(ndarray, (0,), b"b") and then BUILD, which is numpy's own
    # ndarray.__setstate__ on the empty array made here, with a dtype from _np_dtype below
    _need(subtype is _NDARRAY and shape == (0,) and typecode == b"b", "numpy _reconstruct")
    return np.empty(0, dtype=np.int8)


def _np_scalar(*args: Any) -> np.generic:
    _need(scalar_problem(args) is None, "numpy scalar")  # torch's path refuses the others by name
    return numeric_scalar(*args)


def _np_dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """Numeric dtypes only: never objects, strings, records or datetimes."""
    _need(type(spec) is str and type(align) is bool, "numpy dtype arguments")
    # always a fresh copy: BUILD then sets its byte order, which must not touch numpy's shared one
    result = np.dtype(spec, align=align, copy=True)
    _need(result.kind in "biufc" and result.fields is None and result.subdtype is None, f"numpy dtype {spec}")
    return result


def _check_view(storage: Any, dtype_name: str, offset: Any, size: Any, stride: Any) -> None:
    """The checks torch's Tensor.set_ makes, and that every number is a plain int."""
    _need(isinstance(storage, TypedStorage) and dtype_name in TORCH_ITEMSIZE, "tensor storage or dtype")
    _need(type(offset) is int and 0 <= offset < INT64_END, "storage offset")
    _need(type(size) is tuple and type(stride) is tuple and len(size) == len(stride), "size and stride")
    # torch keeps them as int64: a larger one (with a zero-size dimension, never checked below) loads nowhere
    _need(all(type(n) is int and 0 <= n < INT64_END for n in size + stride) and math.prod(size) < INT64_END,
          "size and stride values")
    if math.prod(size):
        extent = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
        _need(extent * TORCH_ITEMSIZE[dtype_name] <= storage.nbytes, "tensor beyond its storage")


def _empty_hooks(hooks: Any) -> bool:
    return type(hooks) is OrderedDict and not hooks


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
            dtype_name: str, metadata: Any) -> Tensor:
    _check_view(storage, dtype_name, offset, size, stride)
    _need(type(requires_grad) is bool and (not requires_grad or dtype_name in _GRAD_DTYPES), "requires_grad")
    _need(_empty_hooks(hooks), "backward hooks")
    # metadata carries conj/neg bits; a file that sets them is left to torch
    _need(metadata is None or (type(metadata) is dict and not metadata), "tensor metadata")
    return Tensor(storage, offset, size, stride, dtype_name, requires_grad)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                       metadata: Any = None) -> Tensor:
    dtype_name = storage.dtype if isinstance(storage, TypedStorage) else ""
    return _tensor(storage, offset, size, stride, requires_grad, hooks, dtype_name, metadata)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                       dtype_: Any, metadata: Any = None) -> Tensor:
    _need(isinstance(dtype_, dtype), "rebuild_tensor_v3 dtype")
    return _tensor(storage, offset, size, stride, requires_grad, hooks, dtype_.name, metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Parameter:
    _need(type(data) is Tensor and type(requires_grad) is bool and _empty_hooks(hooks), "parameter")
    _need(not requires_grad or data.dtype in _GRAD_DTYPES, "parameter requires_grad")
    return Parameter(data.storage, data.offset, data.shape, data.stride, data.dtype, requires_grad)


def _harmless(state: Any) -> bool:
    if state is None:
        return True
    return type(state) is dict and all(
        k in BOOKKEEPING_ATTRIBUTES and type(v) in (bool, int, str, type(None)) for k, v in state.items())


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, state: Any) -> Parameter:
    # torch sets each item of state as an attribute: only known bookkeeping flags are let through
    parts = state if type(state) is tuple and len(state) == 2 else (state,)
    _need(all(_harmless(part) for part in parts), "parameter state")
    return _rebuild_parameter(data, requires_grad, hooks)


@cache
def _numpy_names() -> frozenset[str]:
    """The numpy globals torchfile.load lets torch accept, by the dotted name torch matches."""
    return frozenset(g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in numpy_safe_globals())


@cache
def _globals() -> dict[tuple[str, str], Any]:
    """The allow-list: (module, name) as the pickle names it -> what this reader builds for it."""
    calls: dict[tuple[str, str], Callable[..., Any]] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
        ("torch", "Size"): Size,
        ("torch", "device"): _make_device,
        ("_codecs", "encode"): _latin1,
        ("builtins", "set"): _plain_set,
        ("builtins", "complex"): _complex,
        ("numpy", "dtype"): _np_dtype,
    }
    reconstruct = next(g for g in numpy_safe_globals() if getattr(g, "__name__", "") == "_reconstruct")
    calls[(reconstruct.__module__, "_reconstruct")] = _np_reconstruct
    calls.update({tuple(name.rsplit(".", 1)): _np_scalar for name in NUMPY_SCALAR_NAMES})
    table: dict[tuple[str, str], Any] = {key: _Global(".".join(key), call) for key, call in calls.items()}
    table[("numpy", "ndarray")] = _NDARRAY
    table[("torch.storage", "UntypedStorage")] = _StorageType(TORCH_PREFIX + "uint8")
    for name, dtype_name in _STORAGE_DTYPES.items():
        table[("torch", name)] = _StorageType(TORCH_PREFIX + dtype_name)
    for full in TORCH_ITEMSIZE:
        table[("torch", full[len(TORCH_PREFIX):])] = dtype(full)
    return table


def _torch_might_allow(full_name: str) -> bool:
    """Whether torch's loader (with torchfile's numpy globals) may accept a global this reader lacks."""
    return full_name.startswith("torch.") or full_name in _TORCH_ALSO_ALLOWS or full_name in _numpy_names()


class _Archive:
    """The records of one torch.save zip, by name below its top folder, and where their bytes lie."""

    def __init__(self, zf: zipfile.ZipFile, handle: BinaryIO, size: int) -> None:
        names = zf.namelist()
        _need(bool(names) and "/" in names[0], "archive layout")
        top = names[0].split("/", 1)[0] + "/"  # torch's reader takes the folder of the first entry
        self.zf, self.handle, self.size = zf, handle, size
        # a private (copy-on-write) map: writable arrays like torch's mmap gives, the file untouched
        self.base = filemap.array(handle.name, writable=True)
        self.records = {i.filename[len(top):]: i for i in zf.infolist() if i.filename.startswith(top)}
        # torch's zip reader finds records ignoring case (and takes the first of a name): where names
        # collide so, the two readers could take different bytes, so torch reads the file
        _need(len({name.lower() for name in names}) == len(names), "record names distinct ignoring case")

    def read(self, name: str) -> bytes | None:
        info = self.records.get(name)
        return None if info is None else self.zf.read(info)

    def storage(self, key: str, dtype_name: str, nbytes: int) -> TypedStorage:
        """The storage record `data/<key>` of exactly `nbytes` bytes: mapped if stored, inflated if deflated."""
        name = f"data/{key}"
        info = self.records.get(name)
        _need(info is not None, f"record {name}")
        if info.file_size != nbytes:
            raise _Damaged(f"record {name} holds {info.file_size} bytes, its pickle asks for {nbytes}")
        _need(not info.flag_bits & 1, f"{name} encryption")
        if info.compress_type != zipfile.ZIP_STORED:
            # zipfile inflates and checks the CRC; torch.load reads such files too
            return TypedStorage(key, dtype_name, 0, nbytes, np.frombuffer(self.zf.read(info), np.uint8), "")
        return TypedStorage(key, dtype_name, self.data_start(info, nbytes), nbytes, self.base, info.filename)

    def data_start(self, info: zipfile.ZipInfo, nbytes: int) -> int:
        """Offset in the file of the stored (uncompressed) record `info` of `nbytes` bytes."""
        name = info.filename
        self.handle.seek(info.header_offset)
        head = self.handle.read(_LOCAL_HEADER.size)
        _need(len(head) == _LOCAL_HEADER.size, "local header")
        fields = _LOCAL_HEADER.unpack(head)
        _need(fields[0] == b"PK\x03\x04", "local header signature")
        start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        _need(start + nbytes <= self.size, f"{name} beyond the end of the file")
        return start


def _buildable(inst: Any) -> bool:
    """Whether BUILD may set state on `inst`: only fresh objects of the types torch's loader lets it touch.

    The allow-list hands out shared objects (storage types, dtypes, functions, classes); a BUILD
    on one of those would change how every later file in the process is read.
    """
    return type(inst) in (OrderedDict, np.ndarray) or isinstance(inst, np.dtype)


class _Resolver:
    """The allow-list's two hooks, shared by both unpicklers: globals, and torch's storage records."""

    archive: _Archive
    storages: dict[str, TypedStorage]

    def __init__(self, data: bytes, archive: _Archive) -> None:
        # the next class in the MRO is the pickle.Unpickler (pure Python or C) this resolver is mixed into
        super().__init__(BytesIO(data), encoding="utf-8")  # torch.load's encoding for py2 strings
        self.archive = archive
        self.storages = {}

    def find_class(self, module: str, name: str) -> Any:
        # the same python 2 renames torch applies before matching its allow-list
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        found = _globals().get((module, name))
        if found is not None:
            return found
        full_name = f"{module}.{name}"
        if _torch_might_allow(full_name) or _added_to_torch(full_name):
            raise _Fallback(f"global {full_name}")
        raise _Refused(full_name)

    def persistent_load(self, pid: Any) -> TypedStorage:
        _need(type(pid) is tuple and len(pid) == 5 and pid[0] == "storage", "persistent id")
        _, storage_type, key, _location, numel = pid  # everything loads onto the CPU, as torchfile asks
        _need(isinstance(storage_type, _StorageType) and type(key) is str, "storage type or key")
        _need(type(numel) is int and numel >= 0, "storage size")
        if key not in self.storages:  # torch keeps the first storage loaded under a key, as here
            nbytes = numel * TORCH_ITEMSIZE[storage_type.dtype]
            self.storages[key] = self.archive.storage(key, storage_type.dtype, nbytes)
        return self.storages[key]


class _Unpickler(_Resolver, pickle._Unpickler):
    """An unpickler that runs only what torch's weights_only loader would (and later protocols' plain opcodes).

    Only torch's opcodes (protocol 2) and `_NEWER_PROTOCOL_OPCODES`; globals from the allow-list;
    persistent ids only torch's storage records; BUILD only on fresh objects. It is the pure-Python
    unpickler, because each opcode can be checked before it runs: an opcode outside these has no
    handler here, so the file goes to torch. `_FastUnpickler` reads the files this one would, faster.
    """

    dispatch = {code: handler for code, handler in pickle._Unpickler.dispatch.items()
                if _OPCODE_NAMES.get(code) in _OPCODES | _NEWER_PROTOCOL_OPCODES}

    def load_proto(self) -> None:
        protocol = self.read(1)[0]
        _need(2 <= protocol <= pickle.HIGHEST_PROTOCOL, "pickle protocol")
        self.proto = protocol

    def load_build(self) -> None:
        if not _buildable(self.stack[-2]):
            raise _Fallback(f"BUILD on {type(self.stack[-2]).__name__}")
        if isinstance(self.stack[-2], np.dtype):  # numpy's own __setstate__ trusts its tuple (dtypestate.py)
            problem = dtype_state_problem(self.stack[-2], self.stack[-1])  # made fresh by _np_dtype
            _need(problem is None, problem or "")
        super().load_build()

    def load_setitem(self) -> None:  # the key is hashed: see _TooCostly
        _refuse_deep_tuple(self.stack[-2])
        super().load_setitem()

    def load_setitems(self) -> None:  # self.stack holds the items above the MARK, keys first
        for key in self.stack[::2]:
            _refuse_deep_tuple(key)
        super().load_setitems()

    def load_additems(self) -> None:  # protocol 4's set: EMPTY_SET, then its items
        items = self.pop_mark()
        _need(type(self.stack[-1]) is set, "ADDITEMS on a non-set")
        self.stack[-1].update(_plain_set(items))

    def load_frozenset(self) -> None:  # refused as protocol 2's builtins.frozenset global is, by name
        raise _Refused("frozenset")

    dispatch[pickle.PROTO[0]] = load_proto
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset


class _FastUnpickler(_Resolver, pickle.Unpickler):
    """The C unpickler with the same hooks, for pickles `_pickscan.walk` found plain (see `_unpickle`).

    It runs every opcode it knows, so it is only given pickles whose opcodes are all torch's, with
    memo indices bounded; BUILD on a shared object is refused by the object itself (`_Global`,
    the stand-ins' __setstate__). On the benchmark runs' data.pkl files it parses in about a third of the time.
    """


# _pickscan's table: byte value -> 1 for the opcodes torch runs (a plain pickle has only these), 2 for those only
# the Python unpickler runs (walked for tuple depth, never plain), 0 for those no reader runs (the walk stops)
_WALK_TABLE = bytes(1 if _OPCODE_NAMES.get(code) in _OPCODES else 2 if code in _Unpickler.dispatch else 0
                    for code in range(256))


def _unpickle(data: bytes, archive: _Archive) -> Any:
    """data.pkl's object: on the C unpickler when the pickle is plain, else (or when that fails) on the Python one.

    The Python unpickler gives every verdict (fallback reasons, refusals): the C one only ever
    supplies a result that the Python one would have given too, faster. The walk alone refuses tuples
    too costly to hash (_TooCostly), before any unpickler (torch's, the fallback, included) would hash one.
    """
    verdict = "other" if _pickscan is None else _pickscan.walk(data, _WALK_TABLE, MAX_DEPTH, MAX_VISITS)
    if verdict in ("too deep", "too big"):  # refused before any unpickler (or torch's, the fallback) hashes it
        raise _TooCostly(verdict)
    # the C unpickler hands a dtype's state to numpy unchecked: a pickle naming numpy goes the Python way
    if verdict == "plain" and b"numpy" not in data:
        try:
            return _FastUnpickler(data, archive).load()
        except Exception:  # noqa: BLE001,S110 - the Python unpickler below says why, as before
            pass
    return _Unpickler(data, archive).load()


def legacy_pickles(path: Path, count: int = 5) -> bytes | None:
    """A legacy torch.save stream's first `count` pickles, as far as the walk follows them, or None without the walk.

    Raises the CheckpointFormatError of `_TooCostly` where one builds a tuple too costly to hash, before
    torch.load (which reads a legacy file itself) hashes such a key. torch.load reads no opcode
    past where the walk stops, so the bytes returned hold all it would run of them.
    """
    if _pickscan is None:
        return None
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        end = 0
        for _ in range(count):
            verdict, end, whole = _pickscan.walk_from(data, _WALK_TABLE, MAX_DEPTH, MAX_VISITS, end)
            if verdict in ("too deep", "too big"):
                raise too_costly(path, verdict)
            if not whole:
                break
        return data[:end]


def walked_pickles(path: Path) -> bytes | None:
    """A torch.save file's pickles as far as the walk follows them (a zip's data.pkl, a legacy file's five).

    For torch.load's path (a fallback, or a legacy file): its numpy dry run (dtypestate) runs every
    opcode, DUP and POP too, where the walk stops, so it gets only these bytes; the walk refuses a tuple
    too costly to hash first. None without the walk, or for a zip whose data.pkl cannot be read here.
    """
    if _pickscan is None:
        return None
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":
            return legacy_pickles(path)
    data = zipped_pickle(path)
    if data is None:
        return None
    verdict, end, _ = _pickscan.walk_from(data, _WALK_TABLE, MAX_DEPTH, MAX_VISITS, 0)
    if verdict in ("too deep", "too big"):
        raise too_costly(path, verdict)
    return data[:end]


def too_costly(path: str | Path, verdict: str) -> CheckpointFormatError:
    """The refusal of a file whose pickle builds a tuple too costly to hash (`_TooCostly`, with the walk's verdict)."""
    if verdict == "too deep":
        return CheckpointFormatError(f"{path} is refused: its pickle nests tuples more than {MAX_DEPTH} deep, which "
                                     "could crash Python (a crafted file?); save the state without such nesting")
    return CheckpointFormatError(f"{path} is refused: its pickle builds a tuple whose hash would visit more than "
                                 f"{MAX_VISITS:,} items (tuples shared within tuples), which could hang Python (a "
                                 "crafted file?); save the state without such tuples")


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected, contiguous = 1, True
    for n, s in zip(reversed(shape), reversed(stride)):
        contiguous = contiguous and (n == 1 or s == expected)
        expected *= n
    return contiguous


def _dense_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> list[int] | None:
    """The dimensions in the order memory holds them, where the view is dense (contiguous once permuted so)."""
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    if _contiguous(tuple(shape[d] for d in order), tuple(stride[d] for d in order)):
        return order
    return None


def _tensor_bytes(value: Tensor) -> np.ndarray:
    """The tensor's elements in C order as flat bytes: a slice of the map when contiguous, else a copy."""
    numel = math.prod(value.shape)
    if not numel:
        return np.empty(0, dtype=np.uint8)
    itemsize = TORCH_ITEMSIZE[value.dtype]
    base = value.storage.base
    first = value.storage.start + value.offset * itemsize
    if _contiguous(value.shape, value.stride):
        return base[first : first + numel * itemsize]
    unit = element_unit(itemsize)
    span = base[first : value.storage.start + value.storage.nbytes]
    elements = span[: len(span) // itemsize * itemsize].view(unit)
    view = np.lib.stride_tricks.as_strided(
        elements, value.shape, tuple(s * itemsize for s in value.stride), writeable=False)
    # as bits, a bool's 2 or 255 too, as state.raw_from_torch copies a torch view (a bool copy would make them 1)
    return np.ascontiguousarray(view).reshape(-1).view(np.uint8)


class _StandInFlattener(_Flattener):
    """state.flatten over stand-ins: same skeleton, same paths, same aliasing as over torch objects.

    It also notes, for each stored record, a tensor path whose bytes are exactly the record's
    (`covers`), which lets the file be rebuilt from its container and its tensors; a tensor that
    views the whole record in another order of its dimensions (channels_last, a transpose) covers
    it too, with that order (`orders`: the record holds the tensor's dimensions permuted so). A
    contiguous tensor that views only part of its record (a trimmed vocab) covers that part
    (`parts`: its offset and length in the record), where no tensor covers the whole record.
    """

    def __init__(self) -> None:
        super().__init__()
        self.covers: dict[str, str] = {}
        self.orders: dict[str, list[int]] = {}
        self.parts: dict[str, tuple[int, int]] = {}

    def encode_other(self, value: Any, path: str) -> Any:
        if isinstance(value, Tensor):
            return self.stand_in_tensor(value, path)
        if isinstance(value, dtype):
            return ["dtype", value.name]
        if isinstance(value, device):
            return ["device", value.text]
        return self.encode_last(value, path)

    def stand_in_tensor(self, value: Tensor, path: str) -> list:
        # _Flattener.tensor keys on the storage's address; a storage key names one record
        storage, key = value.storage, None
        if math.prod(value.shape):
            key = (storage.key, value.offset, value.shape, value.stride, value.dtype)
        if key is not None and key in self.aliases:
            node = ["tensor", self.aliases[key]]
        elif key is None and (first := self.first_keyless(value, path)) != path:  # pickle's memo: one stand-in
            node = ["tensor", first]
        else:
            if key is not None:  # before the copy: an expand() of one element could ask for terabytes
                self.count_view(storage.key, storage.nbytes, math.prod(value.shape) * TORCH_ITEMSIZE[value.dtype], path)
            self.tensors[path] = RawTensor(value.dtype, value.shape, _tensor_bytes(value))
            node = ["tensor", path]
            if key is not None:
                self.aliases[key] = path
                self.views.setdefault(storage.key, []).append((node, storage.nbytes, value.offset, value.stride))
                self.note_cover(value, path)
        return self.tensor_extras(node, value.requires_grad, isinstance(value, Parameter), value)

    def note_cover(self, value: Tensor, path: str) -> None:
        """Note the record's bytes this new tensor holds: all of them, else (contiguous) a part of them."""
        member, nbytes = value.storage.member, self.tensors[path].nbytes
        order = _dense_order(value.shape, value.stride)
        if not member or order is None or (member in self.covers and member not in self.parts):
            return
        if not value.offset and nbytes == value.storage.nbytes:  # the whole record, in place of a part
            self.covers[member] = path
            self.parts.pop(member, None)
            if order != sorted(order):
                self.orders[member] = order
        elif member not in self.covers and _contiguous(value.shape, value.stride):
            self.covers[member] = path
            self.parts[member] = (value.offset * TORCH_ITEMSIZE[value.dtype], nbytes)


def _added_to_torch(full_name: str) -> bool:
    """Whether this process added `full_name` to torch's allow-list (torch registers a few itself)."""
    torch = sys.modules.get("torch")
    if torch is None:  # not imported, so nothing was added
        return False
    get = getattr(getattr(torch, "serialization", None), "get_safe_globals", None)
    if get is None:
        return True
    names = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in get()}
    return full_name in names


def _load(path: Path, prefix: str
          ) -> tuple[FlatState, dict[str, str], dict[str, list[int]], dict[str, tuple[int, int]]]:
    size = path.stat().st_size
    with zipfile.ZipFile(path) as zf, open(path, "rb") as handle:
        archive = _Archive(zf, handle, size)
        version = archive.read(".data/version") or archive.read("version")
        _need(version is not None and version.strip() == b"3", "archive version")
        _need(archive.read("byteorder") == b"little", "byte order")
        data = archive.read("data.pkl")
        _need(data is not None, "data.pkl")
        obj = _unpickle(data, archive)
    flattener = _StandInFlattener()
    return flattener.flatten(obj, prefix), flattener.covers, flattener.orders, flattener.parts


def read(path: str | Path, prefix: str = "", on_fallback: Callable[[str], None] | None = None) -> FlatState | None:
    """The flat state of a torch.save zip file read without torch, or None where torch must decide.

    Raises the CheckpointFormatError torchfile.load raises for a global torch refuses, and the
    UnsupportedStateError flatten raises for values it cannot store; both are the torch path's.
    `on_fallback` hears why a file was left to torch (for tests and diagnostics).
    """
    found = read_with_covers(path, prefix, on_fallback)
    return None if found is None else found[0]


def read_with_covers(path: str | Path, prefix: str = "", on_fallback: Callable[[str], None] | None = None
                     ) -> tuple[FlatState, dict[str, str], dict[str, list[int]], dict[str, tuple[int, int]]] | None:
    """`read`, and for each stored storage record (by its name in the zip) a tensor path holding exactly its bytes.

    With them, the order of a tensor's dimensions where its record holds them permuted, and the
    part of the record a tensor holds where it holds only part of it (_StandInFlattener).
    """
    path = Path(path)
    try:
        return _load(path, prefix)
    except _Refused as exc:
        raise refused(path, TORCH_REFUSAL, str(exc)) from None
    except _TooCostly as exc:
        raise too_costly(path, str(exc)) from None
    except _Damaged as exc:
        raise CheckpointFormatError(f"{path} is not a readable torch.save file (truncated or corrupted?): {exc}"
                                    ) from None
    except UnsupportedStateError:
        raise
    except Exception as exc:  # anything not modelled, malformed or truncated: torch's loader decides
        if out_of_resources(exc):  # a limit met (open files, memory) is no reason to doubt the file
            raise
        if on_fallback is not None:
            on_fallback(f"{type(exc).__name__}: {exc}")
        return None
