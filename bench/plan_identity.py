"""`python bench/plan_identity.py OUT.json [--quick]`: every lossy plan and stored object, as JSON.

Proves that a change to the lossy planner (ckptstore/policy) leaves what is stored unchanged. It
trains small models (AdamW from scratch, SGD with momentum, bfloat16 weights, a frozen-backbone
fine-tune, a slow full fine-tune, a measured-Fisher run, an ambiguous pairing and hand-made
edge cases), commits each run's checkpoints in order into a fresh repository per lossy level
and knob setting (so parents, residuals, keyframes and chains occur), and writes, per run and
level, every plan `plan_lossy` returned (floats as hex, dict order kept) and the sorted ids of
the objects the repository ends with. Objects are named by the blake3 of their bytes: equal id
sets mean byte-identical stores. Run it once per code version and compare the two files:

    PYTHONPATH=/work/baseline python bench/plan_identity.py /tmp/before.json
    PYTHONPATH=. python bench/plan_identity.py /tmp/after.json
    python bench/plan_identity.py --compare /tmp/before.json /tmp/after.json

It is run as a file (not `-m`) so that PYTHONPATH alone picks the code version under test; it
imports nothing from bench/ or tests/ for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

LEVELS: list[tuple[str, dict[str, Any]]] = [
    ("optimizer", {}), ("balanced", {}), ("extreme", {}),
    ("balanced", {"fine_grid": False}), ("balanced", {"frozen_step": 1.0}), ("balanced", {"codebooks": True}),
    ("balanced", {"fisher_allocation": False}), ("balanced", {"settled_step": 0.0}),
    ("balanced", {"fast_move": 0.0}), ("balanced", {"fine_drift": 0.0}), ("balanced", {"prune": 0.3}),
    ("extreme", {"max_chain": 2}), ("extreme", {"fast_residual_step": 0.0, "fast_keyframe_step": 0.0}),
    ("extreme", {"fine_moment_step": 0.0}), ("extreme", {"fine_v_levels_log2": None}),
    ("optimizer", {"min_elements": 64, "moment_min_elements": 64}),
]


class Net(torch.nn.Module):
    """An embedding, a norm and an MLP: the tensor kinds the planner tells apart."""

    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(self.embed(tokens)))))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ((tokens + 1) % 128).reshape(-1))


class Run:
    """A model and optimizer trained between checkpoints; `commit_args` go to every commit."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, live: bool = False,
                 calibrate: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
        self.live, self.calibrate, self.step = live, calibrate, 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            tokens = torch.randint(0, 96, (16, 8))  # tokens 96..127 never seen: embedding rows that stay put
            _loss(self.model, tokens).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step}

    def commit_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer} if self.live else {}
        if self.calibrate:
            batch = torch.randint(0, 96, (16, 8), generator=torch.Generator().manual_seed(7))
            args["calibration"] = lambda model: _loss(model, batch)
        return args


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _pretrained(dtype: torch.dtype = torch.float32) -> Net:
    _seeded(1)
    model = Net().to(dtype)
    warmup = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        _loss(model, torch.randint(0, 96, (16, 8))).backward()
        warmup.step()
        warmup.zero_grad()
    return model


def adamw_scratch(calibrate: bool = False) -> Run:
    _seeded(0)
    model = Net()
    return Run(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), live=calibrate,
               calibrate=calibrate)


def sgd_momentum() -> Run:
    _seeded(0)
    model = Net()
    return Run(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def adamw_bf16() -> Run:
    _seeded(0)
    model = Net().to(torch.bfloat16)
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), live=True)


def frozen_backbone() -> Run:
    model = _pretrained()
    for module in (model.embed, model.fc1):
        module.requires_grad_(False)
    head = [p for p in model.parameters() if p.requires_grad]
    return Run(model, torch.optim.AdamW(head, lr=1e-4))


def slow_finetune() -> Run:
    model = _pretrained()
    return Run(model, torch.optim.AdamW(model.parameters(), lr=1e-5), live=True)


class Ambiguous(torch.nn.Module):
    """Three same-shaped matrices, two trained: the shapes cannot say which, so pairing is uncertain."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64, bias=False) for _ in range(3))
        self.frozen = torch.nn.Linear(64, 128, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.one_hot(tokens % 64, 64).float()
        return self.frozen(self.c(self.b(self.a(x))))


def ambiguous() -> Run:
    _seeded(0)
    model = Ambiguous()
    model.b.requires_grad_(False)
    model.frozen.requires_grad_(False)
    return Run(model, torch.optim.AdamW([model.a.weight, model.c.weight], lr=1e-3))


RUNS: dict[str, Callable[[], Run]] = {
    "adamw_scratch": adamw_scratch, "sgd_momentum": sgd_momentum, "adamw_bf16": adamw_bf16,
    "frozen_backbone": frozen_backbone, "slow_finetune": slow_finetune,
    "measured_fisher": lambda: adamw_scratch(calibrate=True), "ambiguous": ambiguous,
}


def _t(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def edge_states(count: int) -> Iterator[dict[str, Any]]:
    """Hand-made states: optimizer before model, mixed moment dtypes, zeros, ints, two optimizers."""
    for k in range(count):
        drift = 1 + 0.01 * k
        yield {
            "optimizer": {"state": {
                0: {"step": torch.tensor(float(k + 1)), "exp_avg": _t((96, 64), 10 + k, torch.float16),
                    "exp_avg_sq": _t((96, 64), 20 + k).abs()},
                1: {"step": torch.tensor(float(k + 1)), "exp_avg": _t((64, 80), 30 + k) * 1e-3,
                    "exp_avg_sq": _t((64, 80), 40 + k).abs() * 1e-6},
                2: {"step": torch.tensor(float(k + 1)), "exp_avg": torch.zeros(80, 64),
                    "exp_avg_sq": torch.zeros(80, 64)}},
                "param_groups": [{"lr": 1e-3, "params": [0, 1, 2]}]},
            "model": {"w0": _t((96, 64), 1) * drift, "w1": _t((64, 80), 2) + 1e-4 * k,
                      "zeros": torch.zeros(80, 64), "ints": torch.arange(8192).reshape(128, 64) + k,
                      "bias": _t((64,), 3) * drift, "half": _t((64, 64), 4, torch.float16) * drift},
        }


def two_optimizers(count: int) -> Iterator[dict[str, Any]]:
    """Two optimizers' state (weights not paired) beside weights, one of them named like a step counter."""
    for k in range(count):
        yield {"model": {"w": _t((64, 96), 5) + 0.02 * k, "step": _t((64, 64), 6) + 0.02 * k},
               "opt_a": {"state": {0: {"exp_avg": _t((64, 96), 50 + k), "exp_avg_sq": _t((64, 96), 60 + k).abs()}}},
               "opt_b": {"state": {0: {"momentum_buffer": _t((64, 64), 70 + k)}}}}


