"""Lightning DDP (2 CPU processes, gloo) committing through CkptstoreCheckpointIO, then resuming from a tag.

`python examples/lightning_ddp.py DIR`: the first run trains 3 epochs with ModelCheckpoint (top 2 +
last) into DIR/store; the second (`python examples/lightning_ddp.py DIR lightning/last`) resumes
both ranks from the tag and trains one epoch more. Rank 0 alone commits; every rank loads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ckptstore.integrations.lightning import CkptstoreCheckpointIO
from ckptstore.repo import Repository


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, _):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_start(self):
        print(f"rank {self.global_rank} starts at global_step {self.trainer.global_step}")


def main() -> None:
    root, resume = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (root / "store" / ".ckpt").exists():
        Repository.init(root / "store").close()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=8)
    torch.manual_seed(0)
    best = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpts", monitor="val_loss", save_top_k=2, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=4 if resume else 3,
                         limit_val_batches=2, enable_progress_bar=False, logger=False, enable_model_summary=False,
                         callbacks=[best], plugins=[CkptstoreCheckpointIO(root / "store")])
    trainer.fit(Tiny(), data, data, ckpt_path=resume)
    if trainer.is_global_zero:
        with Repository.open(root / "store") as repo:
            print("tags:", sorted(repo.tags()), "files:", sorted(os.listdir(root / "ckpts")))


if __name__ == "__main__":
    main()
