"""`python -m bench.commit_speed [RUN] [--repeats N]`: ckptstore's lossless commit against ZipNN's path,
alone and side by side, file by file, repeated; prints each checkpoint's speed ratio.

The full suite interleaves nine methods whose output crowds the page cache; this isolates the two
that the core store's acceptance compares. Besides wall time it compares the CPU time each
commit used (all threads of the process): on a machine shared with other jobs, waiting for a core
or for someone else's writes to reach the disk moves the wall-time ratio by 2x from run to run,
while the CPU time of the same work barely moves.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.__main__ import warm
from bench.memory import cpu_seconds
from bench.methods import Ckptstore, ZipNNPerTensor
from bench.workloads import WORKLOADS


def timed(commit, path: Path) -> tuple[float, float]:
    """Wall and CPU seconds of `commit(path)`, from the page cache."""
    warm(path)
    start, cpu = time.perf_counter(), cpu_seconds()
    commit(path)
    return time.perf_counter() - start, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", nargs="?", default="minilm-finetune", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    workload = WORKLOADS[args.run]()
    files = workload.files()
    print("| repeat | ZipNN time / ckptstore time, per checkpoint | median | min | CPU time ratio, per checkpoint | "
          "median |")
    print("|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="ckpt-speed-"))
        try:
            ours, zipnn = Ckptstore(), ZipNNPerTensor()
            ours.start(work / "ckptstore", workload)
            zipnn.start(work / "zipnn", workload)
            ratios, cpu_ratios = [], []
            for path in files:
                zipnn_s, zipnn_cpu = timed(zipnn.commit, path)
                ours_s, ours_cpu = timed(ours.commit, path)
                ratios.append(zipnn_s / ours_s)
                cpu_ratios.append(zipnn_cpu / ours_cpu)
            ours.finish()
            print(f"| {repeat + 1} | {', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} | "
                  f"{min(ratios):.2f} | {', '.join(f'{r:.2f}' for r in cpu_ratios)} | "
                  f"{statistics.median(cpu_ratios):.2f} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
