"""Start the ranks of a real torch.distributed job (gloo, CPU) as separate processes, like torchrun.

Each rank is its own process, forked from a server process that imported torch, DCP and the
workers once (multiprocessing's forkserver): a fresh interpreter per rank spent 3-4 s of CPU on
those imports, about 60 s of the suite's CPU over its 17 ranks. The ranks share nothing with the
test process or with each other: each gets the environment, argv and working directory a
`python -m WORKER` subprocess would, and exits as one would (atexit handlers included).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ckptstore.testing.net import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ["tests.dcp.worker", "tests.dcp.worker_more", "tests.dcp.lossy_worker"]


def _forkserver() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKERS)
    return context


def _rank(worker: str, argv: list[str], env: dict[str, str], output: str) -> None:
    """One rank's life in its forked process: what `python -m WORKER ARGV` with `env` in ROOT does."""
    import torch

    log = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.argv = [worker, *argv]
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read at import, in the server
    try:
        importlib.import_module(worker).main()
    finally:
        atexit._run_exitfuncs()  # a forked process ends with os._exit
        sys.stdout.flush()
        sys.stderr.flush()


def run_ranks(scenario: str, repo: Path, out: Path, world: int, env_of_rank: dict[int, dict[str, str]] | None = None,
              timeout: float = 90, worker: str = "tests.dcp.worker") -> list[subprocess.CompletedProcess]:
    """Run WORKER's `main()` for SCENARIO on `world` ranks; every rank's exit status and output."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = _forkserver()
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPT_AUTHOR="tester",
                   **(env_of_rank or {}).get(rank, {}))
        proc = context.Process(target=_rank, args=(worker, [scenario, str(repo), str(out)], env,
                                                   str(logs / f"rank{rank}.log")))
        proc.start()
        procs.append(proc)
    results = []
    for rank, proc in enumerate(procs):
        proc.join(timeout)
        if proc.exitcode is None:
            for other in procs:
                other.kill()
            proc.join()
        output = (logs / f"rank{rank}.log").read_text(errors="replace")
        results.append(subprocess.CompletedProcess([worker, scenario, f"rank {rank}"], proc.exitcode, output))
    for proc in procs:
        proc.close()
    shutil.rmtree(logs)
    return results
