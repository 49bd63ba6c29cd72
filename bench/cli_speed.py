"""`python -m bench.cli_speed [--commits 100] [--rounds 7]`: how fast `ckpt` answers, against `import sqlalchemy`.

Builds a repository of N commits of a small torch.save file, then runs `ckpt log`, `ckpt status`
and `ckpt branch` as a user would (fresh processes of the installed console script), alternating
them with `python -c "import sqlalchemy"` as the baseline, and prints each command's median wall
time and its ratio to the baseline's median measured in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

COMMANDS = {"log": ["log"], "status": ["status"], "branch": ["branch"]}


def build_repo(root: Path, commits: int) -> None:
    """A repository of `commits` commits of one small file, HEAD on the last, a few branches and tags."""
    from ckptstore import Repository

    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(256, 64, generator=generator), "b": torch.zeros(64)}
    with Repository.init(root) as repo:
        for step in range(commits):
            state["w"] += 1e-3 * torch.randn(256, 64, generator=generator)
            torch.save(state, root / "checkpoint.pt")
            repo.commit(root / "checkpoint.pt", message=f"step {step}", step=step)
            if step % 25 == 0:
                repo.branch(f"branch-{step}")
                repo.tag(f"tag-{step}")


def timed(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--module", action="store_true",
                        help="run `python -m ckptstore` (whatever PYTHONPATH selects) instead of the console script")
    args = parser.parse_args()
    ckpt = [sys.executable, "-m", "ckptstore"] if args.module else [
        shutil.which("ckpt", path=os.path.dirname(sys.executable)) or "ckpt"]
    root = Path(tempfile.mkdtemp(prefix="ckpt-cli-speed-"))
    try:
        build_repo(root, args.commits)
        baseline_argv = [sys.executable, "-c", "import sqlalchemy"]
        times: dict[str, list[float]] = {"import sqlalchemy": [], **{name: [] for name in COMMANDS}}
        timed(baseline_argv, root)  # warm the page cache for both
        for words in COMMANDS.values():
            timed([*ckpt, *words], root)
        for _ in range(args.rounds):
            times["import sqlalchemy"].append(timed(baseline_argv, root))
            for name, words in COMMANDS.items():
                times[name].append(timed([*ckpt, *words], root))
        base = statistics.median(times["import sqlalchemy"])
        print(f"repository of {args.commits} commits; median of {args.rounds} rounds, alternated")
        print(f"{'command':<20} {'median s':>9} {'x import sqlalchemy':>20}")
        for name, values in times.items():
            print(f"{name:<20} {statistics.median(values):>9.3f} {statistics.median(values) / base:>20.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
