"""A Lightning Trainer over a Lance dataset with lance_hpc's Loader, its processes started by torchrun:

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --data rows.lance --checkpoints ckpt/

It trains a small model on the dataset's ``vec`` column (fixed-size lists of 4 floats) on CPU.
Lightning's ModelCheckpoint writes ``ckpt/last.ckpt`` every ``--save-every`` steps, and the Trainer
keeps the Loader's state in it (its fit loop saves and restores any train dataloader with
``state_dict``/``load_state_dict``); a run that finds ``last.ckpt`` resumes from it, at the first
batch not yet trained on. ``--rows-log DIR`` writes the row ids each rank trained on (one file per
rank and world size), ``--stop-after K`` saves and ends the run after step K, as a preemption would.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lance_hpc import Loader


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the Lance dataset (a vec column of 4 floats)")
    parser.add_argument("--checkpoints", required=True, help="directory of Lightning's checkpoints")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="save and end after this step")
    parser.add_argument("--rows-log", default=None, help="directory for the row ids each rank trained on")
    return parser.parse_args()


class LanceData(L.LightningDataModule):
    """The Loader as the train dataloader, built once the Trainer has joined the process group, so
    that it reads the rank and world size there."""

    def __init__(self, uri: str, batch_size: int, workers: int) -> None:
        super().__init__()
        self.uri, self.batch_size, self.workers = uri, batch_size, workers

    def train_dataloader(self) -> Loader:
        return Loader(self.uri, batch_size=self.batch_size, columns=["vec"], num_workers=self.workers)


class SumModel(L.LightningModule):
    """Learns the sum of the 4 floats; logs the rows of each step when given a directory."""

    def __init__(self, rows_log: str | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.rows_log = rows_log

    def training_step(self, batch: dict[str, Any], batch_index: int) -> torch.Tensor:
        vectors = batch["vec"]
        if self.rows_log:
            name = f"rows-{self.trainer.world_size}-{self.global_rank}.txt"
            with Path(self.rows_log, name).open("a") as log:
                log.write(f"{self.current_epoch} {' '.join(map(str, batch['row_id'].tolist()))}\n")
        return nn.functional.mse_loss(self.net(vectors).squeeze(1), vectors.sum(dim=1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class StopAfter(Callback):
    """Saves ``last.ckpt`` and stops the run after step ``steps``, as a preemption would."""

    def __init__(self, steps: int, path: str) -> None:
        self.steps, self.path = steps, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(self.path, weights_only=False)  # every rank calls it; rank 0 writes
            trainer.should_stop = True


def main() -> None:
    args = parse_arguments()
    # torchrun started the processes and set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
    # LightningEnvironment takes them as they are (no spawning, and no SLURM requeue of its own).
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    last = os.path.join(args.checkpoints, "last.ckpt")
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=args.checkpoints, every_n_train_steps=args.save_every, save_top_k=0, save_last=True)
    ]
    if args.stop_after:
        callbacks.append(StopAfter(args.stop_after, last))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=local_world_size,
        num_nodes=int(os.environ["WORLD_SIZE"]) // local_world_size,
        strategy=DDPStrategy(process_group_backend="gloo"),
        plugins=[LightningEnvironment()],
        use_distributed_sampler=False,  # the Loader already gives each rank its own rows
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.checkpoints,
    )
    data = LanceData(args.data, args.batch_size, args.workers)
    # The checkpoint holds the Loader's state: fit resumes the epoch at the first batch not trained on.
    # weights_only: a checkpoint read back is tensors and plain values, never arbitrary pickled objects.
    resume = last if os.path.exists(last) else None
    trainer.fit(SumModel(args.rows_log), datamodule=data, ckpt_path=resume, weights_only=True)


if __name__ == "__main__":
    main()
