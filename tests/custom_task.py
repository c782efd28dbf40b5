"""A task defined outside lance_hpc, as a user would write one: named in specs by its import path
(``tests.custom_task:PixelMLP`` or ``tests/custom_task.py:PixelMLP``), never shipped.

It reads the digits' image bytes and labels, but produces its own fields: a float32 vector of
grey levels per image (decoded by PIL in the worker) and an int64 target; an MLP classifies them.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field
from torch import nn

from lance_hpc import (
    Batch,
    DatasetInfo,
    Decoder,
    FieldSpec,
    Task,
    TaskError,
    TaskOptions,
    column_problems,
)


class PixelOptions(TaskOptions):
    side: int = Field(8, ge=2, description="Images are scaled to side x side grey levels.")
    hidden: int = Field(64, ge=1, description="Width of the MLP's hidden layer.")
    classes: int = Field(10, ge=2, description="Output classes.")
    decode_delay_s: float = Field(
        0.0, ge=0, description="Seconds each batch's decode waits: a slow source, so a test can signal a job mid-epoch."
    )


class PixelDecoder(Decoder):
    columns = ("image", "label")

    def __init__(self, side: int, delay_s: float = 0.0) -> None:
        self.side, self.delay_s = side, delay_s

    def fields(self) -> dict[str, FieldSpec]:
        return {"pixels": FieldSpec((self.side * self.side,), torch.float32), "target": FieldSpec((), torch.int64)}

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        from PIL import Image

        time.sleep(self.delay_s)
        out["target"].copy_(torch.from_numpy(table.column("label").to_numpy().astype(np.int64)))
        bad = {}
        for index, data in enumerate(table.column("image").to_pylist()):
            try:
                with Image.open(io.BytesIO(data)) as image:
                    grey = np.asarray(image.convert("L").resize((self.side, self.side)), dtype=np.float32)
            except Exception as error:  # PIL raises many types for bad bytes
                bad[index] = str(error)
                continue
            out["pixels"][index].copy_(torch.from_numpy(grey.reshape(-1) / 255.0))
        return bad


class PixelMLP(Task[PixelOptions]):
    Options = PixelOptions
    metrics = ("loss_sum", "correct", "samples")
    tags = {"train/loss": "mean loss", "train/accuracy": "top-1", "val/loss": "mean loss", "val/accuracy": "top-1"}
    headline_metric = "accuracy"

    def __init__(self, options: PixelOptions, train: DatasetInfo, val: DatasetInfo | None = None) -> None:
        super().__init__(options, train, val)
        problems = column_problems(train, "image", "image", "binary images", pa.types.is_binary)
        if problems:
            raise TaskError("PixelMLP", problems)

    def decoder(self, train: bool) -> PixelDecoder:
        return PixelDecoder(self.options.side, self.options.decode_delay_s)

    def build_model(self) -> nn.Module:
        side, hidden = self.options.side, self.options.hidden
        return nn.Sequential(nn.Linear(side * side, hidden), nn.ReLU(), nn.Linear(hidden, self.options.classes))

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, target = model(batch["pixels"]), batch["target"]
        loss = nn.functional.cross_entropy(logits, target)
        count = torch.tensor(float(len(target)))
        return loss, torch.stack([loss.detach() * count, (logits.argmax(1) == target).sum().float(), count])

    def report(self, sums: dict[str, float], prefix: str, seconds: float | None = None) -> dict[str, float]:
        return {f"{prefix}/loss": sums["loss_sum"] / sums["samples"], f"{prefix}/accuracy": sums["correct"] / sums["samples"]}


class RowLogOptions(PixelOptions):
    row_log: str = Field(description="Directory where each rank appends the row ids of its training batches.")


class RowLoggingMLP(PixelMLP):
    """PixelMLP that also appends, for every training batch, one line of row ids to
    ``row_log/rank-R.txt``: what each rank trained on, in order, for exactly-once checks."""

    Options = RowLogOptions

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if model.training:
            import torch.distributed as dist

            with open(f"{self.options.row_log}/rank-{dist.get_rank()}.txt", "a") as log:
                log.write(" ".join(str(row) for row in batch["row_id"].tolist()) + "\n")
        return super().forward(model, batch)


class FailOptions(PixelOptions):
    fail_rank: int = 1
    fail_step: int = 5


class FailingMLP(PixelMLP):
    """PixelMLP whose rank ``fail_rank`` raises at its ``fail_step``-th training batch, while the
    other ranks go on into the next all-reduce: the cause is on one rank, the others lose contact."""

    Options = FailOptions

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        if model.training:
            self.batches = getattr(self, "batches", 0) + 1
            rank = dist.get_rank()
            if rank == self.options.fail_rank and self.batches == self.options.fail_step:
                raise ValueError(f"bad batch on rank {rank} at step {self.batches}")
        return super().forward(model, batch)


class HangOptions(PixelOptions):
    hang_rank: int = Field(-1, description="This rank's own loop blocks at its hang_step-th training batch (-1: none).")
    hang_step: int = 5
    worker_hang_rank: int = Field(
        -1, description="This rank's DataLoader worker stops answering at its worker_hang_step-th batch."
    )
    worker_hang_step: int = 5
    worker_hang_s: float = Field(3600.0, description="For this long (then it answers again).")
    slow_rank: int = Field(-1, description="This rank sleeps slow_s in every forward (a straggler).")
    slow_s: float = 0.0


def rank_of_process() -> int:
    """The rank of this process, or of the rank a DataLoader worker serves (workers inherit its environment)."""
    import os

    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


class HangingDecoder(PixelDecoder):
    """Stops answering for ``seconds``, in a DataLoader worker of ``rank``, at its ``batch``-th batch."""

    def __init__(self, side: int, rank: int, batch: int, seconds: float) -> None:
        super().__init__(side)
        self.rank, self.batch, self.seconds, self.seen = rank, batch, seconds, 0

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        import time

        self.seen += 1
        if rank_of_process() == self.rank and self.seen == self.batch:
            time.sleep(self.seconds)  # a read that does not return
        return super().decode(table, out, rng)


class HangingMLP(PixelMLP):
    """PixelMLP with the watchdog's cases, each on a rank of its own (or none): a rank whose own
    loop blocks, a DataLoader worker that stops answering for a while, a rank slower at every step."""

    Options = HangOptions

    def decoder(self, train: bool) -> PixelDecoder:
        options = self.options
        if train and options.worker_hang_rank >= 0:
            return HangingDecoder(options.side, options.worker_hang_rank, options.worker_hang_step, options.worker_hang_s)
        return super().decoder(train)

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        import time

        rank = rank_of_process()
        if model.training and rank == self.options.slow_rank:
            time.sleep(self.options.slow_s)
        if model.training and rank == self.options.hang_rank:
            self.batches = getattr(self, "batches", 0) + 1
            if self.batches == self.options.hang_step:
                time.sleep(3600)  # a user's code that never returns
        return super().forward(model, batch)
