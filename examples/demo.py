"""Demo: train a tiny transformer, commit every N steps, branch, check out, print log and stats.

The model learns bytes of Python's own standard library (text always present offline); every N
steps the checkpoint is committed with `ckpt commit`; a branch starts from an early commit with a
lower learning rate and commits lossily (`--lossy balanced`, checked against the in-memory model);
then main is checked out again and verified bit for bit.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckptstore.formats.torchfile import numpy_safe_globals


def corpus(limit: int = 400_000) -> str:
    """Source files of Python's standard library: real text, always present offline."""
    root = Path(argparse.__file__).parent
    text, size = [], 0
    for path in sorted(root.glob("*.py")):
        chunk = path.read_text(errors="ignore")
        text.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return "".join(text)


class TinyGPT(torch.nn.Module):
    """A two-layer decoder-only transformer over bytes."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(torch.zeros(context, dim))
        block = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:n]
        return self.head(self.norm(self.blocks(hidden, mask=self.mask[:n, :n], is_causal=True)))


class Run:
    def __init__(self, data: torch.Tensor, lr: float, total_steps: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.data, self.step = data, 0
        self.model = TinyGPT()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        warmup = max(1, total_steps // 10)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
        )

    def train(self, steps: int) -> float:
        loss = torch.tensor(0.0)
        for _ in range(steps):
            batch = self.batch(16)
            logits = self.model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step += 1
        return loss.item()

    def batch(self, size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """`size` random 65-byte windows of the corpus (64 inputs and their next bytes)."""
        starts = torch.randint(0, len(self.data) - 65, (size,), generator=generator)
        return torch.stack([self.data[s : s + 65] for s in starts.tolist()])

    def fixed_batch_loss(self) -> float:
        """The loss on one fixed batch (its own generator), so two copies of a model compare."""
        batch = self.batch(64, torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = self.model(batch[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1)).item()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step, "rng": torch.get_rng_state()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])


def load_checkpoint(path: Path) -> dict:
    """A checkpoint file as `ckpt checkout` wrote it, loaded without unpickling code."""
    with torch.serialization.safe_globals(numpy_safe_globals()):
        return torch.load(path, weights_only=True)


def ckpt(workdir: Path, *args: str) -> str:
    result = subprocess.run(["ckpt", *args], cwd=workdir, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"ckpt {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=Path("demo-run"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a model this small trains 7-10x faster on one thread than on two busy cores
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    print(ckpt(args.workdir, "init"))
    data = torch.tensor(list(corpus().encode()), dtype=torch.long)
    run = Run(data, lr=1e-3, total_steps=args.steps)
    started = time.time()
    while run.step < args.steps:
        loss = run.train(args.every)
        torch.save(run.state(), args.workdir / "checkpoint.pt")
        print(f"step {run.step:4d} loss {loss:.3f}  " + ckpt(
            args.workdir, "commit", "checkpoint.pt", "-m", f"main lr=1e-3 step {run.step}",
            "--step", str(run.step), "--metric", f"loss={loss:.4f}"))
    print(f"trained {args.steps} steps in {time.time() - started:.0f}s")

    fork_step = 3 * args.every
    print(f"\nbranching 'low-lr' from step {fork_step} (HEAD~{args.steps // args.every - 3}) and continuing there,"
          " committing lossily (--lossy balanced)")
    print(ckpt(args.workdir, "branch", "low-lr", f"main~{args.steps // args.every - 3}"))
    print(ckpt(args.workdir, "checkout", "low-lr"))
    restored = load_checkpoint(args.workdir / "checkpoint.pt")
    branch = Run(data, lr=1e-3, total_steps=args.steps)
    branch.load(restored)
    for group in branch.optimizer.param_groups:
        group["lr"] *= 0.3
    branch.scheduler.base_lrs = [lr * 0.3 for lr in branch.scheduler.base_lrs]
    for _ in range(3):
        loss = branch.train(args.every)
        torch.save(branch.state(), args.workdir / "checkpoint.pt")
        print(f"low-lr step {branch.step:4d} loss {loss:.3f}  " + ckpt(
            args.workdir, "commit", "checkpoint.pt", "-m", f"low-lr step {branch.step}", "--step", str(branch.step),
            "--metric", f"loss={loss:.4f}", "--lossy", "balanced"))
    # checkpoint.pt holds full precision that the lossy commit did not keep: overwrite it on purpose
    print(ckpt(args.workdir, "checkout", "low-lr", "--force"))
    lossy = load_checkpoint(args.workdir / "checkpoint.pt")
    check = Run(data, lr=1e-3, total_steps=args.steps)
    check.load(lossy)
    exact, restored_loss = branch.fixed_batch_loss(), check.fixed_batch_loss()
    print(f"low-lr restored from its lossy commit: fixed-batch loss {restored_loss:.4f} against {exact:.4f} "
          f"in memory ({(restored_loss - exact) / exact * 100:+.3f}%), step {check.step}")

    print("\nchecking out main again and verifying it bit for bit")
    print(ckpt(args.workdir, "checkout", "main"))
    original = run.state()
    back = load_checkpoint(args.workdir / "checkpoint.pt")
    same = all(torch.equal(original["model"][k], back["model"][k]) for k in original["model"])
    print(f"main's weights restored bit-exact: {same}")
    print("\n$ ckpt log --graph --all\n" + ckpt(args.workdir, "log", "--graph", "--all"))
    print("\n$ ckpt stats\n" + ckpt(args.workdir, "stats"))
    print("\n$ ckpt fsck\n" + ckpt(args.workdir, "fsck"))
    if not same:
        sys.exit("restored weights differ")


if __name__ == "__main__":
    main()
