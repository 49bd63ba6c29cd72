"""`python -m bench.zoo [--levels L ...] [--runs NAME ...] [--half tuned|held-back|all] [--json FILE] [--quick]`.

`python -m bench.zoo --report FILE` prints the tables again from the JSON lines of earlier runs.

Do the lossy levels keep their promise on runs nobody tuned them on (issue 22)? For each run of the zoo
(bench/zoo_runs.py: the six TUNED runs that chose the presets, and the seven HELD_BACK ones) and each
level: every checkpoint is committed at the level into a fresh repository; the ratio is the torch.save
bytes over the stored bytes (the first checkpoint counts); every restored checkpoint's eval loss is
compared with the original's; and 100 steps of training from the restored resume point (the last
checkpoint still at half the peak learning rate or more) are compared with the same 100 steps from the
original file. Prints a Markdown table per half with pass/fail against the acceptance, and the median
ratio per half and level against its target. A level that ckptstore does not know fails before any work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.lossy_store import change_pct, lossy_store, original_losses, resumed_loss
from bench.units import size_of
from bench.workloads import WORKLOADS, State, Workload
from bench.zoo_runs import HELD_BACK, TUNED
from ckptstore.errors import CkptError
from ckptstore.policy import level_named

# Acceptance (issue 22): the largest |eval change| and |resume change| in %, and whether the weights
# must come back bit for bit. Levels without an entry are measured and reported, not judged.
ACCEPTANCE = {"optimizer": (None, 0.1, True), "balanced": (0.25, 0.25, False), "extreme": (1.0, 1.0, False)}
TARGET_RATIO = {"optimizer": 3.0, "balanced": 25.0, "extreme": 50.0}
HALVES = {"tuned": TUNED, "held-back": HELD_BACK}


@dataclass
class Baseline:
    """What the original files give: every eval loss, the resume point, and the loss after resuming there."""

    files: list[Path]
    raw_bytes: int
    losses: list[float]
    resume_index: int
    resume_lr: float
    peak_lr: float
    resumed: float


def baseline(workload: Workload) -> Baseline:
    files = workload.files()
    index, lr, peak = workload.resume_point(files)
    losses, resumed = original_losses(workload, files, index, workload.resume_horizon)
    return Baseline(files, sum(size_of(f) for f in files), losses, index, lr, peak, resumed)


def bit_identical(a: State, b: State) -> bool:
    """Every weight and buffer of the two models equal in dtype, shape and raw bytes."""
    left, right = a.model.state_dict(), b.model.state_dict()
    raw = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)
    return list(left) == list(right) and all(
        left[k].dtype == right[k].dtype and left[k].shape == right[k].shape and torch.equal(raw(left[k]), raw(right[k]))
        for k in left)


def measure(workload: Workload, base: Baseline, level: str) -> dict:
    """One run at one level: ratio, every restored checkpoint's eval change, the resume change, and (for
    `optimizer`, whose weights must be lossless) whether every restored model is bit-identical."""
    started = time.perf_counter()
    changes, exact, resumed = [], [], float("nan")
    with lossy_store(workload, base.files, level) as store:
        for index, dest in store.restored():
            restored = workload.load(dest)
            changes.append(change_pct(workload.eval_loss(restored.model), base.losses[index]))
            if level == "optimizer":
                exact.append(bit_identical(restored, workload.load(base.files[index])))
            if index == base.resume_index:
                resumed = resumed_loss(workload, restored, workload.resume_horizon)
        stored = store.stored_bytes
    return {"level": level, "ratio": base.raw_bytes / stored, "raw_bytes": base.raw_bytes, "stored_bytes": stored,
            "worst_eval_change_pct": max(changes, key=abs), "eval_changes_pct": [round(c, 4) for c in changes],
            "resume_change_pct": change_pct(resumed, base.resumed), "weights_exact": all(exact) if exact else None,
            "seconds": round(time.perf_counter() - started, 1)}


def calibration_loss(workload: Workload, model: torch.nn.Module) -> float:
    """The loss on the run's calibration batch (a training batch it never reaches), in eval mode."""
    model.eval()
    with torch.no_grad():
        return float(workload.calibration()(model))


