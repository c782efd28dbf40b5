"""Batches as plain dicts of a dataset's columns, for :class:`~lance_hpc.loading.library.Loader`:
numeric and fixed-size-list columns as tensors, every other column as a list, with ``row_id``; and
a user's transform applied to each, in the DataLoader worker that read it.

The reader (:class:`DictReader`) takes rows as every strategy plans them, like the task readers,
but builds the batch from the Arrow table itself instead of a task's fixed-shape fields, so a
batch crosses to the main process as an ordinary pickled value (tensors through shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.loading.reader import BatchReader, MixReader
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.columns import ColumnsDecoder, table_batch


class TransformError(UserError):
    """The user's transform raised on a batch; the message names the batch and carries the error."""


@dataclass
class DictReader(BatchReader):
    """Reads a planned batch (with read-ahead, windows and the node cache as every reader) and
    returns it as a dict (:func:`table_batch`), or as the user's transform makes it."""

    decoder: ColumnsDecoder

    def batch(
        self, table: pa.Table, unique: np.ndarray, stats: ReadStats, epoch: int, batch_index: int, shared: bool
    ) -> tuple[Any, ReadStats]:
        columns = table_batch(table, unique)
        transform = self.decoder.transform
        if transform is None:
            return columns, stats
        try:
            return transform(columns), stats
        except Exception as error:  # the user's code: its message, without lance_hpc's frames
            name = getattr(transform, "__qualname__", type(transform).__name__)
            raise TransformError(
                f"the transform {name} raised on batch {batch_index} of epoch {epoch} (rows {describe_rows(unique)}) "
                f"of {self.uri}: {type(error).__name__}: {error}\n"
                "  fix: correct the transform; call it on that batch in one process (num_workers=0) to debug it"
            ) from None


@dataclass
class MixDictReader(MixReader, DictReader):
    """A batch of a mix (each source's rows with that source's reader) as a dict."""


def dict_reader(reader: BatchReader) -> DictReader:
    """``reader`` (of one dataset or of a mix) returning dict batches."""
    kind = MixDictReader if isinstance(reader, MixReader) else DictReader
    return kind(**{**reader.__dict__, "_dataset": None, "_ahead": None, "_window": None})


def describe_rows(rows: np.ndarray) -> str:
    """A batch's row ids for a message: all of a few, else the first and the count."""
    shown = ", ".join(str(int(row)) for row in rows[:8])
    return shown if len(rows) <= 8 else f"{shown}, ... ({len(rows)} rows)"
