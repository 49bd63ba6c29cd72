"""`python -m bench.commit_speed [RUN] [--repeats N]`: ckptstore's lossless commit against ZipNN's path,
alone and side by side, file by file, repeated; prints each checkpoint's speed ratio.

The full suite interleaves nine methods whose output crowds the page cache; this isolates the two
that the core store's acceptance compares.
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
from bench.methods import Ckptstore, ZipNNPerTensor
from bench.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", nargs="?", default="minilm-finetune", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    workload = WORKLOADS[args.run]()
    files = workload.files()
    print("| repeat | ZipNN time / ckptstore time, per checkpoint | median | min |")
    print("|---|---|---|---|")
    for repeat in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="ckpt-speed-"))
        try:
            ours, zipnn = Ckptstore(), ZipNNPerTensor()
            ours.start(work / "ckptstore", workload)
            zipnn.start(work / "zipnn", workload)
            ratios = []
            for path in files:
                warm(path)
                start = time.perf_counter()
                zipnn.commit(path)
                zipnn_s = time.perf_counter() - start
                warm(path)
                start = time.perf_counter()
                ours.commit(path)
                ratios.append(zipnn_s / (time.perf_counter() - start))
            ours.finish()
            print(f"| {repeat + 1} | {', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} | "
                  f"{min(ratios):.2f} |", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