def measure_calibrated(workload: Workload, base: Baseline, level: str, limit: float) -> dict:
    """One run at one level committed with its calibration batch and `max_loss_change=limit`: every
    restored checkpoint's change on that batch (measured here again) and on the held-out eval data."""
    started = time.perf_counter()
    calibrated, changes = [], []
    with lossy_store(workload, base.files, level, {"max_loss_change": limit}, calibrate=True) as store:
        for index, dest in store.restored():
            restored, original = workload.load(dest), workload.load(base.files[index])
            calibrated.append(change_pct(calibration_loss(workload, restored.model),
                                         calibration_loss(workload, original.model)))
            changes.append(change_pct(workload.eval_loss(restored.model), base.losses[index]))
        stored = store.stored_bytes
    return {"level": level, "max_loss_change_pct": limit * 100, "ratio": base.raw_bytes / stored,
            "raw_bytes": base.raw_bytes, "stored_bytes": stored,
            "worst_calibration_change_pct": max(calibrated, key=abs), "worst_eval_change_pct": max(changes, key=abs),
            "eval_changes_pct": [round(c, 4) for c in changes], "seconds": round(time.perf_counter() - started, 1)}


def calibrated_verdict(row: dict) -> str:
    """With a calibration function: its batch's change within the limit, held-out eval within twice it."""
    limit = row["max_loss_change_pct"]
    ok = abs(row["worst_calibration_change_pct"]) <= limit and abs(row["worst_eval_change_pct"]) <= 2 * limit
    return "pass" if ok else "FAIL"


def verdict(row: dict) -> str:
    """pass / fail against the level's acceptance; '-' for a level without one."""
    if row["level"] not in ACCEPTANCE:
        return "-"
    eval_limit, resume_limit, exact = ACCEPTANCE[row["level"]]
    ok = abs(row["resume_change_pct"]) <= resume_limit
    ok &= eval_limit is None or abs(row["worst_eval_change_pct"]) <= eval_limit
    ok &= not exact or bool(row["weights_exact"])
    return "pass" if ok else "FAIL"


def run_zoo(runs: list[str], levels: list[str], quick: bool = False,
            emit: Callable[[dict], None] = lambda row: None, calibrate: float | None = None) -> list[dict]:
    """Every run at every level; `emit` sees each row as soon as it is measured.

    With `calibrate` (a relative limit), each level is committed with the run's calibration batch
    and that `max_loss_change` instead, and judged by `calibrated_verdict`.
    """
    rows = []
    for name in runs:
        started = time.perf_counter()
        workload = WORKLOADS[name](quick=quick)
        base = baseline(workload)
        setup_s = round(time.perf_counter() - started, 1)
        for level in levels:
            if calibrate is not None:
                row = {"run": name, "half": half_of(name), **measure_calibrated(workload, base, level, calibrate)}
                row["pass"] = calibrated_verdict(row)
            else:
                row = {"run": name, "half": half_of(name), **measure(workload, base, level),
                       "resume_index": base.resume_index, "checkpoints": len(base.files),
                       "resume_lr": base.resume_lr, "peak_lr": base.peak_lr, "baseline_seconds": setup_s}
                row["pass"] = verdict(row)
            rows.append(row)
            emit(row)
    return rows


