"""`CkptSavePlanner`: DCP's default save planner, plus what a lossy sharded commit must know of whole tensors.

A lossy plan depends on statistics of the whole tensor (policy/lossy_shards.py), which no rank
holds; the storage writer sees only plans, never data, before ranks write. So each rank's
planner sums its own shards into its local plan's `storage_data`; the coordinator's
CkptStorageWriter combines them in `prepare_global_plan` and sends every rank the same facts.
Replicated items (step counters, plain tensors) go to the lowest rank, so which rank writes a
tensor and its optimizer state does not depend on the plans' sizes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ckptstore.codecs.floats import LOSSY_DTYPES
from ckptstore.policy.lossy_shards import shard_sample

STATS_KEY = "ckptstore-shard-stats"
_GROUP_FIELD = re.compile(r"^((?:.*\.)?param_groups\.\d+)\.(lr|params)$")
_GROUPS = re.compile(r"^(?:.*\.)?param_groups$")


class CkptSavePlanner(DefaultSavePlanner):
    """Pass as `planner=` to `dcp.save` / `dcp.async_save` with a lossy `CkptStorageWriter`."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("dedup_save_to_lowest_rank", True)
        super().__init__(**kwargs)

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, with this rank's shard sums and learning rates in `storage_data`."""
        plan = super().create_local_plan()
        stats = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            tensor = self.lookup_object(item.index)
            if hasattr(tensor, "to_local"):
                tensor = tensor.to_local()
            if str(tensor.dtype) not in LOSSY_DTYPES or tensor.numel() == 0:
                continue
            values = tensor.detach().reshape(-1).to(torch.float64)
            chunk = item.tensor_data.chunk
            sample = shard_sample(values.numpy(), chunk.offsets, chunk.sizes, item.tensor_data.size)
            stats.append([item.index.fqn, list(chunk.offsets), list(chunk.sizes), float(torch.dot(values, values)),
                          float(values.sum()), int(values.numel()), [list(sample), list(sample.values())]])
        self.plan = dataclasses.replace(plan, storage_data={STATS_KEY: stats, "lrs": self._lrs()})
        return self.plan

    def _lrs(self) -> dict[str, float]:
        """Each parameter's learning rate, from `param_groups` in get_state_dict's FQN form.

        DCP flattens it to `PREFIX.param_groups.N.lr` and `PREFIX.param_groups.N.params` (or keeps
        `PREFIX.param_groups` whole, as a list of groups, where its flattening does not reach lists).
        """
        groups: dict[str, dict[str, Any]] = {}
        for key, value in self.state_dict.items():
            match = _GROUP_FIELD.match(key)
            if match:
                groups.setdefault(match.group(1), {})[match.group(2)] = value
            elif _GROUPS.match(key) and isinstance(value, list):
                groups.update({f"{key}.{i}": g for i, g in enumerate(value) if isinstance(g, dict)})
        found: dict[str, float] = {}
        for group in groups.values():
            lr = group.get("lr")
            lr = float(lr) if isinstance(lr, torch.Tensor) else lr
            if isinstance(lr, (int, float)) and not isinstance(lr, bool) and isinstance(group.get("params"), list):
                found.update({p: float(lr) for p in group["params"] if isinstance(p, str)})
        return found
