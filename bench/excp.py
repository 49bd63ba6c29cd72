"""A re-implementation of ExCP (Li et al., ICML 2024) from its published description, as a peer.

Per checkpoint after the first: the weight residual against the previous *reconstruction* (closed
loop) is pruned where small relative to Adam's second moment (per tensor:
thr = median(|dW|) * min(2.5, alpha / sqrt(mean(v))), alpha = 5e-5); the first moment is kept where
|m| > beta * mean(|m|) (beta = 2) and the weight residual survived, the second moment on the same mask;
pruned moments become zero. Each kept stream is quantized per tensor with a 4-bit k-means codebook
(15 centroids plus an exact zero), and the coded streams are archived with zstd level 19. The
first checkpoint is stored whole. Restoring checkpoint k replays k residuals, as ExCP does.

What ExCP keeps exactly (the first checkpoint, state other than Adam's moments) is float bytes,
archived at zstd level 3 instead: over whole runs, level 19 on that stream changed ExCP's total by
-0.01% (sgd-momentum), +0.08% (scratch-fp32) and +0.05% (trainer-gpt2) while taking 5.5x, 1.5x and
1.6x as long to commit, and the suite could not finish in its time budget otherwise.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from bench.methods import Method
from bench.units import clear, fsync_write, load_member, members, write_member
from ckptstore.state import torch_dtype

ALPHA, BETA, CENTROIDS = 5e-5, 2.0, 15


def kmeans_1d(values: np.ndarray, k: int = CENTROIDS, iterations: int = 8) -> np.ndarray:
    """Lloyd's algorithm in one dimension on (a sample of at most 2**18 of) the values, started
    from quantiles; returns sorted centroids."""
    if values.size == 0:
        return np.zeros(k, dtype=np.float32)
    sample = values if values.size <= 1 << 18 else values[:: values.size // (1 << 18) + 1]
    centroids = np.quantile(sample, (np.arange(k) + 0.5) / k).astype(np.float64)
    for _ in range(iterations):
        edges = (centroids[1:] + centroids[:-1]) / 2
        labels = np.searchsorted(edges, sample)
        sums = np.bincount(labels, weights=sample, minlength=k)
        counts = np.bincount(labels, minlength=k)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled]
        centroids.sort()
    return centroids.astype(np.float32)


def quantize(values: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """4-bit codes: 0 where `mask` is false, else 1 + the nearest of 15 centroids."""
    kept = values[mask].astype(np.float64)
    codebook = kmeans_1d(kept)
    codes = np.zeros(values.size, dtype=np.uint8)
    if kept.size:
        edges = (codebook[1:].astype(np.float64) + codebook[:-1]) / 2
        codes[mask] = 1 + np.searchsorted(edges, kept).astype(np.uint8)
    return codes, codebook


def dequantize(codes: np.ndarray, codebook: np.ndarray) -> np.ndarray:
    table = np.concatenate([[0.0], codebook]).astype(np.float32)
    return table[codes]


def pack4(codes: np.ndarray) -> bytes:
    padded = np.append(codes, 0) if codes.size % 2 else codes
    return (padded[0::2] | (padded[1::2] << 4)).astype(np.uint8).tobytes()


def unpack4(data: bytes, count: int) -> np.ndarray:
    packed = np.frombuffer(data, dtype=np.uint8)
    codes = np.empty(packed.size * 2, dtype=np.uint8)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    return codes[:count]


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class Unit:
    """A checkpoint split into model weights, optimizer state and everything else (stored exactly)."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, bytes] = {}
        if path.is_file():
            self.layout = "file"
            self.whole = load_member("torch", path)
            self.model = dict(self.whole["model"])
            self.optimizer = self.whole["optimizer"]
        else:
            self.layout = "folder"
            self.whole = None
            for name, member in members(path):
                if name == "model.safetensors":
                    self.model = load_member("safetensors", member)
                elif name == "optimizer.pt":
                    self.optimizer = load_member("torch", member)
                else:
                    self.files[name] = member.read_bytes()

    def rest(self) -> bytes:
        """Everything but weights and Adam moments, as torch.save bytes (never from the store's side)."""
        # ExCP is defined for Adam: other optimizer state (SGD's momentum) is kept exactly.
        optimizer = {"state": {i: {k: v for k, v in s.items() if k not in ("exp_avg", "exp_avg_sq")}
                               for i, s in self.optimizer["state"].items()},
                     "param_groups": self.optimizer["param_groups"]}
        if self.layout == "file":
            outer = {k: v for k, v in self.whole.items() if k not in ("model", "optimizer")}
            return _torch_bytes({"layout": "file", "outer": outer, "optimizer": optimizer,
                                 "model_keys": list(self.model)})
        return _torch_bytes({"layout": "folder", "files": self.files, "optimizer": optimizer,
                             "model_keys": list(self.model)})


def assemble(rest: dict, model: dict[str, torch.Tensor], moments: dict[int, dict[str, torch.Tensor]], dest: Path):
    optimizer = rest["optimizer"]
    for index, tensors in moments.items():
        optimizer["state"].setdefault(index, {}).update(tensors)
    ordered = {k: model[k] for k in rest["model_keys"]}
    clear(dest)
    if rest["layout"] == "file":
        write_member("torch", dict(rest["outer"], model=ordered, optimizer=optimizer), dest)
        return
    write_member("safetensors", ordered, dest / "model.safetensors")
    write_member("torch", optimizer, dest / "optimizer.pt")
    for name, data in rest["files"].items():
        write_member("bytes", data, dest / name)


def _frame(parts: list[bytes]) -> bytes:
    return struct.pack("<I", len(parts)) + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unframe(blob: bytes, offset: int) -> tuple[list[bytes], int]:
    (count,) = struct.unpack_from("<I", blob, offset)
    offset += 4
    parts = []
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", blob, offset)
        parts.append(blob[offset + 8 : offset + 8 + length])
        offset += 8 + length
    return parts, offset


