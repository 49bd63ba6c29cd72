"""The benchmark zoo: seven more small training runs, held back from tuning the lossy presets.

A lossy level must keep its promise on runs nobody tuned it on (issue 22). The zoo splits the runs in two
halves: `TUNED`, the six runs of bench/workloads.py whose checkpoints chose every preset value, and
`HELD_BACK`, the runs defined here. Presets may be tuned on TUNED only; HELD_BACK is where a level shows
whether it generalises, so no preset value may be chosen by looking at these runs' results.

Every run is offline and deterministic (synthetic data from seeded generators, or the standard library's
own sources as bytes), saves eight torch.save checkpoints with model, optimizer, scheduler, step and RNG,
and has a learning-rate schedule that spans the run plus the 100-step resume test.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bench.workloads import WORKLOADS, MiniLMFineTune, ScratchLM, State, TinyGPT, Workload, byte_corpus

TUNED = ("scratch-fp32", "scratch-bf16", "sgd-momentum", "minilm-finetune", "minilm-frozen", "trainer-gpt2")
HELD_BACK = ("mlp-tour", "cnn-bn", "gru-lm", "vit-tiny", "gpt-hot", "gpt-linear", "lora-minilm")
CLASSES = 10
EVAL_SEED = 10**6  # eval batches come from generators seeded far from every training step's


# ----------------------------------------------------------------- learning-rate schedules
def schedule(kind: str, total: int, warmup: int) -> Callable[[int], float]:
    """The multiplier of the peak lr at step s: linear warmup, then cosine, linear or constant."""
    def factor(s: int) -> float:
        ramp = min(1.0, (s + 1) / warmup)
        done = min(s, total) / total
        if kind == "cosine":
            return ramp * 0.5 * (1 + math.cos(math.pi * done))
        if kind == "linear":
            return ramp * max(0.0, 1 - done)
        return ramp

    return factor


def scheduled(workload: Workload, optimizer: torch.optim.Optimizer, kind: str) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over the workload's horizon with a tenth of its saved steps as warmup."""
    warmup = max(1, workload.total_steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(kind, workload.horizon, warmup))


def generator(step: int, split: str) -> torch.Generator:
    return torch.Generator().manual_seed(step + (EVAL_SEED if split == "eval" else 0))


def noisy_labels(labels: torch.Tensor, rate: float, gen: torch.Generator) -> torch.Tensor:
    """Replace a `rate` share of labels by random ones, so the loss has a floor and never reaches zero."""
    flip = torch.rand(labels.shape, generator=gen) < rate
    return torch.where(flip, torch.randint(0, CLASSES, labels.shape, generator=gen), labels)


class Classifier(Workload):
    """A classification run: cross-entropy on (inputs, labels) batches."""

    lr, schedule_kind, batch_size = 1e-3, "cosine", 64

    def model(self) -> torch.nn.Module:
        raise NotImplementedError

    def build(self) -> State:
        model = self.model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)
        return State(model, optimizer, scheduled(self, optimizer, self.schedule_kind))

    def loss(self, model, batch) -> torch.Tensor:
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(model(inputs), labels)


# ----------------------------------------------------------------- mlp-tour
class MLPTour(Classifier):
    name = "mlp-tour"
    description = "MLP 64-256-256-10 (85K parameters), AdamW lr 1e-3, warmup + cosine, fp32"

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        torch.manual_seed(1234)  # a fixed random teacher labels the Gaussian inputs
        self.teacher = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, CLASSES))

    def model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                   torch.nn.ReLU(), torch.nn.Linear(256, CLASSES))

    @torch.no_grad()
    def batch(self, step: int, split: str = "train"):
        gen = generator(step, split)
        inputs = torch.randn(self.batch_size, 64, generator=gen)
        return inputs, noisy_labels(self.teacher(inputs).argmax(1), 0.1, gen)


# ----------------------------------------------------------------- synthetic images
class Images(Classifier):
    """1x16x16 images: one of ten fixed random templates, shifted by up to 3 pixels, plus noise."""

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        templates = torch.randn(CLASSES, 1, 20, 20, generator=torch.Generator().manual_seed(7))
        self.templates = torch.nn.functional.avg_pool2d(templates, 3, 1, 1) * 2  # smooth: shapes, not pixels

    def batch(self, step: int, split: str = "train"):
        gen = generator(step, split)
        labels = torch.randint(0, CLASSES, (self.batch_size,), generator=gen)
        dx, dy = torch.randint(0, 5, (2, self.batch_size), generator=gen).tolist()
        crops = [self.templates[c, :, y : y + 16, x : x + 16] for c, x, y in zip(labels.tolist(), dx, dy)]
        images = torch.stack(crops) + torch.randn(self.batch_size, 1, 16, 16, generator=gen)
        return images, noisy_labels(labels, 0.05, gen)


