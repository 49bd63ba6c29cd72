"""Start the ranks of a real torch.distributed job (gloo, CPU) as separate processes, like torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckptstore.testing.net import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(scenario: str, repo: Path, out: Path, world: int, env_of_rank: dict[int, dict[str, str]] | None = None,
              timeout: float = 90, worker: str = "tests.dcp.worker") -> list[subprocess.CompletedProcess]:
    """Run `python -m WORKER SCENARIO` on `world` ranks; every rank's exit status and output."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CKPT_AUTHOR="tester",
                   **(env_of_rank or {}).get(rank, {}))
        procs.append(subprocess.Popen([sys.executable, "-m", worker, scenario, str(repo), str(out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            output, _ = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, output.decode(errors="replace")))
    return results
