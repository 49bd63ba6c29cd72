"""`python -m bench [--quick] [--only RUN]`: every method on every run, one table, same machine, same run.

Ratios are against the torch.save files; commit speed is MB of checkpoint file per second, end to
end from a file in the page cache to bytes fsynced on disk.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys

import torch

from bench.methods import METHODS, scratch_dir
from bench.runs import RUNS, checkpoint_files


def table(run_name: str, results, files) -> list[str]:
    raw = sum(f.stat().st_size for f in files)
    by_name = {r.method: r for r in results}
    zipnn = by_name["ZipNN per tensor"]
    lines = [f"### {run_name}: {RUNS[run_name][0].description}",
             f"{len(files)} checkpoints, {raw / 1e6:.1f} MB as torch.save files", "",
             "| method | stored MB | ratio vs torch.save | vs ZipNN | commit MB/s (median) | commit MB/s (slowest) | "
             "first commit MB | later commits MB (mean) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        speeds = sorted(f.stat().st_size / 1e6 / s for f, s in zip(files, r.seconds))
        later = r.stored[1:] or [0]
        mean_later = sum(later) / len(later) / 1e6
        median, slowest = speeds[len(speeds) // 2], speeds[0]
        lines.append(f"| {r.method} | {r.total / 1e6:.2f} | {raw / r.total:.2f}x | {zipnn.total / r.total:.2f}x | "
                     f"{median:.0f} | {slowest:.0f} | {r.stored[0] / 1e6:.2f} | {mean_later:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny runs (for the test suite)")
    parser.add_argument("--only", choices=sorted(RUNS), action="append", help="run only this case (repeatable)")
    args = parser.parse_args()
    header = [f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, Python "
              f"{platform.python_version()}, torch {torch.__version__}",
              f"Command: python -m bench {' '.join(sys.argv[1:])}"]
    print("\n".join(header))
    for name in args.only or list(RUNS):
        files = checkpoint_files(name, quick=args.quick)
        work = scratch_dir()
        try:
            results = [method(files, work / method.__name__) for method in METHODS]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("\n" + "\n".join(table(name, results, files)), flush=True)


if __name__ == "__main__":
    main()
