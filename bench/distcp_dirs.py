"""`python -m bench.distcp_dirs [--width N] [--saves N]`: DCP directories in and out of a repository.

A training run saves with DCP's own `FileSystemWriter` (what torchtitan writes) every 5 steps;
each directory is committed with `repo.commit(DIR)` (what `ckpt commit DIR` does), and the last
commit is checked out as a DCP directory. Reported in one run, as ratios: the directories'
bytes against the bytes stored, commit time against the `dcp.save` that wrote the directory,
checkout time against that save, and `dcp.load` from the checkout against `dcp.load` from the
original directory (medians over the saves or rounds; one process, no process group).

The workload: an MLP of four width x width layers trained with AdamW (lr 1e-4, fine-tune-like).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from bench.units import metadata_on_disk
from ckptstore import Repository


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _timed(call, *args, **kwargs) -> float:
    start = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - start


def _state(model, optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    save_s, commit_s, on_disk = [], [], 0
    with tempfile.TemporaryDirectory() as folder, Repository.init(Path(folder) / "repo") as repo:
        base = Path(folder)
        for n in range(args.saves):
            for _ in range(5):
                model(torch.randn(32, args.width)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            writer = dcp.FileSystemWriter(str(base / f"s{n}"))
            save_s.append(_timed(dcp.save, _state(model, optimizer), storage_writer=writer))
            on_disk += _size(base / f"s{n}")
            commit_s.append(_timed(repo.commit, base / f"s{n}", f"save {n}"))
        stored = sum(c.stored_bytes for c in repo.log()) + metadata_on_disk(repo)
        checkout_s = _timed(repo.checkout_to, "main", base / "out")
        loads = {"original": [], "checkout": []}
        for _ in range(3):  # alternated, so drift hits both alike
            for name, where in (("original", base / f"s{args.saves - 1}"), ("checkout", base / "out")):
                loads[name].append(_timed(dcp.load, _state(model, optimizer), checkpoint_id=str(where)))
    save, commit = statistics.median(save_s), statistics.median(commit_s)
    load_o, load_c = statistics.median(loads["original"]), statistics.median(loads["checkout"])
    print("| measure | FileSystemWriter | ckptstore | ratio |")
    print("|---|---|---|---|")
    print(f"| bytes of {args.saves} saves | {on_disk / 2**20:.1f} MiB | {stored / 2**20:.1f} MiB stored "
          f"| {on_disk / stored:.2f}x smaller |")
    print(f"| per save: dcp.save / ckpt commit DIR (median s) | {save:.3f} | {commit:.3f} | {commit / save:.2f} |")
    print(f"| last save: dcp.save / ckpt checkout -o DIR (s) | {save_s[-1]:.3f} | {checkout_s:.3f} "
          f"| {checkout_s / save_s[-1]:.2f} |")
    print(f"| dcp.load from the directory (median s) | {load_o:.3f} | {load_c:.3f} | {load_c / load_o:.2f} |")


if __name__ == "__main__":
    main()
