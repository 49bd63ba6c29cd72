"""Each storage method measured on one checkpoint sequence: stored bytes and commit time."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zstandard


@dataclass
class Result:
    method: str
    stored: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.stored)


def _fsync_write(path: Path, parts) -> None:
    with open(path, "wb") as handle:
        for part in parts:
            handle.write(part)
        handle.flush()
        os.fsync(handle.fileno())


def _warm(path: Path) -> None:
    """Read the file once so every method starts from the page cache."""
    with open(path, "rb") as handle:
        while handle.read(1 << 24):
            pass


def run_ckptstore(files: list[Path], workdir: Path) -> Result:
    from ckptstore import Repository

    result = Result("ckptstore lossless")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    with Repository.init(workdir) as repo:
        for path in files:
            _warm(path)
            start = time.perf_counter()
            cid = repo.commit(path, message=path.name)
            result.seconds.append(time.perf_counter() - start)
            result.stored.append(repo.commit_info(cid).stored_bytes)
        on_disk = sum(repo.store.size(o) for o in repo.store.iter_ids())
    assert abs(on_disk - result.total) < 0.01 * on_disk + 65536, (on_disk, result.total)
    return result


ZIPNN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def run_zipnn(files: list[Path], workdir: Path) -> Result:
    """torch.load, ZipNN per float tensor (zstd-3 for the rest), write and fsync one file per checkpoint."""
    import zipnn

    result = Result("ZipNN per tensor")
    workdir.mkdir(parents=True, exist_ok=True)
    coders = {d: zipnn.ZipNN(input_format="byte", bytearray_dtype=n, threads=2) for d, n in ZIPNN_DTYPES.items()}
    fallback = zstandard.ZstdCompressor(level=3)
    for path in files:
        _warm(path)
        start = time.perf_counter()
        tensors = []
        _collect(torch.load(path, map_location="cpu", weights_only=True), tensors)
        parts = []
        for tensor in tensors:
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # ZipNN mutates its input
            coder = coders.get(tensor.dtype)
            parts.append(coder.compress(raw) if coder and len(raw) >= 64 else fallback.compress(raw))
        _fsync_write(workdir / path.name, parts)
        result.seconds.append(time.perf_counter() - start)
        result.stored.append(sum(len(p) for p in parts))
    return result


def _collect(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _collect(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, out)


def run_zstd_file(files: list[Path], workdir: Path) -> Result:
    result = Result("zstd-3 of each file")
    workdir.mkdir(parents=True, exist_ok=True)
    compressor = zstandard.ZstdCompressor(level=3, threads=2)
    for path in files:
        _warm(path)
        start = time.perf_counter()
        data = compressor.compress(path.read_bytes())
        _fsync_write(workdir / (path.name + ".zst"), [data])
        result.seconds.append(time.perf_counter() - start)
        result.stored.append(len(data))
    return result


def run_torch_save(files: list[Path], workdir: Path) -> Result:
    """The baseline: the checkpoint files themselves; time is a torch.load + torch.save copy."""
    result = Result("torch.save")
    workdir.mkdir(parents=True, exist_ok=True)
    for path in files:
        _warm(path)
        start = time.perf_counter()
        state = torch.load(path, map_location="cpu", weights_only=True)
        with open(workdir / path.name, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        result.seconds.append(time.perf_counter() - start)
        result.stored.append(path.stat().st_size)
    return result


METHODS = [run_torch_save, run_zstd_file, run_zipnn, run_ckptstore]


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
