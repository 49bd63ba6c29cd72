"""`python -m bench.checkout_speed [RUN] [--repeats N] [--fresh N] [--out FILE]`: restoring one
checkpoint into memory, side by side: torch.load and safetensors loading of the same tensors from
the page cache, against ckptstore checkout of a lossless commit at the end of a `max_chain`-long
chain, on the CPU and, where CUDA is present, straight to the GPU (torch.load + `.cuda()`,
safetensors with device="cuda", `checkout(device="cuda")`).

Three measurements. Warm, in this process (allocator, threads and caches set up): the best and
the median of `--repeats` loads with the methods taking turns, so that the machine's drift hits
them alike, each load finding the memory the previous method freed; and the median of
`--repeats` loads of each method back to back, each finding what its own previous load freed (a
process that loads checkpoints again and again). Fresh: the median of `--fresh` loads each in a
process of its own, the methods taking turns (what a job restarting after a crash does), which
also gives each method's peak memory growth over the restored size.
Prints a table (seconds and GB/s of restored state) and writes it to FILE too.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.__main__ import warm
from bench.workloads import WORKLOADS
from ckptstore import Repository
from ckptstore.state import flatten, materialize


def _size(state) -> int:
    return sum(r.nbytes for r in flatten(state).tensors.values())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _high_water() -> int:
    """Peak resident memory of this process so far, bytes (Linux VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _timed(load: Callable[[], object], source: Path, device: str) -> tuple[float, int]:
    """Seconds of one load of `source` from the page cache, and the restored size in bytes."""
    warm(source)
    gc.collect()
    start = time.perf_counter()
    state = load()
    _sync(device)
    return time.perf_counter() - start, _size(state)


def _in_fresh_process(case: int, args: list[str]) -> tuple[float, float]:
    """(seconds, peak memory growth over the restored size) of one load in a process of its own.

    Allocators keep freed memory, so a second load in the same process would read low on both.
    """
    command = [sys.executable, "-m", "bench.checkout_speed", "--child", str(case), *args]
    seconds, growth = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()[-2:]
    return float(seconds), float(growth)


def _cases(repo, cid, source: Path, safetensors_path: Path) -> list[tuple]:
    from safetensors.torch import load_file

    cases = [
        ("torch.load", lambda: torch.load(source, weights_only=True), source, "cpu"),
        ("safetensors load_file", lambda: load_file(safetensors_path), safetensors_path, "cpu"),
        ("ckptstore checkout", lambda: repo.checkout(cid), source, "cpu"),
    ]
    if torch.cuda.is_available():
        cases += [
            ("torch.load + .cuda()", lambda: _to_cuda(torch.load(source, weights_only=True)), source, "cuda"),
            ("safetensors load_file(device='cuda')", lambda: load_file(safetensors_path, device="cuda"),
             safetensors_path, "cuda"),
            ("ckptstore checkout(device='cuda')", lambda: repo.checkout(cid, device="cuda"), source, "cuda"),
        ]
    return cases


def _child(case: int, repo_path: Path, cid: str, source: Path, safetensors_path: Path) -> None:
    torch.set_num_threads(2)
    with Repository.open(repo_path) as repo:
        name, load, path, device = _cases(repo, cid, source, safetensors_path)[case]
        warm(path)
        before = _high_water()
        seconds, size = _timed(load, path, device)
        print(seconds, (_high_water() - before) / size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", nargs="?", default="minilm-finetune", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fresh", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--paths", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        repo_path, cid, source, safetensors_path = args.paths
        _child(args.child, Path(repo_path), cid, Path(source), Path(safetensors_path))
        return
    torch.set_num_threads(2)
    files = WORKLOADS[args.run]().files()
    work = Path(tempfile.mkdtemp(prefix="ckpt-checkout-"))
    try:
        with Repository.init(work / "repo") as repo:
            depth = repo.config.encoding.max_chain
            cids = [repo.commit(path) for path in files[: depth + 1]]
        source = files[depth]
        state = torch.load(source, weights_only=True)
        tensors = {p: materialize(r) for p, r in flatten(state).tensors.items() if r.dtype.startswith("torch.")}
        from safetensors.torch import save_file

        safetensors_path = work / "same.safetensors"
        save_file({p: t.contiguous() for p, t in tensors.items()}, safetensors_path)
        del state, tensors
        with Repository.open(work / "repo") as repo:
            cases = _cases(repo, cids[-1], source, safetensors_path)
            rows = [{"method": name, "device": device, "warm": [], "steady": [], "fresh": [], "memory": 0.0}
                    for name, _, _, device in cases]
            for _ in range(args.repeats):
                for row, (_, load, path, device) in zip(rows, cases):
                    seconds, row["size"] = _timed(load, path, device)
                    row["warm"].append(seconds)
            for row, (_, load, path, device) in zip(rows, cases):
                row["steady"] = [_timed(load, path, device)[0] for _ in range(args.repeats)]
        child_args = ["--paths", str(work / "repo"), cids[-1], str(source), str(safetensors_path)]
        for _ in range(args.fresh):
            for case, row in enumerate(rows):
                seconds, growth = _in_fresh_process(case, child_args)
                row["fresh"].append(seconds)
                row["memory"] = max(row["memory"], growth)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"{args.run}, checkpoint {depth + 1} (chain depth {depth}); best of {args.repeats} in one process, "
             f"median of {args.fresh} fresh processes; "
             f"CUDA: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}", "",
             "| method | device | warm s, taking turns: best / median | warm GB/s, best "
             "| warm s, back to back: median | fresh s | fresh GB/s | peak memory growth / restored size |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        warm_s, warm_median, fresh_s = min(r["warm"]), statistics.median(r["warm"]), statistics.median(r["fresh"])
        lines.append(f"| {r['method']} | {r['device']} | {warm_s:.3f} / {warm_median:.3f} | "
                     f"{r['size'] / warm_s / 1e9:.2f} | {statistics.median(r['steady']):.3f} | {fresh_s:.3f} | "
                     f"{r['size'] / fresh_s / 1e9:.2f} | {r['memory']:.2f}x |")
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
