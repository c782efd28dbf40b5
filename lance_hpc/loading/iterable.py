"""Iterable strategies (``style: iterable``; ``sampler: block | sharded_batch | sharded_fragment | full_scan``).

Each DataLoader worker plans the rank's epoch itself (the same pure plan the main process uses)
and reads every num_workers-th batch from the resume offset, so workers never duplicate rows and
the DataLoader's round-robin collection restores plan order. The epoch and the resume offset
reach persistent workers through a small shared-memory tensor, which pylance's samplers lack
(their workers all read the same shard, and their shuffle ignores the epoch).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lance_hpc.loading.reader import BatchReader
from lance_hpc.loading.sampling import read_hints, worker_steps
from lance_hpc.loading.transport import SharedBatch
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.base import Batch


class LanceIterableDataset(IterableDataset):
    """Streams this rank's planned batches as (fields, corrupt rows replaced)."""

    def __init__(self, reader: BatchReader, planner: Callable[[int], list[np.ndarray]]):
        self.reader = reader
        self.planner = planner
        # [epoch, first batch]: written by the main process before each pass, read by workers.
        self.position = torch.zeros(2, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.position[0], self.position[1] = epoch, start

    def __iter__(self) -> Iterator[tuple[Batch, ReadStats] | SharedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start = (int(value) for value in self.position.tolist())
        batches = self.planner(epoch)
        mine = list(worker_steps(len(batches), start, worker, num_workers))
        for index in mine:
            window, ahead = read_hints(batches, index, num_workers, self.reader.io_depth)
            yield self.reader.read(batches[index], epoch, index, ahead=ahead, window=window)
