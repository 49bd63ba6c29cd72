"""`python -m bench.background [--commits N] [--steps N] [--every N] [--rounds N]`: commits in the background.

On the MiniLM fine-tune (bench/workloads.py, fp32, AdamW: 272 MB of state), two figures, each a
ratio against baselines measured in the same run, interleaved so the machine's load hits all alike:

1. Training blocked per commit: the time `repo.commit(state, blocking=False)` takes to return
   (the previous commit finished first, so this is the snapshot), against a plain copy of the
   same state to host memory (`copy.deepcopy` of the state dicts: what a hand-written
   background saver would do first) and against a blocking `repo.commit(state)`. One training
   step between commits, so each commit has new content.
2. Steps per second of the fine-tune checkpointing every `--every` steps: with background
   commits (the last one waited for at the end of the loop), with no checkpointing, and with
   `torch.save` to a new file each time. Each round runs the three loops in turn (rotated), and
   the ratios are taken within a round.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.units import fsync_file
from bench.workloads import MiniLMFineTune, State
from ckptstore import Repository


def _state(state: State) -> dict:
    return {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "step": state.step}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def blocked(workload: MiniLMFineTune, state: State, work: Path, commits: int) -> dict[str, list[float]]:
    """Seconds the training loop is blocked per checkpoint, by method, `commits` times each."""
    times: dict[str, list[float]] = {"deepcopy": [], "background": [], "blocking": []}
    with Repository.init(work / "blocked") as repo:
        repo.commit(_state(state), "base")  # the next commits chain on it, as in a run
        for _ in range(commits):
            workload.train_steps(state, 1)
            times["deepcopy"].append(_timed(lambda: copy.deepcopy(_state(state))))
            handle = None

            def start() -> None:
                nonlocal handle
                handle = repo.commit(_state(state), blocking=False)

            times["background"].append(_timed(start))
            handle.result()
            workload.train_steps(state, 1)
            times["blocking"].append(_timed(lambda: repo.commit(_state(state))))
    return times


def loop(workload: MiniLMFineTune, state: State, steps: int, every: int,
         save: Callable[[dict, int], object] | None, finish: Callable[[], object] | None = None) -> float:
    """Steps per second of `steps` training steps, `save(state, step)` after every `every`-th."""
    start = time.perf_counter()
    for i in range(1, steps + 1):
        workload.train_steps(state, 1)
        if save is not None and i % every == 0:
            save(_state(state), i)
    if finish is not None:
        finish()
    return steps / (time.perf_counter() - start)


def throughput(workload: MiniLMFineTune, state: State, work: Path, steps: int, every: int,
               rounds: int) -> dict[str, list[float]]:
    """Steps per second by method, one loop of each per round, the order rotated each round (the load drifts)."""
    rates: dict[str, list[float]] = {"none": [], "torch.save": [], "background": []}
    with Repository.init(work / "loop") as repo:
        handles = []
        saves = work / "saves"

        def torch_save(s: dict, i: int) -> None:  # durable, as a commit is (it did not fsync before 6 December)
            torch.save(s, saves / f"step-{i}.pt")
            fsync_file(saves / f"step-{i}.pt")

        runs = {"none": lambda: loop(workload, state, steps, every, None),
                "torch.save": lambda: loop(workload, state, steps, every, torch_save),
                "background": lambda: loop(workload, state, steps, every,
                                           lambda s, i: handles.append(repo.commit(s, step=i, blocking=False)),
                                           lambda: handles[-1].result())}
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", flush=True)
            names = list(runs)[r % 3:] + list(runs)[:r % 3]
            for name in names:
                saves.mkdir(exist_ok=True)
                rates[name].append(runs[name]())
                shutil.rmtree(saves)
        waited = [h.timing["waited_s"] for h in handles]
        print(f"background commits: {len(handles)}, waited for the one before: max {max(waited):.3f} s; "
              f"median commit_s {statistics.median(h.timing['commit_s'] for h in handles):.2f} s")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commits", type=int, default=5, help="commits per method for the blocked time")
    parser.add_argument("--steps", type=int, default=20, help="training steps per loop")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--rounds", type=int, default=2, help="loops of each method")
    parser.add_argument("--quick", action="store_true", help="the tiny MiniLM (a smoke test, not a figure)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    workload = MiniLMFineTune(quick=args.quick)
    state = workload.build()
    workload.train_steps(state, 2)  # Adam's moments exist from here on
    work = Path(tempfile.mkdtemp(prefix="ckpt-bg-"))
    try:
        times = blocked(workload, state, work, args.commits)
        print("blocked:", {k: [round(x, 3) for x in v] for k, v in times.items()}, flush=True)
        rates = throughput(workload, state, work, args.steps, args.every, args.rounds) if args.rounds else {}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n| training blocked per commit (median of {args.commits}) | s | background / this |")
    print("|---|---|---|")
    for name in ("deepcopy", "blocking", "background"):
        print(f"| {name} | {med[name]:.3f} | {med['background'] / med[name]:.2f} |")
    if not rates:
        return
    rate = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n| steps/s, checkpoint every {args.every} ({args.rounds} rounds x {args.steps} steps) "
          "| median steps/s | background / this, per round | median |")
    print("|---|---|---|---|")
    for name in ("none", "torch.save", "background"):
        ratios = [b / x for b, x in zip(rates["background"], rates[name])]
        print(f"| {name} | {rate[name]:.3f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
              f"{statistics.median(ratios):.2f} |")
    print("\nraw steps/s:", {k: [round(x, 3) for x in v] for k, v in rates.items()})


if __name__ == "__main__":
    main()
