"""`python -m bench.ab_speed TREE_A TREE_B [--run RUN] [--level LEVEL] [--pairs 3]`: paired commit/checkout speed.

Compares two source trees of ckptstore (say, main before and after a refactor) on the same cached
checkpoints: each trial is a fresh process with PYTHONPATH set to one tree that commits every
checkpoint of the run into a new repository and checks each one out again (torch is imported
before the clock starts, as it is in a training process). Trials alternate
A, B, B, A, ... so the machine's drift hits both alike; it prints each tree's median commit and
checkout seconds and B's time as a ratio of A's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.workloads import WORKLOADS

TRIAL = """
import json, shutil, sys, time
from pathlib import Path
import torch  # loaded before timing, as in a training process: versions differ in when they first need it
from ckptstore import Repository
files, level, scratch = [Path(p) for p in sys.argv[1].split(",")], sys.argv[2] or None, Path(sys.argv[3])
for path in files:
    for member in [path] if path.is_file() else sorted(path.rglob("*")):
        member.is_file() and member.read_bytes()
with Repository.init(scratch / "repo") as repo:
    start = time.perf_counter()
    cids = [repo.commit(path, message=path.name, lossy=level) for path in files]
    commit = time.perf_counter() - start
    start = time.perf_counter()
    for index, cid in enumerate(cids):
        repo.checkout_to(cid, scratch / f"out-{index}", force=True)
    checkout = time.perf_counter() - start
print(json.dumps({"module": __import__("ckptstore").__file__, "commit": commit, "checkout": checkout}))
"""


def trial(tree: Path, files: list[Path], level: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckpt-ab-") as scratch:
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        out = subprocess.run([sys.executable, "-c", TRIAL, ",".join(map(str, files)), level, scratch], env=env,
                             check=True, capture_output=True, text=True, cwd=scratch).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["module"].startswith(str(tree.resolve())):
        raise SystemExit(f"the trial loaded ckptstore from {result['module']}, not from {tree}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--run", default="scratch-bf16")
    parser.add_argument("--level", default="", help="a lossy level; empty for lossless")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    files = WORKLOADS[args.run]().files()
    results: dict[str, list[dict]] = {"a": [], "b": []}
    for index in range(2 * args.pairs):
        order = ("a", "b") if index % 2 == 0 else ("b", "a")
        for which in order:
            results[which].append(trial(getattr(args, which), files, args.level))
    print(f"{args.run} at {args.level or 'lossless'}: {len(files)} checkpoints, {2 * args.pairs} trials per tree, "
          "medians")
    for what in ("commit", "checkout"):
        a = statistics.median(r[what] for r in results["a"])
        b = statistics.median(r[what] for r in results["b"])
        print(f"{what:<9} A {a:7.3f} s   B {b:7.3f} s   B/A {b / a:.3f}   "
              f"(A {min(r[what] for r in results['a']):.3f}-{max(r[what] for r in results['a']):.3f}, "
              f"B {min(r[what] for r in results['b']):.3f}-{max(r[what] for r in results['b']):.3f})")


if __name__ == "__main__":
    main()
