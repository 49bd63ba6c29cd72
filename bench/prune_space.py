"""Bytes before and after `ckpt prune` on a small training run, lossless and lossy.

`python -m bench.prune_space [--commits 12] [--every 10] [--dim 128] [--layers 2]` trains the
scratch GPT of bench/workloads.py, commits its state every `--every` steps into a fresh
repository per setting (level, max_chain), then prunes with keep-last 3 + keep-every 4 and prints
a markdown table: object bytes before and after, commits removed, tensors re-encoded, and the
prune's time as a multiple of one commit's (both measured in the same run). Every kept commit is
checked to restore bit for bit as before the prune.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.workloads import ScratchLM
from ckptstore import Repository
from ckptstore.policy import EncodingSettings
from ckptstore.repo import RetentionPolicy, fsck, prune

POLICY = RetentionPolicy(keep_last=3, keep_every=4)


def _states(commits: int, every: int, dim: int, layers: int) -> list[dict]:
    run = ScratchLM()
    run.dim, run.layers, run.checkpoints, run.every = dim, layers, commits, every
    state, saved = run.build(), []
    for _ in range(commits):
        run.train_steps(state, every)
        saved.append({"model": {k: v.clone() for k, v in state.model.state_dict().items()},
                      "optimizer": _clone(state.optimizer.state_dict()), "step": state.step})
    return saved


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_a, flat_b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def measure(states: list[dict], level: str | None, max_chain: int) -> dict:
    """One setting: commit every state into a fresh repository, prune, check the kept commits."""
    with tempfile.TemporaryDirectory() as folder, \
            Repository.init(Path(folder), encoding=EncodingSettings(max_chain=max_chain)) as repo:
        start = time.perf_counter()
        cids = [repo.commit(s, step=s["step"], lossy=level) for s in states]
        commit_s = (time.perf_counter() - start) / len(cids)
        before = {c: repo.checkout(c) for c in cids}
        start = time.perf_counter()
        report = prune(repo, POLICY)
        prune_s = time.perf_counter() - start
        pruned = set(report.pruned)
        exact = all(_same(before[c], repo.checkout(c)) for c in cids if c not in pruned)
        clean = fsck(repo, full=True).ok
    return {"level": level or "lossless", "max_chain": max_chain, "before": report.bytes_before,
            "after": report.bytes_after, "pruned": len(pruned), "kept": len(cids) - len(pruned),
            "reencoded": report.tensors_reencoded, "prune_vs_commit": prune_s / commit_s,
            "exact": exact and clean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=12)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    states = _states(args.commits, args.every, args.dim, args.layers)
    print("| level | max_chain | objects before | after | after/before | commits removed | tensors re-encoded "
          "| prune time / one commit | kept commits bit-exact, fsck --full clean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for level, max_chain in ((None, 2), (None, 6), ("balanced", 2), ("balanced", 6)):
        row = measure(states, level, max_chain)
        print(f"| {row['level']} | {row['max_chain']} | {row['before'] / 2**20:.2f} MiB "
              f"| {row['after'] / 2**20:.2f} MiB "
              f"| {row['after'] / row['before']:.2f} | {row['pruned']} of {row['pruned'] + row['kept']} "
              f"| {row['reencoded']} | {row['prune_vs_commit']:.1f}x | {'yes' if row['exact'] else 'NO'} |")


if __name__ == "__main__":
    main()
