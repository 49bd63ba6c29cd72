"""`python -m bench.chain_sweep`: how the lossless chain length trades stored bytes against checkout speed.

Commits a MiniLM fine-tune the suite never saw (`minilm-unseen`: another seed, other stdlib packages,
9 checkpoints; `--run NAME`: another run of bench/workloads.py) under `max_chain` "auto" and fixed
1/2/4/8, against ZipNN per tensor. Every commit is
then checked out into memory and timed against torch.load of the same file (both from the page cache,
best of `--repeats`, taking turns), so the table shows the slowest commit of each chain.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.units import metadata_on_disk
from bench.workloads import WORKLOADS, MiniLMFineTune, stdlib_lines
from ckptstore import Repository
from ckptstore.policy import EncodingSettings, chain_limit
from ckptstore.repo.chaincost import _best_in_turns, chain_costs


class MiniLMUnseen(MiniLMFineTune):
    """The MiniLM fine-tune with data and a seed no preset or constant was tuned on."""

    name = "minilm-unseen"
    description = "all-MiniLM-L6-v2 fine-tune (json vs http lines), seed 1, AdamW lr 5e-5, fp32, 9 checkpoints"
    seed = 1
    checkpoints = 9

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        if quick:
            self.checkpoints = 9
        examples = [(t, 0) for t in stdlib_lines("json")] + [(t, 1) for t in stdlib_lines("http")]
        random.Random(2).shuffle(examples)
        cut = int(len(examples) * 0.9)
        self.examples = {"train": examples[:cut], "eval": examples[cut:]}


def _wall(call: Callable[[], object]) -> Callable[[], float]:
    """A function that runs `call` once and returns the wall-clock seconds it took: what a user waits."""
    def run() -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    return run


def zipnn_bytes(files: list[Path]) -> int:
    """ZipNN per tensor, as the suite measures it (bench/methods.py)."""
    from bench.methods import ZipNNPerTensor

    work = Path(tempfile.mkdtemp(prefix="ckpt-sweep-zipnn-"))
    try:
        method = ZipNNPerTensor()
        method.start(work, None)
        total = sum(method.commit(path) for path in files)
        method.finish()
        return total
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sweep(files: list[Path], max_chain: int | str, repeats: int) -> dict:
    """Stored bytes, depths and the checkout / torch.load time ratio of every commit."""
    work = Path(tempfile.mkdtemp(prefix="ckpt-sweep-"))
    try:
        with Repository.init(work, encoding=EncodingSettings(max_chain=max_chain)) as repo:
            commits, stored = [], 0
            for path in files:
                cid = repo.commit(path)
                commits.append(cid)
                stored += repo.commit_info(cid).stored_bytes
            stored += metadata_on_disk(repo)
            ratios, depths = [], []
            for path, cid in zip(files, commits):
                depths.append(max(t["depth"] for t in repo.show(cid)["tensors"]))
                # taking turns, so that the machine's load hits both alike
                load, checkout = _best_in_turns(
                    _wall(lambda p=path: torch.load(p, map_location="cpu", weights_only=True)),
                    _wall(lambda c=cid: repo.checkout(c)), repeats=repeats)
                ratios.append(load / checkout)
        return {"stored": stored, "ratios": ratios, "depths": depths}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke test)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chains", default="auto,1,2,4,8")
    parser.add_argument("--run", help="a bench/workloads.py run instead (e.g. minilm-finetune)")
    parser.add_argument("--files", type=int, default=0, help="only the first N checkpoints (0: all)")
    args = parser.parse_args()
    files = (WORKLOADS[args.run] if args.run else MiniLMUnseen)(quick=args.quick).files()[: args.files or None]
    raw = sum(f.stat().st_size for f in files)
    costs = chain_costs()
    print("measured costs (ns/byte, keyframe / level / torch.load): "
          + ", ".join(f"width {w}: {c.keyframe * 1e9:.3f} / {c.level * 1e9:.3f} / {c.load * 1e9:.3f}"
                      for w, c in sorted(costs.items()))
          + f"; auto limit fp32 {chain_limit('auto', 4, costs)}, bf16 {chain_limit('auto', 2, costs)}")
    zipnn = zipnn_bytes(files)
    print(f"{len(files)} checkpoints, {raw / 1e6:.1f} MB; ZipNN per tensor {zipnn / 1e6:.1f} MB "
          f"({raw / zipnn:.2f}x)\n")
    print("| max_chain | deepest | stored MB | vs torch.save | vs ZipNN | checkout speed / torch.load, "
          "each commit | slowest |")
    print("|---|---|---|---|---|---|---|")
    for chain in args.chains.split(","):
        row = sweep(files, chain, args.repeats)
        print(f"| {chain} | {max(row['depths'])} | {row['stored'] / 1e6:.1f} | {raw / row['stored']:.2f}x | "
              f"{zipnn / row['stored']:.2f}x | {' '.join(f'{r:.2f}' for r in row['ratios'])} | "
              f"{min(row['ratios']):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
