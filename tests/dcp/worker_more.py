"""More rank scenarios for the DCP tests (launched like torchrun by tests/dcp/launch.py):

    python -m tests.dcp.worker_more SCENARIO REPO OUT

`save4` (4 ranks): a tiny FSDP2 model with AdamW trained between saves; step 2 saved with
CkptStorageWriter and with FileSystemWriter; step 4 with FileSystemWriter and then with
`dcp.async_save` through CkptStorageWriter on a checkpoint process group while training goes on.
Every save's whole tensors (gathered) go to OUT/full-<step>.pt, to compare loads against.
`load2` (2 ranks, after the test made a DCP checkout and committed the FileSystemWriter output):
each of those loaded back at 2 ranks and compared, and training resumed from the step-2 commit
and from FileSystemWriter's step-2 directory; then, with $SHARED_REPO, a save and a load on a
repository whose objects are on S3 and metadata on PostgreSQL, and last a save there that the
rank with $CKPT_CRASH_AT dies in. Each rank writes OUT/<scenario>-rank<N>.json.
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ckptstore.dcp import CkptStorageReader, CkptStorageWriter
from tests.dcp.worker import differences, model_and_optimizer


def tiny(mesh):
    """833 parameters: 33 rows split unevenly over 4 ranks (9, 9, 9, 6), AdamW over FSDP2."""
    return model_and_optimizer(mesh, (16, 33, 8), lr=1e-4)  # fine-tune-like steps: residuals pay


def train(model, optimizer, steps: int, seed: int) -> list[float]:
    """A few steps on fixed random batches; the losses, bit for bit as Python floats."""
    generator, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def state(model, optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "extra": {"step": step}}


def whole(value, path: str = "") -> dict:
    """Nested state as {DCP's fully qualified name: value}, DTensors gathered whole (a collective)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in whole(item, f"{path}.{key}" if path else key).items()}
    if isinstance(value, DTensor):
        return {path: value.full_tensor().detach().clone()}
    if isinstance(value, torch.Tensor):
        return {path: value.detach().clone()}
    return {path: value}


def restored(model, optimizer, reader) -> dict:
    """A fresh model and optimizer loaded from `reader` (the state dict it loaded, pushed into both)."""
    target = state(model, optimizer, 0)
    dcp.load(target, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    return target


def run_save4(repo: str, out: Path, rank: int, mesh) -> dict:
    checkpoint_group = dist.new_group(backend="gloo")  # async saves talk here while training uses the default
    model, optimizer = tiny(mesh)
    report: dict = {"losses": train(model, optimizer, 2, seed=rank)}
    sd = state(model, optimizer, 2)
    writer = CkptStorageWriter(repo, message="step 2", step=2)
    dcp.save(sd, storage_writer=writer)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out / "fs-2")))
    _keep_whole(sd, out / "full-2.pt", rank)
    report["commit_2"] = writer.commit_id
    report["losses"] += train(model, optimizer, 2, seed=10 + rank)
    sd = state(model, optimizer, 4)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out / "fs-4")))
    _keep_whole(sd, out / "full-4.pt", rank)
    writer = CkptStorageWriter(repo, message="step 4 async", step=4)
    future = dcp.async_save(sd, storage_writer=writer, process_group=checkpoint_group)
    report["losses"] += train(model, optimizer, 2, seed=20 + rank)  # the staged copy is saved meanwhile
    report["async_result"] = type(future.result()).__name__
    report["commit_4"] = writer.commit_id
    return report


def _keep_whole(sd: dict, path: Path, rank: int) -> None:
    gathered = whole(sd)
    if rank == 0:
        torch.save(gathered, path)


def run_load2(repo: str, out: Path, rank: int, mesh) -> dict:
    """Every way in, loaded at 2 ranks and compared whole with what was saved; then resumed training."""
    from ckptstore import Repository

    with Repository.open(repo, read_only=True) as opened:
        refs = {"commit_2": opened.resolve("main~1"), "commit_4": opened.resolve("main"),
                "imported_2": opened.resolve("imported~1"), "imported_4": opened.resolve("imported")}
    sources = {name: (lambda ref=ref: CkptStorageReader(repo, ref)) for name, ref in refs.items()}
    sources["checkout_2"] = lambda: dcp.FileSystemReader(str(out / "checkout-2"))
    report = {}
    for name, reader in sources.items():
        model, optimizer = tiny(mesh)
        loaded = whole(restored(model, optimizer, reader()))
        expected = torch.load(out / f"full-{name[-1]}.pt", weights_only=True)
        report[f"differences_{name}"] = differences(loaded, expected)
    for name, reader in (("ours", sources["commit_2"]), ("theirs", lambda: dcp.FileSystemReader(str(out / "fs-2")))):
        model, optimizer = tiny(mesh)
        restored(model, optimizer, reader())
        report[f"resumed_{name}"] = train(model, optimizer, 3, seed=50 + rank)
    if os.environ.get("SHARED_REPO"):  # one launch less: the shared repository's save and load run here too
        report["shared"] = run_shared(os.environ["SHARED_REPO"], out, rank, mesh)
    return report


def run_shared(repo: str, out: Path, rank: int, mesh) -> dict:
    """A save and a load at 2 ranks on a shared repository (objects on S3, metadata on PostgreSQL)."""
    model, optimizer = tiny(mesh)
    train(model, optimizer, 2, seed=rank)
    sd = state(model, optimizer, 2)
    writer = CkptStorageWriter(repo, message="shared step 2", step=2)
    dcp.save(sd, storage_writer=writer)
    saved = whole(sd)
    if rank == 0:
        torch.save(saved, out / "full-shared.pt")
    box = [writer.commit_id]
    dist.broadcast_object_list(box, src=0)
    fresh_model, fresh_optimizer = tiny(mesh)
    loaded = whole(restored(fresh_model, fresh_optimizer, CkptStorageReader(repo, box[0])))
    return {"commit": box[0], "differences": differences(loaded, saved)}


def crash(repo: str, out: Path, rank: int, mesh) -> None:
    """One save that the rank with CKPT_CRASH_AT dies in; the others note their error and leave (exit 0)."""
    model, optimizer = tiny(mesh)
    train(model, optimizer, 1, seed=99)
    try:
        dcp.save(state(model, optimizer, 99), storage_writer=CkptStorageWriter(repo, message="never recorded"))
    except Exception as exc:  # its peer died: the save fails here, and the process group is gone
        (out / f"crash-rank{rank}.txt").write_text(repr(exc)[:4000])
        os._exit(0)
    os._exit(3)  # the save must not succeed


SCENARIOS = {"save4": run_save4, "load2": run_load2}


def main() -> None:
    scenario, repo, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    report = SCENARIOS[scenario](repo, out, rank, mesh)
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(report))
    if scenario == "load2" and os.environ.get("SHARED_REPO"):  # last, as it ends the job: a rank dies mid-save
        dist.barrier()
        crash(os.environ["SHARED_REPO"], out, rank, mesh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
