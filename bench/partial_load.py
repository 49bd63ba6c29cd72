"""`python -m bench.partial_load [--width N] [--commits N] [--repeats N]`: a weights-only load
(`ckptstore.load(ref, keys=["model.*"])`) against a full load of the same commit, lossless and
`balanced`: object bytes read from the store and wall time (median of alternated rounds, warm
page cache), as ratios measured in the same run.

The workload: an MLP of four width x width layers trained with AdamW, one commit every 5 steps,
so the last commit sits at the end of a delta chain.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckptstore
from ckptstore import Repository


class _Counting:
    """The repository's store, adding up the bytes of every object or range read."""

    def __init__(self, inner) -> None:
        self.inner, self.read = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, oid, verify=True):
        data = self.inner.get(oid, verify)
        self.read += len(data)
        return data

    def view(self, oid, verify=True):
        data = self.inner.view(oid, verify)
        self.read += len(data)
        return data

    def open_ranges(self):
        outer, ranges = self, self.inner.open_ranges()

        class Ranges:
            def read(self, oid, offset, length, into=None):
                outer.read += length
                return ranges.read(oid, offset, length, into)

            def close(self):
                ranges.close()

        return Ranges()


def _commits(repo: Repository, width: int, commits: int, lossy: str | None) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cid = ""
    for _ in range(commits):
        for _ in range(5):
            model(torch.randn(32, width)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        cid = repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, lossy=lossy,
                          model=model, optimizer=optimizer)
    return cid


def _measure(repo: Repository, cid: str, keys, repeats: int) -> tuple[int, list[float]]:
    counting = _Counting(repo.store)
    repo.store = counting
    times = []
    try:
        for _ in range(repeats):
            counting.read = 0
            start = time.perf_counter()
            ckptstore.load(cid, repo=repo, keys=keys)
            times.append(time.perf_counter() - start)
    finally:
        repo.store = counting.inner
    return counting.read, times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--commits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| commit | bytes read: weights / full | ratio | time: weights / full (median s) | ratio |")
    print("|---|---|---|---|---|")
    for lossy in (None, "balanced"):
        with tempfile.TemporaryDirectory() as folder, Repository.init(Path(folder)) as repo:
            cid = _commits(repo, args.width, args.commits, lossy)
            part_times, full_times = [], []
            for _ in range(args.repeats):  # alternated, so drift hits both alike
                part, times = _measure(repo, cid, ["model.*"], 1)
                part_times += times
                full, times = _measure(repo, cid, None, 1)
                full_times += times
            p, f = statistics.median(part_times), statistics.median(full_times)
            print(f"| {lossy or 'lossless'} | {part / 2**20:.1f} / {full / 2**20:.1f} MiB | {part / full:.2f} "
                  f"| {p:.3f} / {f:.3f} | {p / f:.2f} |")


if __name__ == "__main__":
    main()
