"""`python -m bench.dcp_plan_shards DCP_DIR [--level L] [--worlds 2 4 8 64]`: what planning per shard would change.

A lossy sharded commit plans every shard with its whole tensor's statistics (policy/lossy_shards.py),
gathered across ranks by CkptSavePlanner. This measures what the simpler alternative, each rank
planning its shards from its own statistics, would do to the same checkpoint: the checkpoint (a
DCP directory, e.g. one of `bench.dcp`'s) is split by rows into N shards per tensor (FSDP2's
layout), and each rank's shards are planned with facts from that rank's shards only. Printed per
world size: the shards whose plan differs from the whole-tensor plan, how many change role
(quantized or not, fast-moving or not), and the largest relative change of a weight's step.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.formats.dcpmeta import shard_key
from ckptstore.policy import EncodingSettings, level_named
from ckptstore.policy.lossy_shards import Shard, ShardStats, combine, plan_shards
from ckptstore.state import RawTensor, raw_from_torch

MEASURED = {"rel_error", "chunk_steps", "source", "base_error"}


def _flat(state: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, list) and name.endswith("param_groups"):
            for i, group in enumerate(value):
                out.update({f"{name}.{i}.{k}": v for k, v in group.items()})
        else:
            out[name] = value
    return out


def _shards(tensors: dict[str, Any], world: int) -> list[dict[str, tuple[Shard, RawTensor]]]:
    """Each rank's row shards (torch.chunk over dim 0, as FSDP2 splits), by shard key."""
    ranks: list[dict[str, tuple[Shard, RawTensor]]] = [{} for _ in range(world)]
    for fqn, tensor in tensors.items():
        pieces = tensor.chunk(world, dim=0) if tensor.dim() else [tensor]
        start = 0
        for rank, piece in enumerate(pieces):
            offsets = (start,) + (0,) * (tensor.dim() - 1) if tensor.dim() else ()
            shard = Shard(fqn, offsets, tuple(piece.shape))
            ranks[rank][shard_key(fqn, list(offsets), list(piece.shape))] = (shard, raw_from_torch(piece.contiguous(),
                                                                                                    fqn))
            start += piece.shape[0] if tensor.dim() else 0
    return ranks


def _stats(raw: RawTensor) -> ShardStats | None:
    from ckptstore.codecs.floats import LOSSY_DTYPES, to_float32

    if raw.dtype not in LOSSY_DTYPES or raw.nbytes == 0:
        return None
    x = to_float32(raw.data, raw.dtype).astype(np.float64)
    return ShardStats(float(np.dot(x, x)), float(x.sum()), int(x.size))


def _plans(rank: dict, stats_of: dict, dtypes: dict, sizes: dict, lrs: dict, level: Any) -> dict[str, tuple]:
    facts = combine(stats_of, dtypes, sizes, lrs, level)
    plans, roles = plan_shards({k: r for k, (_, r) in rank.items()}, {k: s for k, (s, _) in rank.items()}, facts,
                               {}, level, EncodingSettings())
    return {k: (roles[k].value, plans[k].params if k in plans else {}) for k in roles}


def compare(state: dict, world: int, level_name: str) -> dict[str, Any]:
    """Per-shard against whole-tensor planning of `state` split over `world` ranks."""
    import torch

    flat = _flat(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    lrs = {}
    for key, value in flat.items():
        if key.endswith(".params") and f"{key[:-7]}.lr" in flat:
            lrs.update({p: float(flat[f"{key[:-7]}.lr"]) for p in value})
    level = level_named(level_name)
    dtypes = {k: str(v.dtype) for k, v in tensors.items()}
    sizes = {k: tuple(v.shape) for k, v in tensors.items()}
    ranks = _shards(tensors, world)
    every = {s: st for rank in ranks for k, (s, r) in rank.items() if (st := _stats(r)) is not None}
    differ = roles = total = 0
    worst = 0.0
    for rank in ranks:
        own = {s: every[s] for _, (s, _) in rank.items() if s in every}
        own_sizes = {s.fqn: s.sizes for _, (s, _) in rank.items()}  # a rank alone sees only its shard's size
        whole, alone = _plans(rank, every, dtypes, sizes, lrs, level), _plans(rank, own, dtypes, own_sizes, lrs, level)
        for key, (role, params) in whole.items():
            total += 1
            other_role, other = alone[key]
            roles += role != other_role
            keep = lambda p: {k: v for k, v in p.items() if k not in MEASURED}  # noqa: E731
            differ += keep(params) != keep(other)
            if role == other_role and "step" in params and params["step"] and "step" in other:
                worst = max(worst, abs(other["step"] / params["step"] - 1))
    return {"world": world, "shards": total, "plans_differ": differ, "roles_differ": roles,
            "worst_step_change": None if math.isnan(worst) else worst}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dcp_plan_shards")
    parser.add_argument("dcp_dir")
    parser.add_argument("--level", default="balanced")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 64])
    args = parser.parse_args()
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(args.dcp_dir, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)  # written just now from a DCP folder
    for world in args.worlds:
        print(json.dumps(compare(state, world, args.level)), flush=True)


if __name__ == "__main__":
    main()
