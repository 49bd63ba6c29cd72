"""`python -m bench.checkout_speed [RUN] [--repeats N] [--out FILE]`: restoring one checkpoint into
memory, side by side: torch.load and safetensors loading of the same tensors from the page cache,
against ckptstore checkout of a lossless commit at the end of a `max_chain`-long chain, on the CPU
and, where CUDA is present, straight to the GPU (torch.load + `.cuda()`, safetensors with
device="cuda", `checkout(device="cuda")`). Prints a table (GB/s of restored state, best of the
repeats, and peak extra anonymous memory over the restored size) and writes it to FILE too.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.__main__ import warm
from bench.memory import PeakMemory
from bench.workloads import WORKLOADS
from ckptstore import Repository
from ckptstore.state import flatten, materialize


def _size(state) -> int:
    return sum(r.nbytes for r in flatten(state).tensors.values())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(name: str, load: Callable[[], object], source: Path, repeats: int, device: str) -> dict:
    best, peak = float("inf"), 0
    for _ in range(repeats):
        warm(source)
        gc.collect()
        with PeakMemory() as memory:
            start = time.perf_counter()
            state = load()
            _sync(device)
            seconds = time.perf_counter() - start
        best, peak = min(best, seconds), max(peak, memory.extra)
        size = _size(state)
        del state
    return {"method": name, "device": device, "seconds": best, "gbps": size / best / 1e9, "memory": peak / size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", nargs="?", default="minilm-finetune", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    files = WORKLOADS[args.run]().files()
    work = Path(tempfile.mkdtemp(prefix="ckpt-checkout-"))
    try:
        repo = Repository.init(work / "repo")
        depth = repo.config.encoding.max_chain
        cids = [repo.commit(path) for path in files[: depth + 1]]
        source = files[depth]
        state = torch.load(source, weights_only=True)
        tensors = {p: materialize(r) for p, r in flatten(state).tensors.items() if r.dtype.startswith("torch.")}
        from safetensors.torch import load_file, save_file

        safetensors_path = work / "same.safetensors"
        save_file({p: t.contiguous() for p, t in tensors.items()}, safetensors_path)
        del state, tensors
        cases = [
            ("torch.load", lambda: torch.load(source, weights_only=True), source, "cpu"),
            ("safetensors load_file", lambda: load_file(safetensors_path), safetensors_path, "cpu"),
            ("ckptstore checkout", lambda: repo.checkout(cids[-1]), source, "cpu"),
        ]
        if torch.cuda.is_available():
            cases += [
                ("torch.load + .cuda()", lambda: _to_cuda(torch.load(source, weights_only=True)), source, "cuda"),
                ("safetensors load_file(device='cuda')", lambda: load_file(safetensors_path, device="cuda"),
                 safetensors_path, "cuda"),
                ("ckptstore checkout(device='cuda')", lambda: repo.checkout(cids[-1], device="cuda"), source, "cuda"),
            ]
        rows = [_measure(name, load, path, args.repeats, device) for name, load, path, device in cases]
        repo.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"{args.run}, checkpoint {depth + 1} (chain depth {depth}), best of {args.repeats}; "
             f"CUDA: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", "",
             "| method | device | seconds | GB/s | peak extra memory / restored size |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['device']} | {r['seconds']:.3f} | {r['gbps']:.2f} | {r['memory']:.2f}x |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def _to_cuda(value):
    if torch.is_tensor(value):
        return value.cuda()
    if isinstance(value, dict):
        return {k: _to_cuda(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cuda(v) for v in value)
    return value


if __name__ == "__main__":
    main()
