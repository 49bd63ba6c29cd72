"""`python -m bench.lightning_plugin [--width 1024] [--epochs 6] [--rounds 3]`: the Lightning plugin against torch.save.

Trains one MLP (Adam) with ModelCheckpoint(save_top_k=2, save_last=True) on the CPU, alternating
rounds with Lightning's default TorchCheckpointIO and with CkptstoreCheckpointIO, and prints the
median time spent in save calls and in the whole fit for each, their ratios (plugin / torch.save,
same rounds; after one warm-up fit), and the bytes each leaves behind: the store keeps every save, the folder only the
top 2 and last.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import TorchCheckpointIO
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ckptstore.integrations.lightning import CkptstoreCheckpointIO
from ckptstore.repo import Repository


class MLP(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 1))

    def training_step(self, batch, _):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, _):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _timed(io_class):
    """`io_class` with the seconds its save calls took added up in `.seconds`."""
    class Timed(io_class):
        seconds, saves, written = 0.0, 0, 0

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            start = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            cls = type(self)
            cls.seconds += time.perf_counter() - start
            cls.saves += 1
            cls.written += Path(path).stat().st_size
    return Timed


def run(width: int, epochs: int, root: Path, store: bool) -> tuple[float, float, int, int, int]:
    """(save seconds, fit seconds, saves, bytes saved, bytes left behind) of one fit.

    Bytes saved: the files torch.save wrote (all of them, also those removed later); for the
    store the same files' size is what its commits hold raw.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, width, generator=gen)
    data = DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=32)
    torch.manual_seed(0)
    repo = Repository.init(root / "store") if store else None
    plugin = _timed(CkptstoreCheckpointIO)(repo) if store else _timed(TorchCheckpointIO)()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpts", monitor="val_loss", save_top_k=2,
                                               save_last=True)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, limit_val_batches=2, enable_progress_bar=False,
                         logger=False, enable_model_summary=False, callbacks=[checkpoints], plugins=[plugin])
    start = time.perf_counter()
    trainer.fit(MLP(width), data, data)
    fit = time.perf_counter() - start
    if store:
        left = sum(f.stat().st_size for f in (root / "store" / ".ckpt").rglob("*") if f.is_file())
        repo.close()
    else:
        left = sum(f.stat().st_size for f in (root / "ckpts").iterdir())
    return type(plugin).seconds, fit, type(plugin).saves, type(plugin).written, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[bool, list[tuple[float, float, int, int, int]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="ckpt-lightning-") as tmp:  # warm-up: imports, first Trainer
        run(64, 1, Path(tmp), True)
    for round_ in range(args.rounds):
        for store in (False, True):
            with tempfile.TemporaryDirectory(prefix="ckpt-lightning-") as tmp:
                results[store].append(run(args.width, args.epochs, Path(tmp) / f"r{round_}", store))
    med = {store: [statistics.median(r[i] for r in rows) for i in range(5)] for store, rows in results.items()}
    params = sum(p.numel() for p in MLP(args.width).parameters())
    print(f"MLP width {args.width} ({params / 1e6:.2f} M parameters, Adam), {args.epochs} epochs, "
          f"median of {args.rounds} alternated rounds")
    print("| checkpoint IO | save calls | time in saves | fit | left on disk | saves kept |")
    print("|---|---|---|---|---|---|")
    for store, name in ((False, "TorchCheckpointIO (torch.save)"), (True, "CkptstoreCheckpointIO")):
        save, fit, saves, _, left = med[store]
        kept = f"all {saves}" if store else "top 2 + last"
        print(f"| {name} | {saves} | {save:.2f} s | {fit:.2f} s | {left / 1e6:.1f} MB | {kept} |")
    raw = med[False][3]
    print(f"plugin / torch.save in the same rounds: time in saves {med[True][0] / med[False][0]:.2f}x, "
          f"fit {med[True][1] / med[False][1]:.2f}x; the store holds {raw / 1e6:.1f} MB of saves in "
          f"{med[True][4] / 1e6:.1f} MB ({raw / med[True][4]:.2f}x)")


if __name__ == "__main__":
    main()
