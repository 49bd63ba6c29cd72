"""numpy dtype state in a pickle: checked before any unpickler hands it to numpy.

A pickled numpy array rebuilds its dtype with `numpy.dtype(spec)` and then BUILD, which is numpy's
own `dtype.__setstate__`. That trusts its tuple: a 1.5 KB torch.save file whose tuple was cut short
crashed the process (SIGSEGV), and one with other flags made numpy print "Internal error"
tracebacks. A state is accepted only as numpy writes it for the dtype its spec names (the byte
order aside): by a dry run over the pickle that builds nothing (`bad_dtype_state`) for the pickles
torch's own loader reads, and by `dtype_state_problem` in torchzip's unpickler.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from typing import IO, Any

import numpy as np

BYTE_ORDERS = ("<", ">", "=", "|")
_TIME_UNITS = {b"Y", b"M", b"W", b"D", b"h", b"m", b"s", b"ms", b"us", b"ns", b"ps", b"fs", b"as", b"generic"}


def dtype_state_problem(fresh: np.dtype, state: Any) -> str | None:
    """Why `state` is not the BUILD state numpy writes for the dtype `fresh` (as made from the pickle's spec), or None.

    The byte order may differ; a datetime's unit is part of its state, so the dtype of that unit is
    what it is compared with.
    """
    expected = _expected(fresh, state)
    if (expected is not None and type(state) is tuple and len(state) == len(expected) and state[0] == expected[0]
            and state[1] in BYTE_ORDERS and state[2:] == expected[2:]):
        return None
    return f"a numpy dtype's state {state!r:.80} is none numpy writes for {fresh.str}"


def _expected(fresh: np.dtype, state: Any) -> tuple | None:
    if fresh.kind not in "mM":
        return fresh.__reduce__()[2]
    try:  # (..., (None, (unit, count, 1, 1))): the dtype of that unit, made from words numpy checks
        unit, count = state[8][1][:2]
        if unit not in _TIME_UNITS or type(count) is not int or not 0 < count < 1 << 31:
            return None
        return np.dtype(f"{fresh.str[:3]}[{count}{unit.decode()}]").__reduce__()[2]
    except (TypeError, IndexError, ValueError):
        return None


class _Opaque:
    """Whatever the pickle builds, as nothing: it can be called, filled and built, and holds no state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Dtype(_Opaque):
    """What `numpy.dtype(spec, ...)` stands for in the dry run: its BUILD state is checked against numpy's own."""

    def __init__(self, spec: Any = None, *args: Any, **kwargs: Any) -> None:
        self.spec = spec

    def __setstate__(self, state: Any) -> None:
        try:
            fresh = np.dtype(self.spec) if type(self.spec) is str else None
        except (TypeError, ValueError):  # no dtype: the loader's own call fails the same way, before any BUILD
            return
        problem = dtype_state_problem(fresh, state) if fresh is not None else None
        if problem is not None:
            raise _BadState(problem)


class _BadState(Exception):
    pass


def _latin1(text: Any, encoding: Any = "latin1") -> Any:
    return text.encode("latin1") if type(text) is str and encoding == "latin1" else _Opaque()


class _DryRun(pickle._Unpickler):  # the pure-Python one: its find_class and BUILD are ours
    dispatch = dict(pickle._Unpickler.dispatch)

    def load_proto(self) -> None:  # anywhere, of any number, as torch's loader reads it (with a warning)
        self.read(1)

    dispatch[pickle.PROTO[0]] = load_proto

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):  # protocol 2's bytes (a datetime's unit): rebuilt as bytes
            return _latin1
        return _Dtype if (module, name) == ("numpy", "dtype") else _Opaque

    def persistent_load(self, pid: Any) -> Any:
        return _Opaque()


def zipped_pickle(source: str | os.PathLike | IO[bytes]) -> bytes | None:
    """A torch.save zip's data.pkl, or None where the zip, or that member, cannot be read."""
    try:
        with zipfile.ZipFile(source) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            return archive.read(name) if name else None
    except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, EOFError):
        return None


def bad_dtype_state(source: bytes | IO[bytes], pickles: int = 1) -> str | None:
    """Why a numpy dtype in the first `pickles` pickles of `source` would be built from a state numpy crashes on.

    None when none would, or when the stream is no pickle this dry run can follow (the loader then says why).
    A zip archive (torch.save's format) is read at its `data.pkl`.
    """
    handle = io.BytesIO(source) if isinstance(source, bytes) else source
    start = handle.tell()
    if handle.read(4) == b"PK\x03\x04":
        handle.seek(start)
        handle = io.BytesIO(zipped_pickle(handle) or b"")  # none read: no numpy global, so None below
    else:
        handle.seek(start)
    if isinstance(handle, io.BytesIO) and b"numpy" not in handle.getvalue():
        return None  # no numpy global: no dtype is built
    try:
        for _ in range(pickles):
            _DryRun(handle, encoding="latin1").load()
    except _BadState as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - a pickle this dry run cannot follow: the loader itself judges it
        return None
    return None
