"""Flatten a nested checkpoint into named raw tensors plus a JSON skeleton, and back.

The skeleton is plain JSON: scalars stay JSON scalars, everything else is a list whose first item
is a tag. Nothing here ever pickles. Tensors become `RawTensor`s: dtype name, shape and the raw
bytes as a flat uint8 array, which is all the codecs and the store ever see.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import re
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import (
    MalformedSkeletonError,
    UnsupportedStateError,
    listing,
)
from ckptstore.errors import is_utf8 as is_utf8  # formats and watch import it from here
from ckptstore.formats.tuplecost import key_nesting
from ckptstore.formats.tuplekeys import stored_tuple_key
from ckptstore.formats.views import StorageBudget, as_bits, check_view, scatter
from ckptstore.warn import warn_caller

BYTES_DTYPE = "bytes"
NUMPY_PREFIX = "numpy:"
TORCH_PREFIX = "torch."


# bytes per element of every torch dtype a checkpoint holds; names missing here ask torch itself
TORCH_ITEMSIZE: dict[str, int] = {TORCH_PREFIX + name: size for name, size in (
    ("float64", 8), ("float32", 4), ("float16", 2), ("bfloat16", 2),
    ("float8_e5m2", 1), ("float8_e4m3fn", 1), ("float8_e5m2fnuz", 1), ("float8_e4m3fnuz", 1),
    ("float8_e8m0fnu", 1), ("float4_e2m1fn_x2", 1),
    ("int64", 8), ("int32", 4), ("int16", 2), ("int8", 1),
    ("uint64", 8), ("uint32", 4), ("uint16", 2), ("uint8", 1), ("bool", 1),
    ("complex128", 16), ("complex64", 8), ("complex32", 4),
)}


@dataclass
class RawTensor:
    """A tensor as the store sees it: dtype name, shape, and its bytes (flat, C order)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @property
    def itemsize(self) -> int:
        """Bytes per element, the byte-plane count the lossless codec groups by."""
        if self.dtype == BYTES_DTYPE:
            return 1
        if self.dtype.startswith(NUMPY_PREFIX):
            return np.dtype(self.dtype[len(NUMPY_PREFIX) :]).itemsize
        size = TORCH_ITEMSIZE.get(self.dtype)
        if size is not None:  # the table keeps torch out of processes that only read and encode
            return size
        return _torch().empty((), dtype=torch_dtype(self.dtype)).element_size()


@dataclass
class FlatState:
    """A checkpoint split into a skeleton and its tensors, keyed by logical path."""

    skeleton: Any
    tensors: dict[str, RawTensor]


def _torch():
    import torch

    return torch


def torch_dtype(name: str):
    """`torch.float32` -> torch.float32, with a clear error for names this torch lacks."""
    torch = _torch()
    dtype = getattr(torch, name[len(TORCH_PREFIX) :], None) if name.startswith(TORCH_PREFIX) else None
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedStateError(f"dtype {name!r} is not known to this torch {torch.__version__}")
    return dtype


def escape(key: str) -> str:
    """Make a key safe as one path component."""
    return key.replace("%", "%25").replace("/", "%2F")


def join(prefix: str, key: str) -> str:
    return f"{prefix}/{escape(key)}" if prefix else escape(key)


def reserved_path(prefix: str, name: str) -> str:
    """The path of a format's own entry ("%header", "%container"): a bare "%" part, which no escaped key has."""
    return f"{prefix}/{name}" if prefix else name


INT64_END = 1 << 63  # sizes, strides and offsets at or past this fit no reader's 64-bit integers


# str keys that read as an int key's digits; only these (and "") are marked, so ordinary paths stay
_INT_LIKE = re.compile(r"-?(?:0|[1-9][0-9]*)")


def _storable_key(key: Any) -> bool:
    """Whether a dict key has a path component: a str, int, float, bool or None, or a tuple of such keys."""
    if isinstance(key, tuple):
        return all(_storable_key(part) for part in key)
    return isinstance(key, (str, int, float, bool, type(None)))


def key_component(key: Any) -> str:
    """The path component of a dict key, distinct for every key of a different type or value.

    int keys are their digits and str keys are `escape(key)`, as they always were, except a str
    that reads as an int (or is empty): its first character is percent-encoded ("1" -> "%31",
    "" -> "%22%22"). None, bools and floats get markers. `escape` only ever writes "%25" and
    "%2F", so no escaped str can look like any of these. A tuple is the escaped repr of the key as
    stored (formats/tuplekeys.py) behind "%tuple:".
    """
    if isinstance(key, tuple):  # as stored: an IntEnum item is an int, a namedtuple a tuple (as readers see it)
        return "%tuple:" + escape(repr(stored_tuple_key(key)))
    if key is None:
        return "%none"
    if isinstance(key, bool):
        return "%true" if key else "%false"
    if isinstance(key, int):
        return str(int(key))
    if isinstance(key, float):
        return "%float:" + repr(float(key))
    if not key:
        return "%22%22"
    text = escape(str.__str__(key))
    return f"%{ord(text[0]):02X}{text[1:]}" if _INT_LIKE.fullmatch(text) else text


