"""Start the ranks of a real torch.distributed job (gloo, CPU) as separate processes, like torchrun.

Each rank is a process of its own, forked from a server that imported torch, DCP and the workers
once (tests/forked.py): a fresh interpreter per rank spent 3-4 s of CPU on those imports.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ckptstore.testing.net import free_port
from tests.forked import Forked


def run_ranks(scenario: str, repo: Path, out: Path, world: int, env_of_rank: dict[int, dict[str, str]] | None = None,
              timeout: float = 90, worker: str = "tests.dcp.worker") -> list[subprocess.CompletedProcess]:
    """Run `python -m WORKER SCENARIO REPO OUT` on `world` ranks; every rank's exit status and output."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = [Forked(worker, [scenario, str(repo), str(out)],
                    dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port), OMP_NUM_THREADS="1", CKPT_AUTHOR="tester",
                         **(env_of_rank or {}).get(rank, {})))
             for rank in range(world)]
    results = []
    for rank in ranks:
        try:
            out_text, err_text = rank.communicate(timeout)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            out_text, err_text = rank.communicate()
        results.append(subprocess.CompletedProcess(rank.args, rank.returncode, out_text + err_text))
    return results
