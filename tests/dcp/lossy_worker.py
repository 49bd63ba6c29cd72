"""One rank of the lossy sharded test (launched like torchrun by tests/dcp/launch.py).

    python -m tests.dcp.lossy_worker lossy|relaid REPO OUT

lossy: an FSDP2 model with AdamW (a weight of 129 rows, split 65/64, and one whose shards are each below
the level's smallest quantized size while the whole is above it), trained between two `balanced`
commits on branch `ws2`; each state is also saved with DCP's FileSystemWriter (OUT/orig-LABEL), the
originals the test measures the restored commits against. Each rank writes OUT/rank<N>.json.

relaid: one `balanced` save onto branch `relaid` of a model whose first weight has 3 rows: at 2 ranks
its shards are rows [0:2] and [2:3], at 3 ranks [0:1], [1:2] and [2:3] (one key kept, two new).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from ckptstore.dcp import CkptSavePlanner, CkptStorageWriter
from tests.dcp import worker

LABELS = ((2, "first"), (4, "second"))


def main() -> None:
    repo, out = sys.argv[2], Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if sys.argv[1] == "relaid":
        relaid(repo, world)
    else:
        two_saves(repo, out, rank, world)
    dist.barrier()
    dist.destroy_process_group()


def relaid(repo: str, world: int) -> None:
    model, optimizer = worker.model_and_optimizer(init_device_mesh("cpu", (world,)), (4096, 3, 8), lr=1e-3)
    generator = torch.Generator().manual_seed(world)  # the same batch on every rank
    for _ in range(2):
        model(torch.randn(8, 4096, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    writer = CkptStorageWriter(repo, branch="relaid", message=f"at {world} ranks", lossy="balanced")
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer, planner=CkptSavePlanner())


def two_saves(repo: str, out: Path, rank: int, world: int) -> None:
    model, optimizer = worker.model_and_optimizer(init_device_mesh("cpu", (world,)), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    report = {}
    for step, label in LABELS:
        for _ in range(2):
            model(torch.randn(8, 64, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        writer = CkptStorageWriter(repo, branch="ws2", message=f"{label} lossy", step=step, lossy="balanced")
        dcp.save(state, storage_writer=writer, planner=CkptSavePlanner())
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out / f"orig-{label}")))
        report[label] = writer.commit_id
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