def _code(value: Any) -> Any:
    """JSON for a plan field, exact: floats as hex, dicts as ordered pairs, base records by id and params."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, dict):
        return [[key, _code(item)] for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_code(item) for item in value]
    if hasattr(value, "depth") and hasattr(value, "id"):
        return {"record": value.id, "depth": value.depth, "codec": value.codec, "params": _code(value.params)}
    return {type(value).__name__: repr(value)}


def _plan_json(plans: dict[str, Any]) -> list[Any]:
    fields = ("codec", "params", "base", "sibling", "mask_from", "importance", "prune", "stage", "paced_by")
    return [[path, {name: _code(getattr(plan, name)) for name in fields}] for path, plan in plans.items()]


def _inputs_digest(state: Any) -> str:
    """A digest of a state's tensors, so that both code versions are shown to plan the same inputs."""
    from ckptstore.state import flatten

    digest = hashlib.sha256()
    for path, raw in flatten(state).tensors.items():
        digest.update(f"{path}|{raw.dtype}|{raw.shape}|".encode())
        digest.update(bytes(raw.data))
    return digest.hexdigest()


def commit_all(states: list[tuple[dict[str, Any], dict[str, Any]]], level: str, knobs: dict[str, Any],
               scratch: Path) -> dict[str, Any]:
    """Commit `states` in order into a fresh repository; every plan made, and the objects stored."""
    from ckptstore import Repository
    from ckptstore.policy import lossy
    from ckptstore.repo import repository

    made: list[Any] = []
    original = lossy.plan_lossy
    # today commit imports plan_lossy from policy.lossy when it runs; older code bound it in repository.py
    holders = [module for module in (lossy, repository) if getattr(module, "plan_lossy", None) is original]

    def recording(*args: Any, **kwargs: Any) -> Any:
        plans = original(*args, **kwargs)
        made.append(_plan_json(plans))
        return plans

    for module in holders:
        module.plan_lossy = recording
    try:
        with Repository.init(scratch) as repo:
            for state, args in states:
                if level == "optimizer":  # weights stay lossless: a calibration loss is refused
                    args = {k: v for k, v in args.items() if k != "calibration"}
                repo.commit(state, lossy=level, **knobs, **args)
            objects = sorted(repo.store.iter_ids())
    finally:
        for module in holders:
            module.plan_lossy = original
    return {"plans": made, "objects": objects}


def run_states(name: str, count: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """`count` checkpoints of a run, a few training steps apart, with the arguments of their commits."""
    if name == "edge_cases":
        return [(state, {}) for state in edge_states(count)]
    if name == "two_optimizers":
        return [(state, {}) for state in two_optimizers(count)]
    run = RUNS[name]()
    states = []
    for _ in range(count):
        run.train(3)
        states.append((run.state(), run.commit_args()))
    return states


def main(out: Path, quick: bool) -> None:
    import ckptstore

    print(f"ckptstore from {ckptstore.__file__}", file=sys.stderr)
    torch.set_num_threads(1)  # the same training steps, bit for bit, in every run
    count = 2 if quick else 4
    levels = LEVELS[:3] if quick else LEVELS
    report: dict[str, Any] = {}
    for name in [*RUNS, "edge_cases", "two_optimizers"]:
        for level, knobs in levels:
            # States are rebuilt per level: a commit with a live model must see that model's own state.
            states = run_states(name, count)
            key = f"{name}/{level}" + "".join(f",{k}={v}" for k, v in knobs.items())
            with tempfile.TemporaryDirectory() as scratch:
                result = commit_all(states, level, knobs, Path(scratch))
            result["inputs"] = [_inputs_digest(state) for state, _ in states]
            report[key] = result
            print(f"{key}: {len(result['objects'])} objects, {sum(len(p) for p in result['plans'])} plans",
                  file=sys.stderr)
    out.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")


def compare(before: Path, after: Path) -> int:
    """Print which runs and levels differ in their inputs, plans or objects; 0 when none does."""
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    differ = sorted(set(old) ^ set(new))
    for key in sorted(set(old) & set(new)):
        fields = [name for name in ("inputs", "plans", "objects") if old[key][name] != new[key][name]]
        if fields:
            differ.append(f"{key}: {', '.join(fields)}")
    for line in differ:
        print(f"differs: {line}")
    plans = sum(len(commit) for run in old.values() for commit in run["plans"])
    objects = sum(len(run["objects"]) for run in old.values())
    print(f"{len(old)} repositories, {plans} plans, {objects} objects: "
          + ("identical" if not differ else f"{len(differ)} differ"))
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    main(Path(sys.argv[1]), "--quick" in sys.argv[2:])
