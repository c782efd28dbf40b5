"""Reading one batch: a single ``take`` of sorted row ids and only the two needed columns, then
decode. Shared by the map-style and iterable strategies, and safe to pickle into worker processes:
the dataset is opened lazily in each process with the full options (storage options, pinned
version)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lance_hpc.data.decode import DecodedBatch, Transform, decode_batch
from lance_hpc.data.sampling import FragmentTable
from lance_hpc.data.storage import open_dataset
from lance_hpc.data.transport import SharedBatch, worker_pool

CLASS_NAMES_KEY = b"class_names"


@dataclass
class BatchReader:
    """Reads and decodes batches of row ids; holds an open dataset only after first use."""

    uri: str
    version: int
    options: dict[str, str] = field(repr=False)
    image_column: str
    label_column: str
    transform: Transform
    on_corrupt: str = "skip"
    seed: int = 0
    rank: int = 0
    _dataset: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_dataset"] = None  # Lance is not fork-safe: each process opens its own
        return state

    @property
    def dataset(self) -> Any:
        if self._dataset is None:
            self._dataset = open_dataset(self.uri, self.version, self.options)
        return self._dataset

    def read(
        self, row_ids: np.ndarray, epoch: int, batch_index: int, *, shared: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, int] | SharedBatch:
        """(images uint8 [B,3,S,S], labels int64 [B], corrupt rows replaced); rows in row-id order.

        In a DataLoader worker (and with ``shared``) the batch is written into one of the worker's
        shared buffers and reaches the main process as that same tuple (see
        :mod:`lance_hpc.data.transport`)."""
        ids = np.asarray(row_ids, dtype=np.int64)
        unique, inverse = np.unique(ids, return_inverse=True)  # sorted: Lance reads in file order
        table = self.dataset.take(unique, columns=[self.image_column, self.label_column])
        images, labels = table.column(self.image_column), table.column(self.label_column)
        if len(unique) != len(ids):  # padding can repeat a row within a batch
            images, labels = images.take(inverse), labels.take(inverse)
            unique = unique[inverse]
        # Augmentation depends only on (seed, epoch, rank, batch), not on which worker decodes.
        rng = np.random.default_rng([self.seed % 2**64, epoch, self.rank, batch_index])
        out = None
        if shared and torch.utils.data.get_worker_info() is not None:
            out = worker_pool().batch(len(unique), self.transform.image_size)
        try:
            decoded: DecodedBatch = decode_batch(
                images,
                labels.to_numpy(),
                unique,
                self.transform,
                rng,
                on_corrupt=self.on_corrupt,
                dataset=self.uri,
                out=None if out is None else (out.images, out.labels),
            )
        except BaseException:
            if out is not None:
                out.release()
            raise
        if out is None:
            return decoded.images, decoded.labels, decoded.skipped
        out.skipped = decoded.skipped
        return out


def fragment_table(dataset: Any) -> FragmentTable:
    """Fragment ids and live row counts from the manifest (no data files read)."""
    fragments = dataset.get_fragments()
    rows = []
    for fragment in fragments:
        count = fragment.metadata.num_rows
        rows.append(int(count) if count is not None else fragment.count_rows())
    return FragmentTable.from_rows(rows, [fragment.fragment_id for fragment in fragments])


def class_names(dataset: Any, label_column: str) -> list[str]:
    """Class names from the schema metadata that ingest writes; else "0".."max label"."""
    metadata = dataset.schema.metadata or {}
    if CLASS_NAMES_KEY in metadata:
        return [str(name) for name in json.loads(metadata[CLASS_NAMES_KEY])]
    labels = dataset.to_table(columns=[label_column]).column(label_column)
    top = labels.to_numpy().max() if len(labels) else -1
    return [str(label) for label in range(int(top) + 1)]


def keep_batch(batch: Any) -> Any:
    """collate_fn for batches that the dataset already returns as tensors."""
    return batch