class ExCP(Method):
    """ExCP as published, on the benchmark's runs (weights-to-moments mapping from the model itself)."""

    name = "ExCP (re-implementation)"
    lossy = True

    def start(self, workdir: Path, workload) -> None:
        super().start(workdir, workload)
        self.index_of = {name: i for i, name in enumerate(workload.optimizer_param_names())}
        self.previous: dict[str, np.ndarray] | None = None
        self.coded_compressor = zstandard.ZstdCompressor(level=19, threads=2)
        self.exact_compressor = zstandard.ZstdCompressor(level=3, threads=2)

    def _encode_tensor(self, name: str, tensor: torch.Tensor, state: dict) -> tuple[list[bytes], np.ndarray | None]:
        """Frames for one weight tensor (and its Adam moments), and its reconstruction."""
        moments = {k: v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")}
        if not tensor.is_floating_point() or self.previous is None or name not in self.previous:
            exact = tensor.float().numpy().copy() if tensor.is_floating_point() else None
            return [b"E", _torch_bytes({"w": tensor, **moments})], exact
        delta = tensor.float().numpy().reshape(-1) - self.previous[name]
        v = moments["exp_avg_sq"].float().numpy().reshape(-1) if "exp_avg_sq" in moments else None
        scale = 2.5 if v is None or v.mean() <= 0 else min(2.5, ALPHA / float(np.sqrt(v.mean())))
        mask_w = np.abs(delta) > np.median(np.abs(delta)) * scale
        codes, codebook = quantize(delta, mask_w)
        restored = torch.from_numpy(self.previous[name] + dequantize(codes, codebook)).to(tensor.dtype)
        moment_dtype = str(moments["exp_avg"].dtype) if "exp_avg" in moments else ""
        meta = json.dumps({"dtype": str(tensor.dtype), "shape": list(tensor.shape), "moments": moment_dtype})
        frames = [b"Q", meta.encode(), codebook.tobytes(), pack4(codes)]
        if "exp_avg" in moments:
            m = moments["exp_avg"].float().numpy().reshape(-1)
            mask_m = (np.abs(m) > BETA * np.abs(m).mean()) & mask_w
            for moment in (m, v):
                codes, codebook = quantize(moment, mask_m)
                frames += [codebook.tobytes(), pack4(codes)]
        return frames, restored.float().numpy()

    def commit(self, unit: Path) -> int:
        split = Unit(unit)
        exact, coded, kinds = [], [], b""
        reconstruction = {}
        for name, tensor in split.model.items():
            state = split.optimizer["state"].get(self.index_of.get(name, -1), {})
            frames, restored = self._encode_tensor(name, tensor, state)
            (exact if frames[0] == b"E" else coded).append(_frame(frames))
            kinds += frames[0]
            if restored is not None:
                reconstruction[name] = restored.reshape(-1)
        self.previous = reconstruction
        exact.insert(0, _frame([split.rest(), kinds]))
        streams = [self.exact_compressor.compress(b"".join(exact)), self.coded_compressor.compress(b"".join(coded))]
        compressed = struct.pack("<Q", len(streams[0])) + b"".join(streams)
        target = self.workdir / f"{len(self.stored):03d}.excp"
        self.stored.append(target)
        fsync_write(target, [compressed])
        return len(compressed)

    def checkout(self, index: int, dest: Path) -> None:
        previous: dict[str, np.ndarray] = {}
        for position in range(index + 1):  # no keyframes: restoring step k replays k residuals
            previous, model, moments, rest = self._replay(self.stored[position], previous)
        assemble(rest, model, moments, dest)

    def _replay(self, path: Path, previous: dict[str, np.ndarray]):
        archive = path.read_bytes()
        (split,) = struct.unpack_from("<Q", archive)
        unzstd = zstandard.ZstdDecompressor()
        parts = {b"E": unzstd.decompressobj().decompress(archive[8 : 8 + split]),
                 b"Q": unzstd.decompressobj().decompress(archive[8 + split :])}
        offsets = {b"E": 0, b"Q": 0}
        (rest_bytes, kinds), offsets[b"E"] = _unframe(parts[b"E"], 0)
        rest = torch.load(io.BytesIO(rest_bytes), weights_only=True)
        model, moments, reconstruction = {}, {}, {}
        for position, name in enumerate(rest["model_keys"]):
            kind = kinds[position : position + 1]
            frames, offsets[kind] = _unframe(parts[kind], offsets[kind])
            state_index = self.index_of.get(name, -1)
            if frames[0] == b"E":
                saved = torch.load(io.BytesIO(frames[1]), weights_only=True)
                model[name] = saved.pop("w")
                if saved:
                    moments[state_index] = saved
            else:
                meta = json.loads(frames[1])
                shape, count = meta["shape"], int(np.prod(meta["shape"]))
                streams = [dequantize(unpack4(frames[i + 1], count), np.frombuffer(frames[i], dtype=np.float32))
                           for i in range(2, len(frames), 2)]
                weights = torch.from_numpy(previous[name] + streams[0])
                model[name] = weights.to(torch_dtype(meta["dtype"])).reshape(shape)
                if len(streams) == 3:
                    moment_dtype = torch_dtype(meta["moments"])
                    moments[state_index] = {"exp_avg": torch.from_numpy(streams[1]).to(moment_dtype).reshape(shape),
                                            "exp_avg_sq": torch.from_numpy(streams[2]).to(moment_dtype).reshape(shape)}
            if model[name].is_floating_point():
                reconstruction[name] = model[name].float().numpy().reshape(-1)
        return reconstruction, model, moments, rest
