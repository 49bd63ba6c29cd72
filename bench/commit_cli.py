"""`python -m bench.commit_cli [RUN] [--files 8]`: `ckpt commit` after each save, against in-process commits.

The mission's users run `ckpt commit` from their training script or shell after each save, so each
commit pays for a fresh process. This commits the first N cached checkpoints of a run (default:
the MiniLM fine-tune's 271 MB torch.save files) into a fresh repository twice over: once through
the installed `ckpt` console script, one process per commit, and once as the same `repo.commit`
calls in this process (its imports already paid), as the same `ckpt commit` calls handed to a
`ckpt daemon` (ckptstore/daemon.py; its start timed apart), and as one Python script that
imports ckptstore and makes them all (start-up paid once). Blocks run in rounds of in-process,
CLI, daemon, script, script, daemon, CLI, in-process, so drift in the machine's speed hits all
alike; it prints each block's throughput in MB of checkpoint per second and the CLI's as a ratio
of the others, per round.
Every block chains by this machine's decode costs, measured once per machine and kept in the
user's cache (repo/chaincost.py); that one-off measurement is timed and printed first.
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

from bench.workloads import WORKLOADS


def in_process(files: list[Path], root: Path) -> float:
    """Seconds for `repo.commit` of each file in turn, in this process.

    The chain-cost figures this process read for an earlier block are forgotten: each fresh
    repository reads them from the machine's cache (`max_chain = "auto"`), as a new process does.
    """
    from ckptstore import Repository
    from ckptstore.repo import chaincost

    chaincost._measured.clear()
    shutil.rmtree(root, ignore_errors=True)
    with Repository.init(root) as repo:
        start = time.perf_counter()
        for path in files:
            repo.commit(path, message=path.name)
        return time.perf_counter() - start


SCRIPT = """
import sys
from ckptstore import Repository
with Repository.init(sys.argv[1]) as repo:
    for path in sys.argv[2:]:
        repo.commit(path, message=path.rsplit("/", 1)[-1])
"""


def one_script(files: list[Path], root: Path) -> float:
    """Seconds for one Python process that imports ckptstore and makes every commit (a training script's view)."""
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", SCRIPT, str(root), *map(str, files)], check=True)
    return time.perf_counter() - start


def _new_repository(root: Path, ckpt: list[str]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    subprocess.run([*ckpt, "init"], cwd=root, check=True, stdout=subprocess.DEVNULL)


def _commit_each(files: list[Path], root: Path, ckpt: list[str]) -> float:
    """Seconds for one `ckpt commit` process per file into the repository at `root`."""
    start = time.perf_counter()
    for path in files:
        subprocess.run([*ckpt, "commit", str(path), "-m", path.name], cwd=root, check=True,
                       stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def through_cli(files: list[Path], root: Path, ckpt: list[str]) -> float:
    """Seconds for one `ckpt commit` process per file, in a new repository."""
    _new_repository(root, ckpt)
    return _commit_each(files, root, ckpt)


def through_daemon(files: list[Path], root: Path, ckpt: list[str], starts: list[float]) -> float:
    """Seconds for one `ckpt commit` process per file, each handing its work to `ckpt daemon`.

    The daemon's start (once per session of commits) is timed apart and appended to `starts`.
    """
    _new_repository(root, ckpt)
    started = time.perf_counter()
    subprocess.run([*ckpt, "daemon", "start"], cwd=root, check=True, stdout=subprocess.DEVNULL)
    starts.append(time.perf_counter() - started)
    try:
        return _commit_each(files, root, ckpt)
    finally:
        subprocess.run([*ckpt, "daemon", "stop"], cwd=root, check=True, stdout=subprocess.DEVNULL)


def machine_costs() -> None:
    """This machine's chain costs in the user's cache before any block: print what measuring them took."""
    from ckptstore.repo import chaincost

    cached = chaincost.machine_file().exists()
    chaincost._measured.clear()
    start = time.perf_counter()
    chaincost.chain_costs()
    print(f"this machine's chain costs: {time.perf_counter() - start:.2f} s "
          f"({'read from' if cached else 'measured once, kept in'} {chaincost.machine_file()})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", default="minilm-finetune")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="ABBA rounds; the ratio is their median")
    parser.add_argument("--module", action="store_true",
                        help="run `python -m ckptstore` (whatever PYTHONPATH selects) instead of the console script")
    args = parser.parse_args()
    ckpt = [sys.executable, "-m", "ckptstore"] if args.module else [
        shutil.which("ckpt", path=os.path.dirname(sys.executable)) or "ckpt"]
    files = WORKLOADS[args.run]().files()[: args.files]
    megabytes = sum(p.stat().st_size for p in files) / 1e6
    for path in files:  # the page cache holds them for every block
        path.read_bytes()
    machine_costs()
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-commit-cli-"))
    daemon_starts: list[float] = []
    seconds: dict[str, list[float]] = {"in-process": [], "cli": [], "daemon": [], "script": []}
    runners = {"in-process": lambda: in_process(files, scratch / "repo"),
               "cli": lambda: through_cli(files, scratch / "repo", ckpt),
               "daemon": lambda: through_daemon(files, scratch / "repo", ckpt, daemon_starts),
               "script": lambda: one_script(files, scratch / "repo")}
    try:
        for label in ("in-process", "cli", "daemon", "script", "script", "daemon", "cli", "in-process") * args.rounds:
            seconds[label].append(runners[label]())
            print(f"{label:<11} {len(files)} commits, {megabytes:.0f} MB: {seconds[label][-1]:.2f} s, "
                  f"{megabytes / seconds[label][-1]:.0f} MB/s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cli, inproc = statistics.median(seconds["cli"]), statistics.median(seconds["in-process"])
    print(f"throughput (medians): in-process {megabytes / inproc:.0f} MB/s, ckpt commit {megabytes / cli:.0f} MB/s, "
          f"ckpt commit with the daemon {megabytes / statistics.median(seconds['daemon']):.0f} MB/s, "
          f"one script {megabytes / statistics.median(seconds['script']):.0f} MB/s; "
          f"ckpt daemon start {statistics.median(daemon_starts):.2f} s")
    _ratio("ckpt commit / in-process", seconds["in-process"], seconds["cli"])
    _ratio("ckpt commit / one script", seconds["script"], seconds["cli"])
    _ratio("ckpt commit with the daemon / in-process", seconds["in-process"], seconds["daemon"])
    _ratio("the same, its start counted", seconds["in-process"], [d + s for d, s in
                                                                  zip(seconds["daemon"], daemon_starts)])


def _ratio(label: str, baseline: list[float], ours: list[float]) -> None:
    """Throughput of `ours` over `baseline`, per round (each round's two blocks of each summed)."""
    ratios = [(a + b) / (c + d) for a, b, c, d in zip(baseline[::2], baseline[1::2], ours[::2], ours[1::2])]
    print(f"{label} per round: {', '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