def readable_path(path: str) -> str:
    """A path with each str key's own text back ("a%2Fb" -> "a/b", "%31" -> "1"): a name for export.

    Not reversible where a key holds "/" (the parts run together) or is not a str (its marker stays).
    """
    parts = []
    for part in path.split("/"):
        if part == "%22%22":  # the empty str key's component (key_component)
            parts.append("")
            continue
        hex_digits = part[1:3]
        if part[:1] == "%" and len(hex_digits) == 2 and all(c in "0123456789ABCDEF" for c in hex_digits):
            digits = chr(int(hex_digits, 16)) + part[3:]
            if _INT_LIKE.fullmatch(digits):  # a str key that reads as an int: its first character was encoded
                part = digits
        parts.append(part.replace("%2F", "/").replace("%25", "%"))
    return "/".join(parts)


class _Components(dict):
    """`key_component` of plain str and int keys met, by (type, key): every snapshot of a run repeats them.

    Only those two types: equal keys of them always print alike (1 and True are one dict key, hence
    the type; 0.0 and -0.0 are too, but print apart). Long keys are not kept, and it is emptied when
    large: a cache, not a record.
    """

    def __missing__(self, typed_key: tuple[type, Any]) -> str:
        component = key_component(typed_key[1])
        if len(component) <= 256:
            if len(self) >= 1 << 16:
                self.clear()
            self[typed_key] = component
        return component


_COMPONENTS = _Components()


def join_key(prefix: str, key: Any) -> str:
    """The path of a dict item below `prefix` (see `key_component`)."""
    kind = type(key)
    component = _COMPONENTS[kind, key] if kind is str or kind is int else key_component(key)
    return f"{prefix}/{component}" if prefix else component


def raw_from_torch(tensor, path: str = "") -> RawTensor:
    """The raw bytes of a dense torch tensor (moved to the CPU, made contiguous).

    A conjugate or negative view is stored with its bits resolved, as the values it reads as.
    """
    torch = _torch()
    where = path or "<root>"
    if tensor.is_quantized:
        raise UnsupportedStateError(
            f"{where}: quantized tensors ({tensor.dtype}) are not supported; store tensor.dequantize(), "
            "or its int_repr() with its scales and zero points")
    if tensor.layout != torch.strided:
        raise UnsupportedStateError(f"{where}: tensor layout {tensor.layout} is not supported; store .to_dense()")
    if tensor.device.type == "meta":
        raise UnsupportedStateError(f"{where}: a tensor on the meta device has no data to store")
    if min(tensor.shape, default=0) < 0:  # torch.load lets an empty tensor of a damaged file have one
        raise UnsupportedStateError(f"{where}: shape {list(tensor.shape)} has a negative size (a damaged file?)")
    # as bits: a bool copy writes each nonzero byte as 1, where a bool view of a uint8 tensor held 2 or 255
    flat = as_bits(torch, tensor.detach().resolve_conj().resolve_neg()).cpu().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element counts as contiguous at any stride
        flat = flat.as_strided((1,), (1,))
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
    return RawTensor(f"torch.{str(tensor.dtype).removeprefix('torch.')}", tuple(tensor.shape), data)


def raw_from_numpy(array: np.ndarray, path: str = "") -> RawTensor:
    if array.dtype.hasobject:
        raise UnsupportedStateError(f"{path or '<root>'}: numpy arrays of Python objects cannot be stored without "
                                    "pickle; convert it to a list (of str, numbers) or to an array of another dtype")
    flat = np.ascontiguousarray(array).reshape(-1)
    return RawTensor(NUMPY_PREFIX + array.dtype.str, tuple(array.shape), flat.view(np.uint8))


SLICE_ELEMENTS = 1 << 22  # a large tensor's values are read a slice at a time: no copy of it whole


