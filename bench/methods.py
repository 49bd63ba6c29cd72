"""Storage methods a user could pick, behind one interface so the runner can interleave them.

`commit(unit)` stores a checkpoint (file or folder) and returns the bytes newly stored;
`checkout(i, dest)` writes the i-th stored checkpoint back to `dest`. The runner times both,
alternating methods file by file so machine noise hits all of them alike.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from bench.units import (
    clear,
    copy_durably,
    destination,
    fsync_file,
    fsync_write,
    kind_of,
    load_member,
    members,
    metadata_on_disk,
    write_member,
)
from ckptstore.state import RawTensor, flatten, materialize, raw_from_bytes, unflatten


class Method:
    name = ""
    lossy = False

    def start(self, workdir: Path, workload) -> None:
        self.workdir = workdir
        self.workload = workload
        self.stored: list[Path] = []
        workdir.mkdir(parents=True, exist_ok=True)

    def commit(self, unit: Path) -> int:
        raise NotImplementedError

    def checkout(self, index: int, dest: Path) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class TorchSave(Method):
    """The baseline: torch.load + torch.save of every file into the store, and back."""

    name = "torch.save"

    def _copy(self, unit: Path, dest: Path) -> int:
        clear(dest)
        for name, path in members(unit):
            target = destination(dest, name)
            kind = kind_of(name, path)
            if kind == "torch":
                write_member(kind, load_member(kind, path), target)
            else:
                copy_durably(path, target)
        return sum(p.stat().st_size for _, p in members(dest))

    def commit(self, unit: Path) -> int:
        dest = self.workdir / f"{len(self.stored):03d}{unit.suffix}"
        self.stored.append(dest)
        return self._copy(unit, dest)

    def checkout(self, index: int, dest: Path) -> None:
        self._copy(self.stored[index], dest)


class ZstdFile(Method):
    """zstd level 3 (2 threads) of every file."""

    name = "zstd-3 of each file"

    def start(self, workdir: Path, workload) -> None:
        super().start(workdir, workload)
        self.compressor = zstandard.ZstdCompressor(level=3, threads=2)

    def commit(self, unit: Path) -> int:
        folder = self.workdir / f"{len(self.stored):03d}"
        self.stored.append(folder)
        total = 0
        for i, (name, path) in enumerate(members(unit)):
            data = self.compressor.compress(path.read_bytes())
            target = folder / f"{i}.zst"
            target.parent.mkdir(parents=True, exist_ok=True)
            fsync_write(target, [data])
            (folder / f"{i}.name").write_text(name)
            total += len(data)
        return total

    def checkout(self, index: int, dest: Path) -> None:
        clear(dest)
        decompressor = zstandard.ZstdDecompressor()
        folder = self.stored[index]
        for part in sorted(folder.glob("*.zst"), key=lambda p: int(p.stem)):
            target = destination(dest, (folder / f"{part.stem}.name").read_text())
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(part, "rb") as src, open(target, "wb") as out:
                decompressor.copy_stream(src, out)
            fsync_file(target)


class TensorArchive(Method):
    """Each file's tensors encoded one by one, plus a JSON skeleton, in one archive file per checkpoint."""

    def encode(self, raw: np.ndarray, dtype: str) -> bytes:
        raise NotImplementedError

    def decode(self, blob: bytes, dtype: str, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def commit(self, unit: Path) -> int:
        header: dict[str, Any] = {"members": []}
        blobs: list[bytes] = []
        for name, path in members(unit):
            kind = kind_of(name, path)
            value = load_member(kind, path)
            flat = flatten(value) if kind != "bytes" else None
            tensors = flat.tensors if flat else {"": raw_from_bytes(value)}
            entries = {}
            for key, raw in tensors.items():
                blob = self.encode(raw.data, raw.dtype)
                entries[key] = [len(blobs), raw.dtype, list(raw.shape), raw.nbytes]
                blobs.append(blob)
            header["members"].append({"name": name, "kind": kind, "skeleton": flat.skeleton if flat else None,
                                      "entries": entries})
        header["sizes"] = [len(b) for b in blobs]
        head = json.dumps(header).encode()
        target = self.workdir / f"{len(self.stored):03d}.archive"
        self.stored.append(target)
        fsync_write(target, [struct.pack("<Q", len(head)), head, *blobs])
        return target.stat().st_size

    def checkout(self, index: int, dest: Path) -> None:
        clear(dest)
        data = self.stored[index].read_bytes()
        (length,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + length])
        offsets = np.cumsum([8 + length, *header["sizes"]]).tolist()
        for member in header["members"]:
            def value_of(key: str, entries=member["entries"]):
                position, dtype, shape, nbytes = entries[key]
                raw = self.decode(data[offsets[position] : offsets[position + 1]], dtype, nbytes)
                return materialize(RawTensor(dtype, tuple(shape), raw))

            value = value_of("") if member["kind"] == "bytes" else unflatten(member["skeleton"], value_of)
            write_member(member["kind"], value, destination(dest, member["name"]))