def calibrated_table(rows: list[dict]) -> str:
    """A Markdown table of calibrated rows: the change on the calibration batch and on held-out data."""
    lines = ["| run | half | level | limit | ratio | worst calibration change | worst eval change | result |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['half']} | {r['level']} | {r['max_loss_change_pct']:.2f}% | {r['ratio']:.2f}x "
              f"| {r['worst_calibration_change_pct']:+.3f}% | {r['worst_eval_change_pct']:+.3f}% | {r['pass']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def half_of(name: str) -> str:
    return next((half for half, names in HALVES.items() if name in names), "other")


def table(rows: list[dict], half: str) -> str:
    """A Markdown table of one half's rows, then its median ratio per level against the target."""
    lines = [f"### {half}", "", "| run | level | ratio | worst eval change | resume change | resume from "
             "(lr / peak) | weights | result |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        weights = {True: "bit-exact", False: "changed", None: "-"}[r["weights_exact"]]
        lines.append(f"| {r['run']} | {r['level']} | {r['ratio']:.2f}x | {r['worst_eval_change_pct']:+.3f}% "
                     f"| {r['resume_change_pct']:+.3f}% | {r['resume_index'] + 1}/{r['checkpoints']} "
                     f"({r['resume_lr'] / r['peak_lr']:.2f}) | {weights} | {r['pass']} |")
    lines.append("")
    for level in dict.fromkeys(r["level"] for r in rows):
        median = statistics.median(r["ratio"] for r in rows if r["level"] == level)
        target = TARGET_RATIO.get(level)
        judged = f" (target {target:g}x: {'met' if median >= target else 'MISSED'})" if target else ""
        lines.append(f"- median ratio, {level}: {median:.2f}x{judged}")
    return "\n".join(lines) + "\n"


def report(rows: list[dict]) -> str:
    """One table per half, tuned first; rows in zoo order, levels from lossless-weights to smallest.

    Calibrated rows (`--calibrate`) get a table of their own, after.
    """
    calibrated = [r for r in rows if "max_loss_change_pct" in r]
    if calibrated:
        plain = [r for r in rows if "max_loss_change_pct" not in r]
        return (report(plain) + "\n" if plain else "") + calibrated_table(calibrated)
    order = [*TUNED, *HELD_BACK]
    levels = [*ACCEPTANCE]
    rows = sorted(rows, key=lambda r: (order.index(r["run"]) if r["run"] in order else len(order), r["run"],
                                       levels.index(r["level"]) if r["level"] in levels else len(levels)))
    halves = [h for h in (*HALVES, "other") if any(r["half"] == h for r in rows)]
    return "\n".join(table([r for r in rows if r["half"] == half], half) for half in halves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["optimizer", "balanced", "extreme"],
                        help="any level name ckptstore knows (passed through as it is)")
    parser.add_argument("--runs", nargs="+", choices=sorted(WORKLOADS), help="default: every run of --half")
    parser.add_argument("--half", choices=["tuned", "held-back", "all"], default="all")
    parser.add_argument("--json", type=Path, help="append one JSON line per run and level here")
    parser.add_argument("--quick", action="store_true", help="the tiny versions of the runs")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (1 is many times faster on a machine busy with other work: two threads "
                             "then wait on each other at every parallel step)")
    parser.add_argument("--calibrate", type=float, metavar="PERCENT",
                        help="commit with each run's calibration batch and --max-loss-change PERCENT; judge the "
                             "change on that batch (within it) and on held-out eval data (within twice it)")
    parser.add_argument("--report", type=Path, metavar="JSONL",
                        help="only print the tables of rows saved by --json (the last row per run and level)")
    args = parser.parse_args()
    if args.report:
        saved = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        print(report(list({(r["run"], r["level"], r.get("max_loss_change_pct")): r for r in saved}.values())))
        return
    try:
        for level in args.levels:  # ckptstore's own error, before any run trains or commits
            level_named(level)
    except CkptError as error:
        sys.exit(f"bench.zoo: {error}")
    torch.set_num_threads(args.threads)
    runs = args.runs or [n for half, names in HALVES.items() if args.half in (half, "all") for n in names]

    def emit(row: dict) -> None:
        row["threads"] = args.threads
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            with args.json.open("a") as out:
                out.write(json.dumps(row) + "\n")

    limit = None if args.calibrate is None else args.calibrate / 100
    print(report(run_zoo(runs, args.levels, args.quick, emit, limit)))


if __name__ == "__main__":
    main()
