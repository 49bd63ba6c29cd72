"""Storage methods a user could pick, behind one interface so the runner can interleave them.

Each method takes checkpoint files one at a time (`commit`) and reports the bytes it newly stored;
the runner times each call, alternating methods file by file so machine noise hits all of them alike.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

import torch
import zstandard


class Method(Protocol):
    name: str

    def start(self, workdir: Path) -> None: ...

    def commit(self, path: Path) -> int: ...

    def finish(self) -> None: ...


def _fsync_write(path: Path, parts) -> None:
    with open(path, "wb") as handle:
        for part in parts:
            handle.write(part)
        handle.flush()
        os.fsync(handle.fileno())


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, out)
    return out


class Ckptstore:
    """`Repository.commit(path)`: load, hash, encode, write, fsync, one metadata transaction."""

    name = "ckptstore lossless"

    def start(self, workdir: Path) -> None:
        from ckptstore import Repository

        shutil.rmtree(workdir, ignore_errors=True)
        self.repo = Repository.init(workdir)

    def commit(self, path: Path) -> int:
        cid = self.repo.commit(path, message=path.name)
        return self.repo.commit_info(cid).stored_bytes

    def finish(self) -> None:
        self.repo.close()


class ZipNNPerTensor:
    """torch.load, ZipNN per float tensor (threads=2; zstd-3 for the rest), one file written and fsynced."""

    name = "ZipNN per tensor"
    DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def start(self, workdir: Path) -> None:
        import zipnn

        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.coders = {dtype: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=2)
                       for dtype, name in self.DTYPES.items()}
        self.fallback = zstandard.ZstdCompressor(level=3)

    def commit(self, path: Path) -> int:
        parts = []
        for tensor in _tensors(torch.load(path, map_location="cpu", weights_only=True), []):
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # ZipNN overwrites its input
            coder = self.coders.get(tensor.dtype)
            parts.append(coder.compress(raw) if coder and len(raw) >= 64 else self.fallback.compress(raw))
        _fsync_write(self.workdir / path.name, parts)
        return sum(len(p) for p in parts)

    def finish(self) -> None:
        pass


class ZstdFile:
    """zstd level 3 (2 threads) of the whole checkpoint file, written and fsynced."""

    name = "zstd-3 of each file"

    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.compressor = zstandard.ZstdCompressor(level=3, threads=2)

    def commit(self, path: Path) -> int:
        data = self.compressor.compress(path.read_bytes())
        _fsync_write(self.workdir / (path.name + ".zst"), [data])
        return len(data)

    def finish(self) -> None:
        pass


class TorchSave:
    """The baseline: keeping the files; time is a torch.load + torch.save copy, fsynced."""

    name = "torch.save"

    def start(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)

    def commit(self, path: Path) -> int:
        state = torch.load(path, map_location="cpu", weights_only=True)
        with open(self.workdir / path.name, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        return path.stat().st_size

    def finish(self) -> None:
        pass


METHODS = [TorchSave, ZstdFile, ZipNNPerTensor, Ckptstore]
