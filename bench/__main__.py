"""`python -m bench [--quick] [--only RUN] [--out DIR]`: every method on every run, side by side.

For each run the checkpoint files are committed by every method in turn (file by file, so machine
noise hits all methods alike), each is checked out again right away, lossless methods are verified
bit for bit (ckptstore at every checkpoint, the baselines at the first and last), and lossy ones are
evaluated on held-out data and resumed. Results go to a Markdown
section of DIR/benchmarks.md and PNG plots in DIR/img (DIR defaults to docs/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.memory import PeakMemory
from bench.methods import all_methods
from bench.report import write_report
from bench.units import clear, same_unit, size_of
from bench.workloads import SUITE_RUNS, WORKLOADS, Workload

ROOT = Path(__file__).resolve().parents[1]


def warm(unit: Path, flush: bool = True) -> None:
    """Flush others' dirty pages, then read every file once: each method starts from the page cache
    with nothing of another method's left to write."""
    if flush:
        os.sync()
    for path in [unit] if unit.is_file() else sorted(unit.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass


def resume_loss(workload: Workload, unit: Path, steps: int) -> float:
    state = workload.load(unit)
    workload.train_steps(state, steps)
    return workload.eval_loss(state.model)


def run_workload(workload: Workload, resume_steps: int) -> dict:
    files = workload.files()
    methods = [cls() for cls in all_methods()]
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    sizes = [size_of(f) for f in files]
    steps = [workload.every * (i + 1) for i in range(len(files))]
    result = {"run": workload.name, "description": workload.description, "unit": workload.unit,
              "sizes": sizes, "steps": steps, "methods": {}}
    original_eval = [workload.eval_loss(workload.load(f).model) for f in files]
    result["original_eval"] = original_eval
    try:
        for method in methods:
            method.start(scratch / method.name.replace(" ", "_").replace("(", "").replace(")", ""), workload)
            result["methods"][method.name] = {"lossy": method.lossy, "stored": [], "commit_s": [], "checkout_s": [],
                                              "commit_mem": [], "checkout_mem": [], "eval": [], "resume": None}
        # quick runs are the test suite's (their times are not reported): a system-wide flush there only
        # waits on the other test worker's writes
        flush = not workload.quick
        for index, unit in enumerate(files):
            for method in methods:
                row = result["methods"][method.name]
                warm(unit, flush)
                with PeakMemory() as peak:
                    start = time.perf_counter()
                    row["stored"].append(method.commit(unit))
                    row["commit_s"].append(time.perf_counter() - start)
                row["commit_mem"].append(peak.extra)
                dest = scratch / ("restored" + unit.suffix)
                if flush:
                    os.sync()
                with PeakMemory() as peak:
                    start = time.perf_counter()
                    method.checkout(index, dest)
                    row["checkout_s"].append(time.perf_counter() - start)
                row["checkout_mem"].append(peak.extra)
                if method.lossy:
                    row["eval"].append(workload.eval_loss(workload.load(dest).model))
                    if index == len(files) - 1:
                        row["resume"] = resume_loss(workload, dest, resume_steps)
                else:
                    checked = index in (0, len(files) - 1) or method.name.startswith("ckptstore")
                    if checked and not same_unit(unit, dest):
                        raise AssertionError(f"{method.name} did not restore {unit} exactly")
                clear(dest)
        result["original_resume"] = resume_loss(workload, files[-1], resume_steps)
        result["resume_steps"] = resume_steps
    finally:
        for method in methods:
            if method.name in result["methods"]:  # started: one whose start failed has nothing to finish
                method.finish()
                result["methods"][method.name]["metadata_bytes"] = getattr(method, "metadata_bytes", 0)
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny runs, for the test suite")
    parser.add_argument("--only", choices=sorted(WORKLOADS), action="append", help="only this run (repeatable)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where benchmarks.md and img/ go")
    parser.add_argument("--report-only", action="store_true", help="redraw tables and plots from OUT/benchmarks.json")
    parser.add_argument("--resume-steps", type=int, default=None,
                        help="steps to resume from the last restored checkpoint (default: the run's, 20)")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((args.out / "benchmarks.json").read_text())
        print(write_report(saved["header"], saved["results"], args.out))
        return
    # Quick runs share the machine with the test suite's other worker: a second thread only waits.
    torch.set_num_threads(1 if args.quick else 2)
    header = {"machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
              "versions": f"Python {platform.python_version()}, torch {torch.__version__}",
              "command": "python -m bench " + " ".join(sys.argv[1:])}
    started = time.time()
    results = []
    for name in args.only or list(SUITE_RUNS):
        run_started = time.time()
        workload = WORKLOADS[name](quick=args.quick)
        results.append(run_workload(workload, resume_steps=args.resume_steps or workload.resume_steps))
        print(f"{name}: {time.time() - run_started:.0f}s", flush=True)
    header["seconds"] = round(time.time() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "benchmarks.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    print(write_report(header, results, args.out))


if __name__ == "__main__":
    main()
