"""Reading and writing a checkpoint unit (a torch.save file, or a folder of files) for the baselines."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ckptstore.formats.torchfile import numpy_safe_globals

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def members(unit: Path) -> list[tuple[str, Path]]:
    """(name inside the unit, path) for each file; a lone file has the name ''."""
    if unit.is_file():
        return [("", unit)]
    return sorted((p.relative_to(unit).as_posix(), p) for p in unit.rglob("*") if p.is_file())


def kind_of(name: str, path: Path) -> str:
    """'torch' for loadable torch.save files, 'safetensors', or 'bytes'."""
    suffix = path.suffix if name else ".pt"
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES and name != "training_args.bin":
        return "torch"
    return "bytes"


def load_member(kind: str, path: Path) -> Any:
    if kind == "torch":
        with torch.serialization.safe_globals(numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    if kind == "safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return path.read_bytes()


def write_member(kind: str, value: Any, path: Path) -> None:
    """Write one file of a checkpoint and fsync it: every method's writes are durable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "torch":
        torch.save(value, path)
    elif kind == "safetensors":
        from safetensors.torch import save_file

        save_file(value, path, metadata={"format": "pt"})
    else:
        path.write_bytes(value)
    fsync_file(path)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_durably(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    fsync_file(dest)


def destination(unit_dest: Path, name: str) -> Path:
    return unit_dest / name if name else unit_dest


def fsync_write(path: Path, parts) -> None:
    with open(path, "wb") as handle:
        for part in parts:
            handle.write(part)
        handle.flush()
        os.fsync(handle.fileno())


def metadata_on_disk(repo: Any) -> int:
    """A repository's SQLite database once its write-ahead log is folded in: what it keeps beside the objects.

    Every ckptstore size counts it, as the baselines' sizes count their own headers (the DCP benchmark's
    always did; the suite's and the lossy benchmarks' counted objects alone before 6 December 2026).
    """
    import contextlib
    import sqlite3

    path = getattr(repo.db.backend, "path", None)  # a SQLite file, here or elsewhere
    if path is None or not path.exists():  # a server: as the repository counts it
        return repo.db.size_on_disk()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in (path, path.with_name("ckpt.db-wal")) if p.exists())


def size_of(unit: Path) -> int:
    return sum(p.stat().st_size for _, p in members(unit))


def clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def same_state(a: Any, b: Any) -> bool:
    """Deep equality with tensors compared bit for bit."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "tobytes"):
        return a.tobytes() == b.tobytes()
    return a == b or json.dumps(a, default=str) == json.dumps(b, default=str)


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as left, open(b, "rb") as right:
        while True:
            block = left.read(1 << 20)
            if block != right.read(1 << 20):
                return False
            if not block:
                return True


def same_unit(original: Path, restored: Path) -> bool:
    """True when every member of `restored` holds the same state as in `original`.

    A member with the same bytes holds the same state without loading it (ckptstore writes files
    back byte for byte; loading both of a 271 MB pair with torch took 0.73-0.80 s, comparing 0.11 s).
    """
    mine = dict(members(original))
    theirs = dict(members(restored))
    if set(mine) != set(theirs):
        return False
    return all(same_bytes(path, theirs[name])
               or same_state(load_member(kind_of(name, path), path), load_member(kind_of(name, path), theirs[name]))
               for name, path in mine.items())