class CNNBatchNorm(Images):
    name = "cnn-bn"
    description = "CNN 2 conv (16, 32 channels) + BatchNorm2d + linear (10K parameters), AdamW lr 1e-3, cosine, fp32"

    def model(self) -> torch.nn.Module:
        def stage(cin: int, cout: int) -> list[torch.nn.Module]:
            return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                    torch.nn.MaxPool2d(2)]

        return torch.nn.Sequential(*stage(1, 16), *stage(16, 32), torch.nn.Flatten(), torch.nn.Linear(512, CLASSES))


class TinyViT(torch.nn.Module):
    """Patch embedding, a class token, pre-norm transformer blocks, a linear head."""

    def __init__(self, dim: int, depth: int, patch: int = 4, size: int = 16) -> None:
        super().__init__()
        self.patches = torch.nn.Conv2d(1, dim, patch, stride=patch)
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.position = torch.nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        block = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(tokens), -1, -1), tokens], 1) + self.position
        return self.head(self.norm(self.blocks(tokens))[:, 0])


class ViTTiny(Images):
    name = "vit-tiny"
    description = "ViT (4x4 patches, 3 blocks, dim 64, class token; 103K parameters), AdamW lr 1e-3, cosine, fp32"
    dim, depth = 64, 3

    def model(self) -> torch.nn.Module:
        return TinyViT(self.dim, 1 if self.quick else self.depth)


# ----------------------------------------------------------------- byte-level language models
class GRULM(Workload):
    name = "gru-lm"
    description = "byte-level GRU LM (embedding 64, 1 layer of 256; 330K parameters), Adam lr 2e-3, cosine, fp32"
    context, batch_size, hidden = 64, 16, 256

    def __init__(self, quick: bool = False) -> None:
        super().__init__(quick)
        if quick:
            self.hidden = 32
        self.data = byte_corpus()
        self.split = int(len(self.data) * 0.9)

    def build(self) -> State:
        model = GRUModel(self.hidden)
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
        return State(model, optimizer, scheduled(self, optimizer, "cosine"))

    batch = ScratchLM.batch  # the same windows of the same corpus as the GPT runs

    def loss(self, model, batch) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))


class GRUModel(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.rnn = torch.nn.GRU(64, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


class GPTHot(ScratchLM):
    name = "gpt-hot"
    description = "byte-level GPT (dim 192, 2 layers; 1.0M parameters), AdamW lr 3e-3, warmup then constant, fp32"
    dim, layers = 192, 2
    lr = 3e-3
    schedule_kind = "constant"  # the last checkpoints are still at the peak learning rate

    def build(self) -> State:
        model = TinyGPT(self.dim, self.layers, self.context)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.1)
        return State(model, optimizer, scheduled(self, optimizer, self.schedule_kind))


class GPTLinear(GPTHot):
    name = "gpt-linear"
    description = "byte-level GPT (dim 192, 2 layers; 1.0M parameters), AdamW lr 5e-4, warmup + linear decay, fp32"
    lr = 5e-4
    schedule_kind = "linear"


# ----------------------------------------------------------------- LoRA on MiniLM
class LoRAMiniLM(MiniLMFineTune):
    """Saves the peft model's full state dict (frozen base, adapters, head), as a user's torch.save would;
    Workload.load restores it into the fresh peft model that build() makes."""

    name = "lora-minilm"
    batch_size, seq = 8, 32  # a quarter of the fine-tunes' tokens a step: 100 steps in seconds, not minutes
    description = ("all-MiniLM-L6-v2 classifier with LoRA r=8 on query/value (22.8M parameters, 74K trained: "
                   "adapters + head), AdamW lr 5e-4, warmup + linear decay, fp32")

    def build(self) -> State:
        from peft import LoraConfig, get_peft_model

        base = super().build().model  # seeds torch, so the head and the adapters start the same every time
        config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"],
                            modules_to_save=["head"])
        model = get_peft_model(base, config)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4, weight_decay=0.0)
        return State(model, optimizer, scheduled(self, optimizer, "linear"))


ZOO_RUNS: tuple[type[Workload], ...] = (MLPTour, CNNBatchNorm, GRULM, ViTTiny, GPTHot, GPTLinear, LoRAMiniLM)
WORKLOADS.update({w.name: w for w in ZOO_RUNS})
