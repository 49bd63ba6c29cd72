"""`python -m bench [--quick] [--only RUN]`: every method on every run, side by side, in one process.

Ratios are against the torch.save files. Commit speed is MB of checkpoint file per second, end to end
from a file in the page cache to bytes fsynced on disk. Methods alternate file by file, and the
"vs ZipNN speed" column is the median over files of the paired speed ratio, which machine noise
affects least.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.methods import METHODS
from bench.runs import RUNS, checkpoint_files

ZIPNN = "ZipNN per tensor"


def _warm(path: Path) -> None:
    """Read the file once so every method starts from the page cache."""
    with open(path, "rb") as handle:
        while handle.read(1 << 24):
            pass


def measure(files: list[Path], workdir: Path) -> dict[str, dict[str, list[float]]]:
    """Stored bytes and seconds per file for every method, alternating methods file by file."""
    methods = [cls() for cls in METHODS]
    results = {m.name: {"stored": [], "seconds": []} for m in methods}
    for method in methods:
        method.start(workdir / method.name.replace(" ", "_"))
    try:
        for path in files:
            for method in methods:
                _warm(path)
                start = time.perf_counter()
                stored = method.commit(path)
                results[method.name]["seconds"].append(time.perf_counter() - start)
                results[method.name]["stored"].append(stored)
    finally:
        for method in methods:
            method.finish()
    return results


def table(run_name: str, results: dict, files: list[Path]) -> list[str]:
    sizes = [f.stat().st_size / 1e6 for f in files]
    raw = sum(sizes)
    zipnn = results[ZIPNN]
    lines = [f"### {run_name}: {RUNS[run_name][0].description}",
             f"{len(files)} checkpoints, {raw:.1f} MB as torch.save files", "",
             "| method | stored MB | ratio vs torch.save | size vs ZipNN | commit MB/s (median) | "
             "speed vs ZipNN (median of pairs) | first commit MB | later commits MB (mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        total = sum(r["stored"]) / 1e6
        speed = statistics.median(s / t for s, t in zip(sizes, r["seconds"]))
        paired = statistics.median(z / t for t, z in zip(r["seconds"], zipnn["seconds"]))
        later = r["stored"][1:] or [0]
        lines.append(f"| {name} | {total:.2f} | {raw / total:.2f}x | {sum(zipnn['stored']) / 1e6 / total:.2f}x | "
                     f"{speed:.0f} | {paired:.2f}x | {r['stored'][0] / 1e6:.2f} | {statistics.mean(later) / 1e6:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny runs (for the test suite)")
    parser.add_argument("--only", choices=sorted(RUNS), action="append", help="run only this case (repeatable)")
    args = parser.parse_args()
    print(f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, Python "
          f"{platform.python_version()}, torch {torch.__version__}")
    print(f"Command: python -m bench {' '.join(sys.argv[1:])}")
    for name in args.only or list(RUNS):
        files = checkpoint_files(name, quick=args.quick)
        work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
        try:
            results = measure(files, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("\n" + "\n".join(table(name, results, files)), flush=True)


if __name__ == "__main__":
    main()
