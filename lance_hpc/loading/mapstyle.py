"""Map-style strategy (``style: map``, ``sampler: distributed``).

The batch sampler runs in the main process and hands each worker a whole batch of row ids; the
dataset's ``__getitems__`` reads it with one ``take`` of sorted ids and decodes it in the worker,
returning the batch's fields as ready tensors (no per-row Python objects cross a process boundary).
The DataLoader deals batches to its workers in turn, so the sampler also tells each worker the
rows of the batches it will get next, for the reader to start reading them (``data.io_depth``), and
with ``sampler: block`` the window each batch is cut from, which the worker reads whole.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

from lance_hpc.loading.reader import BatchReader
from lance_hpc.loading.sampling import read_hints
from lance_hpc.loading.transport import SharedBatch
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.base import Batch

# (epoch, batch index in the epoch, row ids, rows to read ahead, the window the batch is cut from or None)
BatchRequest = tuple[int, int, np.ndarray, tuple[np.ndarray, ...], "np.ndarray | None"]


class LanceMapDataset(Dataset):
    """Rows of a Lance dataset by row id; reads whole batches through ``__getitems__``."""

    def __init__(self, reader: BatchReader, rows: int):
        self.reader = reader
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitems__(self, request: BatchRequest) -> tuple[Batch, ReadStats] | SharedBatch:
        epoch, batch_index, row_ids, ahead, window = request
        return self.reader.read(row_ids, epoch, batch_index, ahead=ahead, window=window)

    def __getitem__(self, row_id: int) -> Batch:
        read = self.reader.read(np.array([row_id]), 0, int(row_id), shared=False)
        assert not isinstance(read, SharedBatch)  # shared=False
        fields, _ = read
        return {name: values[0] for name, values in fields.items()}


class PlanBatchSampler(Sampler[BatchRequest]):
    """Yields this rank's planned batches of an epoch, from a resume offset."""

    def __init__(self, planner: Callable[[int], list[np.ndarray]], steps: int, num_workers: int = 0, io_depth: int = 0):
        self.planner = planner
        self.steps = steps
        self.num_workers, self.io_depth = num_workers, io_depth
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[BatchRequest]:
        batches = self.planner(self.epoch)
        for index in range(self.start, len(batches)):
            window, ahead = read_hints(batches, index, self.num_workers, self.io_depth)
            yield self.epoch, index, batches[index], ahead, window

    def __len__(self) -> int:
        return self.steps - self.start