class ZipNNPerTensor(TensorArchive):
    """ZipNN per float tensor (threads=2; zstd-3 for the rest)."""

    name = "ZipNN per tensor"
    DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

    def start(self, workdir: Path, workload) -> None:
        import zipnn

        super().start(workdir, workload)
        self.coders = {dtype: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=2)
                       for dtype, name in self.DTYPES.items()}
        self.zstd = zstandard.ZstdCompressor(level=3)
        self.unzstd = zstandard.ZstdDecompressor()

    def encode(self, raw: np.ndarray, dtype: str) -> bytes:
        coder = self.coders.get(dtype)
        if coder is None or raw.size < 64:
            return b"z" + self.zstd.compress(raw)
        return b"n" + coder.compress(raw.tobytes())  # a copy: ZipNN overwrites its input

    def decode(self, blob: bytes, dtype: str, nbytes: int) -> np.ndarray:
        if blob[:1] == b"z":
            out = self.unzstd.decompress(blob[1:], max_output_size=nbytes)
        else:
            out = self.coders[dtype].decompress(blob[1:])
        return np.frombuffer(bytearray(out), dtype=np.uint8)


class SafetensorsFiles(Method):
    """Every tensor in one safetensors file per checkpoint, the rest as a JSON skeleton in its metadata."""

    name = "safetensors"

    def commit(self, unit: Path) -> int:
        from safetensors.torch import save_file

        folder = self.workdir / f"{len(self.stored):03d}"
        self.stored.append(folder)
        folder.mkdir(parents=True)
        for i, (name, path) in enumerate(members(unit)):
            kind = kind_of(name, path)
            if kind == "bytes":
                copy_durably(path, folder / f"{i}.bytes")
                (folder / f"{i}.name").write_text(name)
                continue
            flat = flatten(load_member(kind, path))
            tensors, other = {}, {}
            for key, raw in flat.tensors.items():
                if raw.dtype.startswith("torch."):
                    tensors[key] = materialize(raw)
                else:  # numpy arrays and bytes inside the state: kept as raw uint8 with their dtype
                    tensors[key] = torch.from_numpy(raw.data.copy())
                    other[key] = [raw.dtype, list(raw.shape)]
            save_file(tensors, folder / f"{i}.safetensors", metadata={
                "name": name, "kind": kind, "skeleton": json.dumps(flat.skeleton), "other": json.dumps(other)})
            fsync_file(folder / f"{i}.safetensors")
        return sum(p.stat().st_size for p in folder.iterdir())

    def checkout(self, index: int, dest: Path) -> None:
        from safetensors import safe_open

        clear(dest)
        folder = self.stored[index]
        for part in sorted(folder.iterdir()):
            if part.suffix == ".bytes":
                copy_durably(part, destination(dest, (folder / f"{part.stem}.name").read_text()))
            elif part.suffix == ".safetensors":
                with safe_open(part, framework="pt") as handle:
                    meta = handle.metadata()
                    tensors = {key: handle.get_tensor(key) for key in handle.keys()}
                for key, (dtype, shape) in json.loads(meta["other"]).items():
                    tensors[key] = materialize(RawTensor(dtype, tuple(shape), tensors[key].numpy()))
                value = unflatten(json.loads(meta["skeleton"]), tensors.__getitem__)
                write_member(meta["kind"], value, destination(dest, meta["name"]))


class Ckptstore(Method):
    """`Repository.commit(path)` and `Repository.checkout_to(commit, dest)`."""

    name = "ckptstore lossless"
    commit_options: dict[str, Any] = {}

    def start(self, workdir: Path, workload) -> None:
        from ckptstore import Repository

        super().start(workdir, workload)
        shutil.rmtree(workdir / "repo", ignore_errors=True)
        self.repo = Repository.init(workdir / "repo")
        self.commits: list[str] = []

    def commit(self, unit: Path) -> int:
        cid = self.repo.commit(unit, message=unit.name, **self.commit_options)
        self.commits.append(cid)
        return self.repo.commit_info(cid).stored_bytes

    def checkout(self, index: int, dest: Path) -> None:
        clear(dest)
        self.repo.checkout_to(self.commits[index], dest, force=True)

    def finish(self) -> None:
        self.metadata_bytes = metadata_on_disk(self.repo)
        self.repo.close()


def lossy_method(level: str) -> type[Ckptstore]:
    """ckptstore at a lossy level, as a method of its own."""
    return type(f"Ckptstore_{level}", (Ckptstore,), {"name": f"ckptstore {level}", "lossy": True,
                                                      "commit_options": {"lossy": level}})


def all_methods() -> list[type[Method]]:
    from bench.excp import ExCP

    lossy = [lossy_method(level) for level in ("optimizer", "balanced", "extreme")]
    return [TorchSave, ZstdFile, ZipNNPerTensor, SafetensorsFiles, Ckptstore, *lossy, ExCP]
