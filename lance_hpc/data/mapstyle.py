"""Map-style strategy (``style: map``, ``sampler: distributed``).

The batch sampler runs in the main process and hands each worker a whole batch of row ids; the
dataset's ``__getitems__`` reads it with one ``take`` of sorted ids and decodes it in the worker,
returning the batch's fields as ready tensors (no per-row Python objects cross a process boundary).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

from lance_hpc.data.reader import BatchReader
from lance_hpc.data.transport import SharedBatch
from lance_hpc.tasks.base import Batch

BatchRequest = tuple[int, int, np.ndarray]  # (epoch, batch index in the epoch, row ids)


class LanceMapDataset(Dataset):
    """Rows of a Lance dataset by row id; reads whole batches through ``__getitems__``."""

    def __init__(self, reader: BatchReader, rows: int):
        self.reader = reader
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitems__(self, request: BatchRequest) -> tuple[Batch, int] | SharedBatch:
        epoch, batch_index, row_ids = request
        return self.reader.read(row_ids, epoch, batch_index)

    def __getitem__(self, row_id: int) -> Batch:
        fields, _ = self.reader.read(np.array([row_id]), 0, int(row_id), shared=False)
        return {name: values[0] for name, values in fields.items()}


class PlanBatchSampler(Sampler[BatchRequest]):
    """Yields this rank's planned batches of an epoch, from a resume offset."""

    def __init__(self, planner: Callable[[int], list[np.ndarray]], steps: int):
        self.planner = planner
        self.steps = steps
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[BatchRequest]:
        batches = self.planner(self.epoch)
        for index in range(self.start, len(batches)):
            yield self.epoch, index, batches[index]

    def __len__(self) -> int:
        return self.steps - self.start