def element_slices(raw: RawTensor, first: int = 0, elements: int = SLICE_ELEMENTS) -> Iterator[RawTensor]:
    """The tensor from element `first` on as flat tensors of at most `elements` each (views of its bytes)."""
    per = elements * raw.itemsize
    for start in range(first * raw.itemsize, raw.data.size, per):
        part = raw.data[start: start + per]
        yield RawTensor(raw.dtype, (part.size // raw.itemsize,), part)


def element_unit(itemsize: int) -> np.dtype:
    """A numpy type that holds one element's bytes as they are: an unsigned integer of its size, else raw bytes."""
    return np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else np.dtype((np.void, itemsize))


def raw_from_bytes(blob: bytes | memoryview | np.ndarray) -> RawTensor:
    data = blob if isinstance(blob, np.ndarray) else np.frombuffer(blob, dtype=np.uint8)
    return RawTensor(BYTES_DTYPE, (int(data.size),), data)


NUMPY_MAX_DIMS = 64  # numpy's limit; torch takes more, so a tensor of more dimensions is shaped in torch


def materialize(raw: RawTensor, device: str | None = None) -> Any:
    """Turn a RawTensor back into a torch tensor, numpy array or bytes; the data is not copied."""
    if raw.dtype == BYTES_DTYPE:
        return raw.data.tobytes()
    if raw.dtype.startswith(NUMPY_PREFIX):
        dtype = np.dtype(raw.dtype[len(NUMPY_PREFIX) :])
        if dtype.itemsize == 0:  # a record of no fields: no bytes to view, the shape alone
            return np.zeros(raw.shape, dtype)
        return raw.data.view(dtype).reshape(raw.shape)
    torch = _torch()
    data = raw.data if raw.data.flags.writeable else raw.data.copy()
    same = _NUMPY_OF_TORCH.get(raw.dtype)
    if same is not None and data.size and len(raw.shape) <= NUMPY_MAX_DIMS:  # one torch call: 5 -> 1.5 us a tensor
        tensor = torch.from_numpy(data.view(same).reshape(raw.shape))
    else:
        buffer = torch.from_numpy(data) if data.size else torch.empty(0, dtype=torch.uint8)
        tensor = buffer.view(torch_dtype(raw.dtype)).reshape(raw.shape)
    return tensor.to(device) if device and device != "cpu" else tensor


def float64_values(raw: RawTensor) -> np.ndarray | None:
    """The values of a floating-point tensor (torch or numpy) as float64; None for other dtypes.

    numpy views the common formats directly; torch (imported only then) converts the rest, such
    as the float8 formats.
    """
    if raw.dtype.startswith(NUMPY_PREFIX):
        kind = np.dtype(raw.dtype[len(NUMPY_PREFIX) :])
        return raw.data.view(kind).astype(np.float64) if kind.kind == "f" else None
    if raw.dtype == TORCH_PREFIX + "bfloat16":
        return (raw.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    same = _NUMPY_OF_TORCH.get(raw.dtype)
    if same is not None:
        return raw.data.view(same).astype(np.float64) if same.kind == "f" else None
    if not raw.dtype.startswith(TORCH_PREFIX):
        return None
    tensor = materialize(raw)
    if not tensor.is_floating_point():
        return None
    try:
        return tensor.double().numpy().reshape(-1)
    except (NotImplementedError, RuntimeError):  # packed formats (float4_e2m1fn_x2) torch cannot convert
        return None


# torch dtypes whose numpy namesake has the same bytes (bfloat16 and the float8s have none)
_NUMPY_OF_TORCH = {TORCH_PREFIX + name: np.dtype(name) for name in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128")}


def _ordered(items: set | frozenset) -> list:
    """A set's items in a fixed order: sorted, or by type and content where they do not compare (``{1, "a"}``)."""
    try:
        return sorted(items)
    except (TypeError, RuntimeError, ValueError):  # RuntimeError: tensors, whose < is no order
        return sorted(items, key=_order_key)


def _order_key(item: Any) -> tuple[str, str]:
    """Type, then content: a tensor's dtype, shape and bytes (its repr elides them), anything else's repr."""
    torch = sys.modules.get("torch")  # not loaded: no item is a tensor
    if torch is not None and isinstance(item, torch.Tensor):
        try:  # conj and neg views resolved; one that has no bytes to read (nested, meta) is refused when encoded
            raw = item.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)
            return type(item).__name__, f"{item.dtype} {tuple(item.shape)} {hashlib.blake2b(raw.numpy()).hexdigest()}"
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return type(item).__name__, repr(item)


_PLAIN_NAN = struct.pack("<d", math.nan)


def _float(value: float) -> Any:
    """A float as JSON holds it: NaN and infinities by name, a NaN with a sign or payload with its bits too."""
    if math.isfinite(value):
        return value
    bits = struct.pack("<d", value)
    return ["float", repr(value), bits.hex()] if value != value and bits != _PLAIN_NAN else ["float", repr(value)]


def _float_of(node: list) -> float:
    """The float a skeleton's ["float", name] or ["float", "nan", bits] node holds (older readers take the name)."""
    if len(node) > 2 and isinstance(node[2], str) and len(node[2]) == 16:
        with contextlib.suppress(ValueError):  # not hex: a damaged skeleton still gives the NaN its name says
            return struct.unpack("<d", bytes.fromhex(node[2]))[0]
    return float(node[1])


# Bounds of one flatten, far above any real checkpoint (a 70B model's state has ~10^4 nodes and a
# depth under 20). A small pickle of shared containers can name 10^30 nodes ("billion laughs"), and
# deep nesting would exhaust the stack, so both are counted as the state is walked.
MAX_NODES = 10_000_000
MAX_SHARED = 1_000_000  # items met again through containers met before: only sharing can multiply them
MAX_DEPTH = 200
MAX_TEXT = 256 << 20  # characters of strings (values and keys) in one skeleton
MAX_INT_BITS = 8192  # JSON writes ints as decimal text; Python refuses to print ints of >4300 digits
# bytes that views of one storage may add up to, beyond the storage itself: x and x.t() both stored
# are fine, a million overlapping views of one storage (or a huge expand of a scalar) are not
MAX_VIEW_RATIO = 8
MAX_VIEW_SLACK = 256 << 20


class _TensorTable(dict):
    """Tensors by path; a second tensor at a taken path is refused, never merged."""

    def __setitem__(self, path: str, raw: RawTensor) -> None:
        if path in self:
            raise UnsupportedStateError(
                f"two values of the state would be stored at the same path {path!r}; "
                "rename the dict keys that collide")
        super().__setitem__(path, raw)


def _limit(path: str, what: str) -> UnsupportedStateError:
    where = path if len(path) <= 80 else path[:80] + "..."  # a path 200 levels deep is no help in full
    return UnsupportedStateError(
        f"{where or '<root>'}: the state {what}; ckptstore refuses it (a checkpoint this large or "
        "deep is almost certainly a malformed or malicious file)")


# Tensor attributes that are bookkeeping only (transformers marks initialised weights): dropped unsaid,
# here and by torchzip's reader of Parameter state
BOOKKEEPING_ATTRIBUTES = frozenset({"_is_hf_initialized"})


class _Flattener:
    def __init__(self, to_raw: Callable[[Any, str], RawTensor] | None = None) -> None:
        self.to_raw = to_raw or raw_from_torch  # a background commit's snapshot copies instead (formats/snapshot.py)
        self.tensors: dict[str, RawTensor] = _TensorTable()
        self.aliases: dict[tuple, str] = {}
        # storage -> [(node, storage bytes, offset, stride)] of each distinct view stored
        self.views: dict[Any, list[tuple[list, int, int, tuple[int, ...]]]] = {}
        self.shared: dict[int, str] = {}  # id of a bytes or ndarray leaf -> its path, so repeats alias
        self.keyless: dict[int, str] = {}  # id of a tensor with no bytes to key it by (numel 0) -> its path
        self.view_bytes: dict[int, int] = {}  # storage address -> bytes its views have taken so far
        self.seen: set[int] = set()  # ids of the containers walked so far
        self.owners: dict[str, list[int]] = {}  # path -> ids of the distinct Parameters (or grad tensors) on it
        self.nodes = self.repeats = self.depth = self.text = 0
        self.attributes: list[str] = []  # tensor attributes (p.tp_dim = 0) the skeleton has no place for
        self.exact = _exact_with_torch() if "torch" in sys.modules else _EXACT  # never imports torch itself

    def flatten(self, obj: Any, prefix: str) -> FlatState:
        """The skeleton and tensors of `obj`, views of one storage marked as such."""
        skeleton = self.encode(obj, prefix)
        mark_shared_views(self.views)
        if self.attributes:
            warn_caller(f"tensor attributes are not stored ({listing(self.attributes, 3)}): loading the "
                        "commit gives the tensors without them (a zip file checked out is its bytes, with them)",
                        UserWarning)
        return FlatState(skeleton, self.tensors)

    def tensor_extras(self, node: list, requires_grad: bool, parameter: bool, value: Any) -> list:
        """Add what torch.load gives back besides the values: Parameter, requires_grad, which object.

        Distinct tensors viewing the same bytes (`t` and `t.detach()`, a Parameter and its tie) are two
        objects, each with its own flag: the second and later on a path are numbered ("object"), so a set
        of them keeps its members; `value` saved twice is one.
        """
        owners = self.owners.setdefault(node[1], [])
        if id(value) not in owners:  # `value` lives in the state being flattened: its id is its own
            owners.append(id(value))
        number = owners.index(id(value))
        if not (parameter or requires_grad):
            if number:  # a plain tensor's own object: checkout gives it a tensor of its own
                node.append({"object": number})
            return node
        extras = {"parameter": True, "requires_grad": requires_grad} if parameter else {"requires_grad": True}
        if number:
            extras["object"] = number
        node.append(extras)
        return node

    def first_keyless(self, value: Any, path: str) -> str:
        """Where the tensor `value`, which has no bytes to key it by (numel 0), was first met: `path` if never.

        One empty Parameter tied at two paths is one object, as torch.load gives it; two empty tensors stay two.
        """
        return self.keyless.setdefault(id(value), path)  # `value` lives in the state until flatten returns

    def enter(self, container: Any, path: str, items: int) -> None:
        """Charge a container's items against the bounds, one level deeper; raise past a bound.

        Counted per container, not per value, to keep flatten's cost per value as it was.
        """
        self.nodes += items
        self.depth += 1
        if id(container) in self.seen:
            self.repeats += items
        else:
            self.seen.add(id(container))
        if self.repeats > MAX_SHARED:
            raise _limit(path, f"reaches more than {MAX_SHARED:,} values through containers it shares "
                               "(a small pickle that expands without bound?)")
        if self.nodes > MAX_NODES:
            raise _limit(path, f"has more than {MAX_NODES:,} values")
        if self.depth > MAX_DEPTH:
            raise _limit(path, f"nests containers more than {MAX_DEPTH} deep (or a container holds itself)")

    def count_view(self, storage: int, storage_nbytes: int, nbytes: int, path: str) -> None:
        """Charge a tensor's bytes to its storage; refuse views that add up far beyond it."""
        taken = self.view_bytes.get(storage, 0) + nbytes
        self.view_bytes[storage] = taken
        if taken > MAX_VIEW_RATIO * storage_nbytes + MAX_VIEW_SLACK:
            raise _limit(path, f"views one {storage_nbytes:,}-byte storage as {taken:,} bytes of tensors "
                               f"(more than {MAX_VIEW_RATIO}x it plus {MAX_VIEW_SLACK >> 20} MiB)")

    def tensor(self, value, path: str) -> list:
        torch = _torch()
        if value.is_nested:  # a strided nested tensor has no sizes to read; a jagged one is a wrapper subclass
            raise UnsupportedStateError(f"{path or '<root>'}: nested tensors are not supported")
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter and (
                hint := _valueless_tensor_hint(value)):
            raise UnsupportedStateError(f"{path or '<root>'}: {hint}")
        key = None
        if value.layout == torch.strided and not value.is_meta and value.numel():
            storage_nbytes, pointer = _storage_of(value, path, type(value) in (torch.Tensor, torch.nn.Parameter))
            key = (
                pointer,
                value.storage_offset(),
                value.shape,  # a torch.Size hashes and compares as the tuple it is
                value.stride(),
                value.dtype,
                value.is_conj(),  # x and x.conj() share all of the above but read differently
                value.is_neg(),
            )
        if key is not None and key in self.aliases:
            node = ["tensor", self.aliases[key]]
        elif key is None and (first := self.first_keyless(value, path)) != path:
            node = ["tensor", first]
        else:
            if key is not None:  # before the copy: an expand() of a scalar could ask for terabytes
                self.count_view(key[0], storage_nbytes, value.numel() * value.element_size(), path)
            self.tensors[path] = self.to_raw(value, path)
            node = ["tensor", path]
            if key is not None:
                self.aliases[key] = path
            if key is not None and not (key[5] or key[6]):  # stored resolved: its bytes are not the storage's
                self.views.setdefault(key[0], []).append((node, storage_nbytes, key[1], key[3]))
        parameter = type(value) is not torch.Tensor and isinstance(value, torch.nn.Parameter)  # a slow isinstance
        if value.__dict__:
            self.attributes += [f"{path or '<root>'}.{name}" for name in value.__dict__
                                if name not in BOOKKEEPING_ATTRIBUTES]
        return self.tensor_extras(node, value.requires_grad, parameter, value)

    def encode(self, value: Any, path: str) -> Any:
        """The skeleton node of `value`; tensors it holds are added to `self.tensors` under `path`."""
        method = self.exact.get(type(value))  # the common types in one lookup; subclasses take the loop
        if method is not None:
            return method(self, value, path)
        for types, method in _ENCODERS:  # first match wins, so the order of _ENCODERS matters
            if isinstance(value, types):
                return method(self, value, path)
        return self.encode_other(value, path)

    def _plain(self, value: Any, path: str) -> Any:
        return value

    def _str(self, value: str, path: str) -> Any:
        self.text += len(value)
        if self.text > MAX_TEXT:
            raise _limit(path, f"holds more than {MAX_TEXT:,} characters of strings")
        return value

    def _int(self, value: int, path: str) -> Any:
        if value.bit_length() > MAX_INT_BITS:
            raise _limit(path, f"holds an integer of more than {MAX_INT_BITS} bits")
        return value

    def _float_value(self, value: float, path: str) -> Any:
        return _float(value)

    def _complex(self, value: complex, path: str) -> Any:
        return ["complex", _float(value.real), _float(value.imag)]

    def _npscalar(self, value: np.generic, path: str) -> Any:
        kind = value.dtype.kind
        if not _exact_npscalar(value.dtype):
            raise UnsupportedStateError(f"{path or '<root>'}: a numpy {value.dtype} scalar has no exact stored form; "
                                        "store str(value), a number, or a 0-d array (np.asarray(value))")
        v = value.item()
        if kind in "fc" and value.dtype.type(v).tobytes() != value.tobytes():  # a float32 signalling NaN, made quiet
            return ["npbits", value.dtype.str, value.tobytes().hex()]
        return ["npscalar", value.dtype.str, self._complex(v, path) if kind == "c" else _float(v)
                if isinstance(v, float) else v]

    def _bytes(self, value: bytes | bytearray, path: str) -> Any:
        tag = "bytearray" if isinstance(value, bytearray) else "bytes"  # a subclass of bytes reads back as bytes
        return [tag, self.leaf(value, path, lambda: raw_from_bytes(bytes(value)))]

    def _ndarray(self, value: np.ndarray, path: str) -> Any:
        if isinstance(value, np.ma.MaskedArray):  # its data alone would come back with the masked fill as values
            raise UnsupportedStateError(f"{path or '<root>'}: a numpy masked array's mask would be lost; store "
                                        "value.filled(...) and np.ma.getmaskarray(value) as two arrays")
        return ["ndarray", self.leaf(value, path, lambda: raw_from_numpy(value, path))]

    def leaf(self, value: Any, path: str, make: Callable[[], RawTensor]) -> str:
        """The path of a bytes or array leaf; the same object met again is a reference to it.

        Without this, one shared array would be stored once per place it occurs: a small pickle
        could name it a million times.
        """
        first = self.shared.get(id(value))  # `value` lives in the state until flatten returns
        if first is not None:
            return first
        self.tensors[path] = make()
        # b"" is one object everywhere; empty leaves cost nothing, so keep their paths (a 0-d array has no len)
        if value.size if isinstance(value, np.ndarray) else len(value):
            self.shared[id(value)] = path
        return path

    def _mapping(self, value: dict, path: str) -> Any:
        self.enter(value, path, 2 * len(value))
        items = []
        for key, item in value.items():
            if isinstance(key, tuple) and (room := MAX_DEPTH - self.depth) < key_nesting(key, room, path):  # first
                raise _limit(path, f"nests containers more than {MAX_DEPTH} deep (a dict key's tuples nest past it)")
            if not _storable_key(key):
                raise UnsupportedStateError(
                    f"{path or '<root>'}: a dict key of type {type(key).__name__} ({key!r:.60}): ckptstore keeps "
                    "str, int, float, bool and None keys and tuples of them; give the dict such keys (str(key))")
            items.append([self.encode(key, path), self.encode(item, join_key(path, key))])
        self.depth -= 1
        return ["odict" if isinstance(value, OrderedDict) else "dict", items]

    def _dict(self, value: dict, path: str) -> Any:
        """A dict, and the attributes an OrderedDict carries (state_dict()._metadata: module versions)."""
        node = self._mapping(value, path)
        attrs = vars(value) if isinstance(value, OrderedDict) and hasattr(value, "__dict__") else {}
        if attrs:
            odd = next((name for name in attrs if not plain_attribute(name)), None)
            if odd is not None:  # what unflatten would refuse to set again
                raise UnsupportedStateError(f"{path or '<root>'}: an OrderedDict attribute named {odd!r:.60}: "
                                            "ckptstore keeps those named by identifiers, no dunders; remove it")
            # "%attrs" is no escaped key (escape turns every "%" into "%25"), so no path collides
            where = f"{path}/%attrs" if path else "%attrs"
            node.append({"attrs": [[name, self.encode(item, join(where, name))] for name, item in attrs.items()]})
        return node

    def _sequence(self, value: list | tuple, path: str) -> Any:
        if type(value).__name__ == "Size" and type(value).__module__ == "torch":  # torch.Size is a tuple
            return ["size", list(value)]
        self.enter(value, path, len(value))
        tag = "list" if isinstance(value, list) else "tuple"
        node = [tag, [self.encode(item, join(path, str(i))) for i, item in enumerate(value)]]
        self.depth -= 1
        return node

    def _set(self, value: set | frozenset, path: str) -> Any:
        self.enter(value, path, len(value))
        node = ["frozenset" if isinstance(value, frozenset) else "set",
                [self.encode(item, join(path, str(i))) for i, item in enumerate(_ordered(value))]]
        self.depth -= 1
        return node

    def encode_other(self, value: Any, path: str) -> Any:
        """Leaves only torch can recognise; a flattener of stand-in objects overrides this."""
        torch = _torch()
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, torch.Size):
            return ["size", list(value)]
        if isinstance(value, torch.dtype):
            return ["dtype", str(value)]
        if isinstance(value, torch.device):
            return ["device", str(value)]
        return self.encode_last(value, path)

    def encode_last(self, value: Any, path: str) -> Any:
        """A numpy dtype, or the error every value nothing else claimed ends in."""
        if isinstance(value, np.dtype):
            return ["npdtype", value.str]
        raise UnsupportedStateError(
            f"{path or '<root>'}: values of type {type(value).__module__}.{type(value).__qualname__} "
            f"cannot be stored without pickle; {_hint(value)}"
        )


def _storage_of(value: Any, path: str, plain: bool) -> tuple[int, int]:
    """A tensor's storage bytes and address.

    A subclass without storage of its own (torch's MaskedTensor, a wrapper no hint knows) is refused
    by name rather than with torch's own error; a plain tensor's error is torch's.
    """
    try:
        storage = value.untyped_storage()
        return storage.nbytes(), storage.data_ptr()
    except RuntimeError as exc:
        if plain:
            raise
        raise UnsupportedStateError(f"{path or '<root>'}: a {type(value).__qualname__} holds no storage of its own "
                                    f"({exc}): commit plain tensors, such as the tensors it holds") from None


def _valueless_tensor_hint(value: Any) -> str:
    """Why a torch.Tensor subclass that holds no values of its own here is refused, and what to do; "" for others.

    Other subclasses are stored as their values and read back as torch.Tensor (their classes would
    need pickle). These raised torch's own errors when their storage was read.
    """
    kind = type(value).__qualname__
    if kind == "DTensor":
        return ("a DTensor is one rank's part of a distributed tensor: commit sharded states through "
                "torch.distributed.checkpoint with ckptstore.dcp, or gather it with .full_tensor() first")
    if kind.startswith("Uninitialized"):
        return f"a {kind} (a lazy module's tensor) holds no values yet: run one forward pass before committing"
    if kind in ("FakeTensor", "FunctionalTensor"):
        return f"a {kind} (a tracing stand-in) holds no values: commit the real tensors"
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(value):
        return (f"a {kind} is a wrapper tensor subclass (as torchao's float8, NF4 and quantized tensors are), whose "
                "values live in the tensors it wraps: commit plain tensors, such as its .dequantize() or the "
                "tensors it holds")
    return ""


def _hint(value: Any) -> str:
    """What to store instead of a value that needs pickle (the common ones by name)."""
    names = {f"{k.__module__}.{k.__qualname__}" for k in type(value).__mro__}
    if "torch.nn.modules.module.Module" in names:
        return "store model.state_dict() instead of the module"
    if "argparse.Namespace" in names:
        return "store vars(args), a dict, instead of the Namespace"
    if "pathlib.PurePath" in names:
        return "store str(path) instead of the Path"
    return "convert them to tensors, numbers, strings or containers"


# (types, encoder) in the order the checks must run: bool and numpy's float64 are subclasses of
# int and float, OrderedDict of dict, so an earlier entry decides those
_ENCODERS: list[tuple[type | tuple[type, ...], Callable[[_Flattener, Any, str], Any]]] = [
    ((type(None), bool), _Flattener._plain),
    (str, _Flattener._str),
    (np.generic, _Flattener._npscalar),  # before float: np.float64 is one, and would come back a float
    (int, _Flattener._int),
    (float, _Flattener._float_value),
    (complex, _Flattener._complex),  # torch.load(weights_only=True) reads it (an optimizer's param group may hold it)
    ((bytes, bytearray), _Flattener._bytes),
    (np.ndarray, _Flattener._ndarray),
    (dict, _Flattener._dict),
    ((list, tuple), _Flattener._sequence),
    ((set, frozenset), _Flattener._set),
]

_EXACT = {kind: method for types, method in _ENCODERS
          for kind in (types if isinstance(types, tuple) else (types,)) if kind in (
              type(None), bool, str, int, float, complex, bytes, dict, OrderedDict, list, tuple, set)}


@functools.cache
def _exact_with_torch() -> dict:
    """`_EXACT` and torch's tensor types: where torch is in use, its tensors skip the isinstance chain too."""
    torch = _torch()
    return {**_EXACT, torch.Tensor: _Flattener.tensor, torch.nn.Parameter: _Flattener.tensor}


def flatten(obj: Any, prefix: str = "", to_raw: Callable[[Any, str], RawTensor] | None = None) -> FlatState:
    """Split `obj` into a JSON skeleton and raw tensors named by their path in the structure.

    `to_raw(tensor, path)` makes each torch tensor's RawTensor (default `raw_from_torch`).
    """
    return _Flattener(to_raw).flatten(obj, prefix)


def mark_shared_views(views: dict[Any, list[tuple[list, int, int, tuple[int, ...]]]]) -> None:
    """Tensor nodes that view one storage in different ways say so, so checkout shares it again.

    The storage is named by the first such node's path; each node gets
    `"view": [storage, storage bytes, offset, stride]` (offset and stride in its own elements).
    """
    for seen in views.values():
        if len(seen) < 2:
            continue
        name = seen[0][0][1]
        for node, nbytes, offset, stride in seen:
            if len(node) == 2:
                node.append({})
            node[2]["view"] = [name, nbytes, offset, list(stride)]


def shared_view_paths(skeleton: Any) -> set[str]:
    """Paths of tensors marked as one of several views of a storage: a change to one shows in the others."""
    found, stack = set(), [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            if node[:1] == ["tensor"] and len(node) > 2 and isinstance(node[2], dict) and "view" in node[2]:
                found.add(node[1])
            stack.extend(node)
    return found


def unflatten(skeleton: Any, lookup: Callable[[str], Any], file_size: int | None = None) -> Any:
    """Rebuild the nested object; `lookup(path)` returns the materialized tensor for a path.

    Paths that occur twice (tensors that shared storage) resolve to the same object. A skeleton no
    flatten wrote (damaged, or a remote's forgery) is MalformedSkeletonError: found as it is decoded,
    with no pass of its own over a large state.
    """
    try:
        return _Unflattener(lookup, file_size).decode(skeleton)
    except MalformedSkeletonError.WALK_ERRORS as exc:
        raise MalformedSkeletonError.of(exc) from None


def plain_attribute(name: Any) -> bool:
    """Whether a rebuilt OrderedDict may be given attribute `name` (`_metadata`): no dunder (`__class__`)."""
    return type(name) is str and name.isidentifier() and not (name.startswith("__") and name.endswith("__"))


class _Unflattener:
    """One skeleton's decoding: the lookup, and a cache so shared paths give one object."""

    def __init__(self, lookup: Callable[[str], Any], file_size: int | None = None) -> None:
        self.lookup = lookup
        self.budget = StorageBudget(file_size)  # of the file torch.save wrote: its storages came from it
        self.cache: dict[str, Any] = {}
        self.parameters: dict[tuple[str, int], Any] = {}  # by (path, object)
        self.grads: dict[tuple[str, int], Any] = {}  # tensors that require grad or are numbered, by (path, object)
        self.storages: dict[str, Any] = {}

    def get(self, path: str) -> Any:
        if path not in self.cache:
            self.cache[path] = self.lookup(path)
        return self.cache[path]

    def decode(self, node: Any) -> Any:
        if not isinstance(node, list):
            return node
        decoder = _DECODERS.get(node[0])
        if decoder is None:
            raise UnsupportedStateError(f"unknown skeleton tag {node[0]!r}: written by a newer ckptstore?")
        return decoder(self, node)

    def tensor(self, node: list) -> Any:
        extras = node[2] if len(node) > 2 else {}
        value = self.get(node[1])
        if "view" in extras:
            value = self.cache[node[1]] = self.view(value, *extras["view"])
        owner = (node[1], extras.get("object", 0))  # one object saved twice comes back as one; two as two
        if extras.get("parameter"):
            if owner not in self.parameters:
                self.parameters[owner] = _torch().nn.Parameter(value, requires_grad=extras["requires_grad"])
            return self.parameters[owner]
        if extras.get("requires_grad") or owner[1]:
            # an object of its own on the same storage (the tensor saved beside it as its .detach(), or t[:])
            if owner not in self.grads:
                self.grads[owner] = value.detach().requires_grad_(bool(extras.get("requires_grad")))
            return self.grads[owner]
        return value

    def view(self, value: Any, storage: str, nbytes: int, offset: int, stride: list[int]) -> Any:
        """`value` placed as a view of the storage named `storage`, which other views share."""
        torch = _torch()
        check_view(tuple(value.shape), value.element_size(), storage, nbytes, offset, stride)
        self.budget.take(storage, nbytes)
        placed = storage in self.storages
        if not placed:
            # zeros, not empty: bytes no view covers are written out by torch.save and must not be stale memory
            self.storages[storage] = torch.zeros(nbytes, dtype=torch.uint8, device=value.device).untyped_storage()
        elif nbytes > (had := self.storages[storage].nbytes()):  # a later view claims more (an array's prefix first)
            self.storages[storage].resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=value.device).set_(
                self.storages[storage], had, (nbytes - had,), (1,)).zero_()  # grown as zeros too, not stale memory
        shared = torch.empty(0, dtype=value.dtype, device=value.device)
        shared.set_(self.storages[storage], offset, value.shape, stride)
        if placed and value.dtype == torch.bool:  # a commit before a443893 stored a bool view's bytes as 0 and 1:
            # a byte another view placed (a uint8 tensor's 255) stays where it reads as the same bool
            old = shared.view(torch.uint8)
            value = torch.where(old.ne(0).eq(value), old, value.view(torch.uint8)).view(torch.bool)
        with torch.no_grad():
            try:  # as bits: a bool copy_ writes each nonzero byte as 1, and a uint8 view of those bytes held 2 or 255
                as_bits(torch, shared).copy_(as_bits(torch, value))
            except RuntimeError:  # a view whose elements share memory (an expand()ed tensor: stride 0)
                scatter(torch, self.storages[storage], value, offset, stride)
        return shared

    def mapping(self, node: list) -> Any:
        pairs = [(self.decode(k), self.decode(v)) for k, v in node[1]]
        if node[0] != "odict":
            return dict(pairs)
        result = OrderedDict(pairs)
        for name, value in (node[2].get("attrs", []) if len(node) > 2 else []):
            if not plain_attribute(name):
                raise ValueError(f"an OrderedDict attribute named {name!r:.60}")
            setattr(result, name, self.decode(value))  # state_dict._metadata, for load_state_dict
        return result


def _device(text: Any) -> Any:
    """torch.device(`text`); a string torch does not take is ValueError, a forged skeleton's damage (not a crash)."""
    try:
        return _torch().device(text)
    except RuntimeError as exc:
        raise ValueError(f"no torch device {text!r:.60}: {exc}") from None


def _exact_npscalar(dtype: np.dtype) -> bool:
    """Whether a numpy scalar of `dtype` has an exact JSON value: bool, int or float of 8 bytes at most, complex 16."""
    return dtype.kind in "biufc" and dtype.itemsize <= (16 if dtype.kind == "c" else 8)


def _npscalar_of(dtype: np.dtype, value: Any) -> np.generic:
    """A numpy scalar of a kind and size `_npscalar` writes: a forged one (void of 2**29 bytes) is damage."""
    if not _exact_npscalar(dtype) or type(value) not in (bool, int, float, complex):
        raise ValueError(f"a numpy scalar {value!r:.40} as {dtype}: not one this ckptstore writes")
    return dtype.type(value)


def _npbits(node: list) -> np.generic:
    """A non-finite numpy float or complex scalar from its bits (["npbits", dtype, hex])."""
    dtype = np.dtype(node[1])
    raw = bytes.fromhex(node[2])
    if dtype.kind not in "fc" or len(raw) != dtype.itemsize:
        raise UnsupportedStateError(f"a numpy scalar of {len(raw)} bytes as {dtype}: not one this ckptstore writes")
    return np.frombuffer(raw, dtype=dtype)[0]


_DECODERS: dict[str, Callable[[_Unflattener, list], Any]] = {
    "tensor": _Unflattener.tensor,
    "bytes": lambda u, node: u.get(node[1]),
    "bytearray": lambda u, node: bytearray(u.get(node[1])),
    "ndarray": lambda u, node: u.get(node[1]),
    "dict": _Unflattener.mapping,
    "odict": _Unflattener.mapping,
    "list": lambda u, node: [u.decode(item) for item in node[1]],
    "tuple": lambda u, node: tuple(u.decode(item) for item in node[1]),
    "set": lambda u, node: {u.decode(item) for item in node[1]},
    "frozenset": lambda u, node: frozenset(u.decode(item) for item in node[1]),
    "float": lambda u, node: _float_of(node),
    "complex": lambda u, node: complex(u.decode(node[1]), u.decode(node[2])),
    "npscalar": lambda u, node: _npscalar_of(np.dtype(node[1]), u.decode(node[2])),
    "npbits": lambda u, node: _npbits(node),
    "size": lambda u, node: _torch().Size(node[1]),
    "dtype": lambda u, node: torch_dtype(node[1]),
    "device": lambda u, node: _device(node[1]),
    "npdtype": lambda u, node: np.dtype(node[1]),
}
