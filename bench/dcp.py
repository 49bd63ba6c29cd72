"""`python -m bench.dcp`: ckptstore as a DCP storage backend against DCP's own FileSystemWriter.

Real ranks (gloo on the CPU, one process each) train an FSDP2 model of 12 blocks of
Linear(2048, 2048) + LayerNorm (50.4M parameters) with AdamW, twice: a fine-tune-like run
(lr 2e-5, each step moves a weight ~0.1% of its spread) and a from-scratch one (lr 5e-4). Every
`--every` steps the same state is saved by each method, in an order rotated per checkpoint, with
the page cache flushed of dirty data before each (every method fsyncs):
- ckptstore: `CkptStorageWriter(repo)`, one commit per save (lossless unless `--lossy LEVEL`
  adds a lossy repository as a fourth method);
- fsw: `FileSystemWriter(dir)`, DCP's default; fsw+zstd: the same with its ZStandard extension.
Measured: stored bytes, `dcp.save` wall time, `dcp.async_save` blocking time (the call's return;
its own process group), and load time at the same world size (4 ranks) and at 2 and 1 (separate
launches that also load the 4-rank saves; the median of three loads each, in rotated order).
Rank scaling: the fine-tune's last two states, loaded at 1, 2 and 4 ranks, committed to a fresh
repository each: seconds per commit, bytes per rank.

    python -m bench.dcp [--checkpoints 8] [--every 3] [--lossy balanced] [--json FILE] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RUNS = {"finetune": 2e-5, "scratch": 5e-4}  # AdamW learning rate per run
WIDTH, BLOCKS, BATCH = 2048, 12, 16
ASYNC_AT = (3, 6)  # checkpoints where async_save's blocking time is measured too (the last, in shorter runs)
LOAD_ROUNDS = 3  # loads of each method, in rotated order; the median is reported
SCALING = (4, 2, 1)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.dcp", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoints", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="training steps between checkpoints")
    parser.add_argument("--lossy", default=None, help="also commit every state at this lossy level")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--work", default=None, help="working folder (default: a temporary one, removed)")
    parser.add_argument("--width", type=int, default=2048, help="block width (2048: 50.4M parameters)")
    parser.add_argument("--rank-phase", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- inside a rank -------------------------------------------------------------------------------

def _build(mesh: Any, seed: int = 0) -> tuple[Any, Any]:
    """The FSDP2 model (each block sharded on its own) and its AdamW optimizer."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)) for _ in range(BLOCKS)]
    model = torch.nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: Any, optimizer: Any, lr: float, steps: int, first: int) -> None:
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
    for step in range(first, first + steps):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
        (model(x) - x.roll(1, dims=1)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    """Seconds `fn(*args, **kwargs)` takes on every rank (barriers around it), after flushing dirty pages."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def _writers(work: Path, run: str, i: int, lossy: str | None) -> list[tuple[str, Any, Any]]:
    """(method, make writer, planner) for checkpoint `i`, rotated by `i` so no method always goes first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from ckptstore.dcp import CkptSavePlanner, CkptStorageWriter

    methods = [("ckptstore", lambda: CkptStorageWriter(work / run / "repo", message=f"ckpt {i}", step=i), None),
               ("fsw", lambda: dcp.FileSystemWriter(work / run / "fsw" / str(i)), None),
               ("fsw+zstd", lambda: dcp.FileSystemWriter(work / run / "zstd" / str(i), _extensions=[ZStandard()]),
                None)]
    if lossy:
        methods.append((f"ckptstore {lossy}", lambda: CkptStorageWriter(work / run / "lossy", message=f"ckpt {i}",
                                                                          step=i, lossy=lossy), CkptSavePlanner()))
    return methods[i % len(methods):] + methods[: i % len(methods)]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _async_blocking(state: dict, writer: Any, pg: Any) -> tuple[float, float]:
    """(seconds async_save blocked the caller, seconds until its future completed), max over ranks."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    start = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer, process_group=pg)
    blocked = time.perf_counter() - start
    future.result()
    done = torch.tensor([blocked, time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return float(done[0]), float(done[1])


def _run(work: Path, run: str, mesh: Any, pg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One training run: every checkpoint saved by every method; times, FSW sizes, async blocking."""
    import torch.distributed as dist

    from ckptstore.dcp import CkptStorageWriter

    model, optimizer = _build(mesh)
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {"fsw": 0, "fsw+zstd": 0}
    blocking: dict[str, list[list[float]]] = {"ckptstore": [], "fsw": []}
    for i in range(args.checkpoints):
        trained = _timed(_train, model, optimizer, RUNS[run], args.every, i * args.every)
        state = _state(model, optimizer)
        for method, make, planner in _writers(work, run, i, args.lossy):
            times.setdefault(method, []).append(_timed(_save, state, make(), planner))
        _progress(work, f"{run} {i}: train {trained:.1f} s, " + ", ".join(f"{m} {t[-1]:.1f} s"
                                                                          for m, t in times.items()))
        if dist.get_rank() == 0:  # FSW's folders, measured and then dropped but for the last two (disk)
            for method, folder in (("fsw", "fsw"), ("fsw+zstd", "zstd")):
                sizes[method] += _dir_bytes(work / run / folder / str(i))
                if i >= 2:
                    shutil.rmtree(work / run / folder / str(i - 2))
        if i in {min(at, args.checkpoints - 1) for at in ASYNC_AT}:  # `--checkpoints 2` printed an empty table
            import torch.distributed.checkpoint as dcp

            blocking["ckptstore"].append(_async_blocking(state, CkptStorageWriter(work / run / "async-repo"), pg))
            blocking["fsw"].append(_async_blocking(state, dcp.FileSystemWriter(work / run / "async-fsw"), pg))
    return {"save_seconds": times, "fsw_bytes": sizes, "async": blocking,
            "load": _loads(work, run, mesh, args.checkpoints - 1)}


def _progress(work: Path, line: str) -> None:
    """One line of rank 0's progress in WORK/progress.log (the launcher shows output only at the end)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(work / "progress.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def _save(state: dict, writer: Any, planner: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=writer, planner=planner)


def _loads(work: Path, run: str, mesh: Any, last: int) -> dict[str, Any]:
    """Seconds to load the run's last checkpoint from each method at this world size; whether ckptstore's is exact."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import CkptStorageReader

    model, optimizer = _build(mesh, seed=1)
    template = _state(model, optimizer)
    readers = [("ckptstore", lambda: CkptStorageReader(work / run / "repo", "main")),
               ("fsw", lambda: dcp.FileSystemReader(work / run / "fsw" / str(last))),
               ("fsw+zstd", lambda: dcp.FileSystemReader(work / run / "zstd" / str(last)))]
    times: dict[str, list[float]] = {method: [] for method, _ in readers}
    loaded = {}
    for turn in range(LOAD_ROUNDS):  # one load each is 0.3-0.8 s here: a single one moved ratios by a third
        for method, make in readers[turn % len(readers):] + readers[:turn % len(readers)]:
            times[method].append(_timed(dcp.load, template, storage_reader=make()))
            loaded[method] = {k: v.to_local().clone() for k, v in _tensors(template)}
    seconds = {method: statistics.median(t) for method, t in times.items()}
    same = all(torch.equal(loaded["ckptstore"][k].view(torch.uint8), v.view(torch.uint8))
               for k, v in loaded["fsw"].items())
    flag = torch.tensor([0 if same else 1])
    dist.all_reduce(flag)
    _progress(work, f"{run} loads at {dist.get_world_size()}: {seconds}")
    return {"seconds": seconds, "exact": int(flag) == 0}


def _tensors(state: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, DTensor) for every DTensor in a nested state."""
    found = []
    for key, value in state.items():
        if isinstance(value, dict):
            found += _tensors(value, f"{prefix}{key}.")
        elif hasattr(value, "to_local"):
            found.append((f"{prefix}{key}", value))
    return found


def _scaling(work: Path, mesh: Any, last: int) -> list[dict[str, Any]]:
    """The fine-tune's last two states, loaded at this world size and committed to a fresh repository."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore import Repository
    from ckptstore.dcp import CkptStorageWriter

    world = dist.get_world_size()
    repo = work / f"scale-{world}"
    if dist.get_rank() == 0:
        Repository.init(repo).close()
    model, optimizer = _build(mesh, seed=2)
    template = _state(model, optimizer)
    rows = []
    for i in (last - 1, last):
        dcp.load(template, storage_reader=dcp.FileSystemReader(work / "finetune" / "fsw" / str(i)))
        writer = _timed_writer(CkptStorageWriter)(repo, message=f"ckpt {i}")
        seconds = _timed(dcp.save, template, storage_writer=writer)
        per_rank: list[int] = [0] * world
        dist.all_gather_object(per_rank, writer.bytes_written)
        finish = [0.0] * world
        dist.all_gather_object(finish, writer.finish_seconds)
        rows.append({"checkpoint": i, "seconds": seconds, "bytes_per_rank": per_rank, "finish_seconds": max(finish)})
        _progress(work, f"scaling at {world}: {rows[-1]}")
    return rows


def _timed_writer(base: type) -> type:
    """`base` with the coordinator's `finish` (manifest and the one metadata transaction) timed."""

    class Timed(base):
        finish_seconds = 0.0

        def finish(self, metadata: Any, results: Any) -> None:
            start = time.perf_counter()
            super().finish(metadata, results)
            self.finish_seconds = time.perf_counter() - start

    return Timed


def _commit_shape(path: Path) -> dict[str, int]:
    """What the last commit of a repository holds: entries, new records, chunk rows, objects, manifest bytes."""
    from ckptstore import Repository
    from ckptstore.metadata import tensors as tensor_rows

    with Repository.open(path, read_only=True) as repo:
        head = repo.commit_info("HEAD")
        manifest = repo.manifest(head.id)
        parent = set() if not head.parents else {e.tensor for e in repo.manifest(head.parents[0]).entries.values()}
        with repo.db.read() as tx:
            records = tensor_rows.load_records(tx, {e.tensor for e in manifest.entries.values()}, with_bases=False)
        new = [r for tid, r in records.items() if tid not in parent]
        return {"entries": len(manifest.entries), "new_records": len(new),
                "new_chunk_rows": sum(len(r.chunks) for r in new),
                "new_objects": len({c.object_id for r in new for c in r.chunks}) + 1,
                "manifest_bytes": len(repo.store.get(head.manifest_object)), "raw_bytes": head.raw_bytes}


def _rank_main(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ckptstore import Repository

    global WIDTH
    WIDTH = args.width
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    async_pg = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    work, report = Path(args.work), {}
    if args.rank_phase == "runs":
        for run in RUNS:
            if rank == 0:
                for name in ("repo", "async-repo", "lossy"):
                    Repository.init(work / run / name).close()
            dist.barrier()
            report[run] = _run(work, run, mesh, async_pg, args)
    else:
        report["load"] = {run: _loads(work, run, mesh, args.checkpoints - 1) for run in RUNS}
    report["scaling"] = _scaling(work, mesh, args.checkpoints - 1)
    if rank == 0:
        (work / f"{args.rank_phase}-{world}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# ---- the launcher --------------------------------------------------------------------------------

def _launch(phase: str, world: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run `phase` on `world` ranks (like torchrun); rank 0's report."""
    from ckptstore.testing.net import free_port

    port = free_port()
    root = Path(__file__).resolve().parents[1]
    extra = ["--checkpoints", str(args.checkpoints), "--every", str(args.every), "--width", str(args.width)]
    extra += ["--lossy", args.lossy] if args.lossy else []
    procs = [subprocess.Popen([sys.executable, "-m", "bench.dcp", "--rank-phase", phase, "--work", str(work), *extra],
                              cwd=root, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world),
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                                                 PYTHONPATH=str(root)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    outputs = [p.communicate()[0].decode(errors="replace") for p in procs]
    for proc, output in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"bench.dcp: a rank of `{phase}` at {world} failed:\n{output[-6000:]}")
    return json.loads((work / f"{phase}-{world}.json").read_text())


def _stored(work: Path, run: str, name: str) -> int:
    from ckptstore import Repository

    with Repository.open(work / run / name, read_only=True) as repo:
        figures = repo.stats()
    return int(figures["objects_bytes"] + figures["metadata_bytes"])


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.rank_phase:
        return _rank_main(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-dcp-"))
    started = time.perf_counter()
    try:
        result: dict[str, Any] = {"runs": _launch("runs", 4, work, args)}
        result["reshard"] = {w: _launch("reshard", w, work, args) for w in SCALING[1:]}
        for run in RUNS:
            result["runs"][run]["stored"] = {"ckptstore": _stored(work, run, "repo"),
                                             **result["runs"][run].pop("fsw_bytes")}
            if args.lossy:
                result["runs"][run]["stored"][f"ckptstore {args.lossy}"] = _stored(work, run, "lossy")
        result["shape"] = {w: _commit_shape(work / f"scale-{w}") for w in SCALING}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = time.perf_counter() - started
    result["args"] = {"checkpoints": args.checkpoints, "every": args.every, "lossy": args.lossy,
                      "parameters": BLOCKS * (args.width * args.width + 3 * args.width)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    from bench.dcp_report import tables

    print(tables(result))
    return None


if __name__ == "__main__":
    main()
