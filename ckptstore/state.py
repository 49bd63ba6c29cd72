"""Flatten a nested checkpoint into named raw tensors plus a JSON skeleton, and back.

The skeleton is plain JSON: scalars stay JSON scalars, everything else is a list whose first item
is a tag. Nothing here ever pickles. Tensors become `RawTensor`s: dtype name, shape and the raw
bytes as a flat uint8 array, which is all the codecs and the store ever see.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import UnsupportedStateError

BYTES_DTYPE = "bytes"
NUMPY_PREFIX = "numpy:"
TORCH_PREFIX = "torch."


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


def raw_from_torch(tensor) -> RawTensor:
    """The raw bytes of a dense torch tensor (moved to the CPU, made contiguous)."""
    torch = _torch()
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise UnsupportedStateError(f"tensor layout {tensor.layout} is not supported")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
    return RawTensor(f"torch.{str(tensor.dtype).removeprefix('torch.')}", tuple(tensor.shape), data)


def raw_from_numpy(array: np.ndarray) -> RawTensor:
    if array.dtype.hasobject:
        raise UnsupportedStateError("numpy arrays of Python objects cannot be stored without pickle")
    flat = np.ascontiguousarray(array).reshape(-1)
    return RawTensor(NUMPY_PREFIX + array.dtype.str, tuple(array.shape), flat.view(np.uint8))


def raw_from_bytes(blob: bytes | memoryview | np.ndarray) -> RawTensor:
    data = blob if isinstance(blob, np.ndarray) else np.frombuffer(blob, dtype=np.uint8)
    return RawTensor(BYTES_DTYPE, (int(data.size),), data)


def materialize(raw: RawTensor, device: str | None = None) -> Any:
    """Turn a RawTensor back into a torch tensor, numpy array or bytes; the data is not copied."""
    if raw.dtype == BYTES_DTYPE:
        return raw.data.tobytes()
    if raw.dtype.startswith(NUMPY_PREFIX):
        return raw.data.view(np.dtype(raw.dtype[len(NUMPY_PREFIX) :])).reshape(raw.shape)
    torch = _torch()
    data = raw.data if raw.data.flags.writeable else raw.data.copy()
    same = _NUMPY_OF_TORCH.get(raw.dtype)
    if same is not None and data.size:  # typed and shaped in numpy, one torch call: 5 -> 1.5 us a tensor
        tensor = torch.from_numpy(data.view(same).reshape(raw.shape))
    else:
        buffer = torch.from_numpy(data) if data.size else torch.empty(0, dtype=torch.uint8)
        tensor = buffer.view(torch_dtype(raw.dtype)).reshape(raw.shape)
    return tensor.to(device) if device and device != "cpu" else tensor


# torch dtypes whose numpy namesake has the same bytes (bfloat16 and the float8s have none)
_NUMPY_OF_TORCH = {TORCH_PREFIX + name: np.dtype(name) for name in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128")}


def _float(value: float) -> Any:
    return value if math.isfinite(value) else ["float", repr(value)]


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, RawTensor] = {}
        self.aliases: dict[tuple, str] = {}

    def tensor(self, value, path: str) -> list:
        torch = _torch()
        key = None
        if value.layout == torch.strided and value.device.type != "meta" and value.numel():
            key = (
                value.untyped_storage().data_ptr(),
                value.storage_offset(),
                tuple(value.shape),
                tuple(value.stride()),
                value.dtype,
            )
        if key is not None and key in self.aliases:
            node = ["tensor", self.aliases[key]]
        else:
            self.tensors[path] = raw_from_torch(value)
            if key is not None:
                self.aliases[key] = path
            node = ["tensor", path]
        if isinstance(value, torch.nn.Parameter):
            node.append({"parameter": True, "requires_grad": value.requires_grad})
        return node

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return _float(value)
        if isinstance(value, np.generic):
            if value.dtype.hasobject:
                raise UnsupportedStateError(f"{path or '<root>'}: numpy object scalar")
            return ["npscalar", value.dtype.str, _float(v) if isinstance(v := value.item(), float) else v]
        if isinstance(value, (bytes, bytearray)):
            self.tensors[path] = raw_from_bytes(bytes(value))
            return ["bytes", path]
        if isinstance(value, np.ndarray):
            self.tensors[path] = raw_from_numpy(value)
            return ["ndarray", path]
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if not isinstance(key, (str, int, float, bool, type(None))):
                    raise UnsupportedStateError(f"{path or '<root>'}: dict key of type {type(key).__name__}")
                items.append([self.encode(key, path), self.encode(item, join(path, str(key)))])
            return ["odict" if isinstance(value, OrderedDict) else "dict", items]
        if isinstance(value, (list, tuple)):
            tag = "list" if isinstance(value, list) else "tuple"
            return [tag, [self.encode(item, join(path, str(i))) for i, item in enumerate(value)]]
        if isinstance(value, (set, frozenset)):
            return ["set", [self.encode(item, join(path, str(i))) for i, item in enumerate(sorted(value))]]
        torch = _torch()
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, torch.Size):
            return ["size", list(value)]
        if isinstance(value, torch.dtype):
            return ["dtype", str(value)]
        if isinstance(value, torch.device):
            return ["device", str(value)]
        if isinstance(value, np.dtype):
            return ["npdtype", value.str]
        raise UnsupportedStateError(
            f"{path or '<root>'}: values of type {type(value).__module__}.{type(value).__qualname__} "
            "cannot be stored without pickle; convert them to tensors, numbers, strings or containers"
        )


def flatten(obj: Any, prefix: str = "") -> FlatState:
    """Split `obj` into a JSON skeleton and raw tensors named by their path in the structure."""
    flattener = _Flattener()
    skeleton = flattener.encode(obj, prefix)
    return FlatState(skeleton, flattener.tensors)


def unflatten(skeleton: Any, lookup: Callable[[str], Any]) -> Any:
    """Rebuild the nested object; `lookup(path)` returns the materialized tensor for a path.

    Paths that occur twice (tensors that shared storage) resolve to the same object.
    """
    cache: dict[str, Any] = {}

    def get(path: str) -> Any:
        if path not in cache:
            cache[path] = lookup(path)
        return cache[path]

    def decode(node: Any) -> Any:
        if not isinstance(node, list):
            return node
        tag = node[0]
        if tag == "tensor":
            value = get(node[1])
            if len(node) > 2 and node[2].get("parameter"):
                value = _torch().nn.Parameter(value, requires_grad=node[2]["requires_grad"])
            return value
        if tag in ("bytes", "ndarray"):
            return get(node[1])
        if tag in ("dict", "odict"):
            pairs = [(decode(k), decode(v)) for k, v in node[1]]
            return OrderedDict(pairs) if tag == "odict" else dict(pairs)
        if tag == "list":
            return [decode(item) for item in node[1]]
        if tag == "tuple":
            return tuple(decode(item) for item in node[1])
        if tag == "set":
            return {decode(item) for item in node[1]}
        if tag == "float":
            return float(node[1])
        if tag == "npscalar":
            return np.dtype(node[1]).type(decode(node[2]))
        torch = _torch()
        if tag == "size":
            return torch.Size(node[1])
        if tag == "dtype":
            return torch_dtype(node[1])
        if tag == "device":
            return torch.device(node[1])
        if tag == "npdtype":
            return np.dtype(node[1])
        raise UnsupportedStateError(f"unknown skeleton tag {tag!r}: written by a newer ckptstore?")

    return decode(skeleton)
