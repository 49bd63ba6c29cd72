"""numpy dtype state in a pickle: checked before any unpickler hands it to numpy.

A pickled numpy array rebuilds its dtype with `numpy.dtype(spec)` and then BUILD, which is numpy's
own `dtype.__setstate__`. That trusts its tuple: a 1.5 KB torch.save file whose tuple was cut short
crashed the process (SIGSEGV), and one with other flags made numpy print "Internal error"
tracebacks. A plain numeric dtype's state is always (3, byte order, None, None, None, -1, -1, 0);
anything else is refused here, by a dry run over the pickle that builds nothing (`bad_dtype_state`)
for the pickles torch's own loader reads, and by `dtype_state_problem` in torchzip's unpickler.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import IO, Any

PLAIN_STATE_TAIL = (None, None, None, -1, -1, 0)
BYTE_ORDERS = ("<", ">", "=", "|")


def dtype_state_problem(state: Any) -> str | None:
    """Why `state` is no plain numeric dtype's BUILD state, or None."""
    if (type(state) is tuple and len(state) == 8 and state[0] == 3 and state[1] in BYTE_ORDERS
            and state[2:] == PLAIN_STATE_TAIL):
        return None
    return f"a numpy dtype's state {state!r:.80} is none a numeric dtype has"


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
    """What `numpy.dtype(...)` stands for in the dry run: its BUILD state is checked."""

    def __setstate__(self, state: Any) -> None:
        problem = dtype_state_problem(state)
        if problem is not None:
            raise _BadState(problem)


class _BadState(Exception):
    pass


class _DryRun(pickle._Unpickler):  # the pure-Python one: its find_class and BUILD are ours
    dispatch = dict(pickle._Unpickler.dispatch)

    def load_proto(self) -> None:  # anywhere, of any number, as torch's loader reads it (with a warning)
        self.read(1)

    dispatch[pickle.PROTO[0]] = load_proto

    def find_class(self, module: str, name: str) -> Any:
        return _Dtype if (module, name) == ("numpy", "dtype") else _Opaque

    def persistent_load(self, pid: Any) -> Any:
        return _Opaque()


def bad_dtype_state(source: bytes | IO[bytes], pickles: int = 1) -> str | None:
    """Why a numpy dtype in the first `pickles` pickles of `source` would be built from a state numpy crashes on.

    None when none would, or when the stream is no pickle this dry run can follow (the loader then says why).
    A zip archive (torch.save's format) is read at its `data.pkl`.
    """
    handle = io.BytesIO(source) if isinstance(source, bytes) else source
    start = handle.tell()
    if handle.read(4) == b"PK\x03\x04":
        handle.seek(start)
        try:
            with zipfile.ZipFile(handle) as archive:
                name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
                handle = io.BytesIO(archive.read(name) if name else b"")
        except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, EOFError):
            return None
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
