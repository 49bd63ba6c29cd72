"""One rank of the DCP tests' real multi-process runs (launched like torchrun: RANK, WORLD_SIZE, MASTER_PORT).

    python -m tests.dcp.worker SCENARIO REPO OUT

`train`: an FSDP2 model with AdamW, trained between two commits, each also saved with DCP's own
FileSystemWriter; then both commits loaded back at this world size and compared bit for bit with
what was saved; then an unevenly sharded DTensor state on branch `uneven`. First it loads
branch `full` (saved from one process by the test) into row shards. `load-uneven`: branch `uneven`
loaded at another world size. `crash`: one save of a
DTensor state (the launcher sets CKPT_CRASH_AT for one rank). `measure-save`, `measure-load`:
save 64 MiB of row-sharded tensors, load them at another world size and report the bytes read.
Each rank writes OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckptstore import Repository
from ckptstore.dcp import CkptStorageReader, CkptStorageWriter


def flat(value, path: str = "") -> dict:
    """Nested state as {path: local tensor or value}; a DTensor becomes this rank's shard."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{path}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{path}/{i}").items()}
    if isinstance(value, DTensor):
        return {path: value.to_local().detach().clone()}
    if isinstance(value, torch.Tensor):
        return {path: value.detach().clone()}
    return {path: value}


def differences(a: dict, b: dict) -> list[str]:
    """Paths where two flat states differ (tensors compared by dtype, shape and raw bytes)."""
    bad = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(raw(x), raw(y))):
                bad.append(key)
        elif x != y:
            bad.append(key)
    return bad


def model_and_optimizer(mesh, widths: tuple[int, int, int] = (64, 129, 32), lr: float = 1e-4):
    """A two-layer MLP (odd hidden width: uneven row shards) under FSDP2, seeded, with AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
                                torch.nn.Linear(widths[1], widths[2]))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train(model, optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(8, 64, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def state(model, optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "extra": {"step": step, "note": "fsdp2 adamw"}}


def uneven_state(mesh) -> dict:
    """DTensors split unevenly over the ranks (7 rows, 9 columns), a replicated tensor and plain data."""
    return {"rows": distribute_tensor(torch.arange(35, dtype=torch.float32).reshape(7, 5), mesh, [Shard(0)]),
            "cols": distribute_tensor(torch.arange(27, dtype=torch.int64).reshape(3, 9), mesh, [Shard(1)]),
            "bias": torch.linspace(0, 1, 6, dtype=torch.bfloat16), "meta": {"name": "uneven", "sizes": [7, 3]}}


def full_state(step: int) -> dict:
    """Whole tensors saved from one process (branch `full`), several 4 KiB chunks each; they move a little per step."""
    generator = torch.Generator().manual_seed(5)
    big, wide = torch.randn(256, 64, generator=generator), torch.randn(64, 256, generator=generator)
    return {"big": big + step * 1e-6, "wide": wide + step * 1e-6}


def load_full_resharded(repo: str, mesh) -> dict:
    """Branch `full` loaded into row shards at this world size: differences and bytes replayed."""
    template = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full_state(0).items()}
    reader = CkptStorageReader(repo, "full")
    dcp.load(template, storage_reader=reader)
    expected = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state(2).items()}
    return {"differences_full": differences(flat(template), flat(expected)), "replayed_full": reader.bytes_replayed}


def run_train(repo: str, out: Path, rank: int, mesh) -> dict:
    model, optimizer = model_and_optimizer(mesh)
    saved, report = {}, load_full_resharded(repo, mesh)
    for step, label in ((2, "first"), (4, "second")):
        train(model, optimizer, 2, seed=step + rank)
        sd = state(model, optimizer, step)
        writer = CkptStorageWriter(repo, message=f"{label} save", step=step, metrics={"loss": float(step)})
        dcp.save(sd, storage_writer=writer)
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out / f"reference-{label}")))
        saved[label] = flat(sd)
        report[f"commit_{label}"] = writer.commit_id
    for label in ("first", "second"):
        fresh_model, fresh_optimizer = model_and_optimizer(mesh)
        target = state(fresh_model, fresh_optimizer, 0)
        ref = report[f"commit_{label}"] or ""
        dist.broadcast_object_list(box := [ref], src=0)
        dcp.load(target, storage_reader=CkptStorageReader(repo, box[0]))
        report[f"differences_{label}"] = differences(flat(target), saved[label])
    writer = CkptStorageWriter(repo, branch="uneven", message="uneven shards")
    dcp.save(uneven_state(mesh), storage_writer=writer)
    report["commit_uneven"] = writer.commit_id
    return report


def load_uneven(repo: str, mesh) -> dict:
    """Branch `uneven` (saved at two ranks) loaded into this world size's shards: the differences."""
    template = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, v.placements) if isinstance(v, DTensor)
                else v for k, v in uneven_state(mesh).items()}
    template["bias"], template["meta"] = torch.zeros(6, dtype=torch.bfloat16), {"name": "", "sizes": [0, 0]}
    dcp.load(template, storage_reader=CkptStorageReader(repo, "uneven"))
    local = {k: v.to_local().shape[0] if k == "rows" else v.to_local().shape[1] for k, v in template.items()
             if isinstance(v, DTensor)}
    return {"differences": differences(flat(template), flat(uneven_state(mesh))), "local_sizes": local}


def measured_state(mesh) -> dict:
    """Four 16 MiB float32 tensors split by rows (the `measure` scenarios: bytes read when resharding)."""
    return {f"layer{i}": distribute_tensor(torch.randn(4096, 1024, generator=torch.Generator().manual_seed(i)),
                                           mesh, [Shard(0)]) for i in range(4)}


def run_measure(repo: str, rank: int, mesh, save: bool) -> dict:
    """`measure-save`: save `measured_state` on branch `measure`; `measure-load`: load it into row shards.

    Loading reports the bytes this rank read (rchar) and the bytes it replayed, and whether it matched.
    """
    if save:
        dcp.save(measured_state(mesh), storage_writer=CkptStorageWriter(repo, branch="measure"))
        return {}
    opened = Repository.open(repo, read_only=True)
    mapped = [0]  # whole objects are memory-mapped, which rchar does not see: count the mapped sizes
    view = opened.store.view

    def counted_view(oid, verify=True):
        data = view(oid, verify)
        mapped[0] += len(data)
        return data

    opened.store.view = counted_view
    reader = CkptStorageReader(opened, "measure")
    template = {k: distribute_tensor(torch.zeros(4096, 1024), mesh, [Shard(0)]) for k in measured_state(mesh)}
    before = _read_bytes()
    dcp.load(template, storage_reader=reader)
    read = _read_bytes() - before + mapped[0]
    return {"read_bytes": read, "replayed_bytes": reader.bytes_replayed,
            "differences": differences(flat(template), flat(measured_state(mesh)))}


def _read_bytes() -> int:
    """Bytes this process read through read(2) and friends so far (/proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    scenario, repo, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    started = time.monotonic()
    if scenario == "train":
        report = run_train(repo, out, rank, mesh)
    elif scenario == "load-uneven":
        report = load_uneven(repo, mesh)
    elif scenario.startswith("measure"):
        report = run_measure(repo, rank, mesh, save=scenario == "measure-save")
    else:
        model, optimizer = model_and_optimizer(mesh)
        train(model, optimizer, 1, seed=99)
        dcp.save(state(model, optimizer, 99), storage_writer=CkptStorageWriter(repo, message="never recorded"))
        report = {}
    report["seconds"] = time.monotonic() - started
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
