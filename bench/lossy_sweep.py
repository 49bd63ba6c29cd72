"""`python -m bench.lossy_sweep RUN [LEVEL ...] [--knob NAME=VALUE ...]`: tune lossy levels on one run.

Commits the run's cached checkpoints at each level into a fresh repository, then reports the total
ratio against the torch.save files, the worst eval-loss change of a restored checkpoint, and the
eval loss after resuming the last restored checkpoint for the run's resume horizon (100 steps), against
the same from the original. Speeds are MB of torch.save file per second: encoding (commit from the
file), decoding (checkout into memory), and restoring (checkout written back to a file).
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.lossy_store import change_pct, lossy_store, original_losses, resumed_loss
from bench.units import size_of
from bench.workloads import WORKLOADS


def sweep(run: str, levels: list[str], knobs: dict, quick: bool = False, resume_steps: int | None = None,
          speed_only: bool = False, calibrate: bool = False) -> list[dict]:
    workload = WORKLOADS[run](quick=quick)
    resume_steps = resume_steps or workload.resume_horizon
    files = workload.files()
    raw = sum(size_of(f) for f in files)
    if not speed_only:
        original, original_resume = original_losses(workload, files, len(files) - 1, resume_steps)
    rows = []
    for level in levels:
        with lossy_store(workload, files, level, knobs, calibrate) as store:
            changes = []
            for index, dest in store.restored(decode=True):
                if not speed_only:
                    restored = workload.load(dest)
                    changes.append(change_pct(workload.eval_loss(restored.model), original[index]))
                    if index == len(files) - 1:
                        resumed = resumed_loss(workload, restored, resume_steps)
            pairing = store.repo.show(store.commits[-1]).get("pairing")
            stored, timings = store.stored_bytes, store.timings
        quality = {} if speed_only else {
            "worst_eval_change_pct": max(changes, key=abs), "eval_changes_pct": [round(c, 3) for c in changes],
            "resume_change_pct": change_pct(resumed, original_resume)}
        rows.append({"run": run, "level": level, "knobs": knobs, "calibrated": calibrate, "ratio": raw / stored,
                     **quality,
                     "encode_MBps": raw / 1e6 / timings.encode_s, "decode_MBps": raw / 1e6 / timings.decode_s,
                     "restore_file_MBps": raw / 1e6 / timings.to_file_s,
                     "pairing": pairing})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", choices=sorted(WORKLOADS))
    parser.add_argument("levels", nargs="*", default=["optimizer", "balanced", "extreme"])
    parser.add_argument("--knob", action="append", default=[], help="NAME=VALUE (JSON value)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--resume-steps", type=int, default=None, help="default: the run's resume horizon, 100")
    parser.add_argument("--speed-only", action="store_true", help="ratio and speeds, without eval or resume")
    parser.add_argument("--calibrate", action="store_true",
                        help="commit with the live model and a calibration batch (measured sensitivity); "
                             "encoding speed then includes loading the model and measuring")
    args = parser.parse_args()
    torch.set_num_threads(2)
    knobs = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.knob)}
    sweep(args.run, args.levels, knobs, args.quick, args.resume_steps, args.speed_only, args.calibrate)


if __name__ == "__main__":
    main()
