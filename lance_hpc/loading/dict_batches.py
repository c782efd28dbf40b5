"""Batches as plain dicts of a dataset's columns, for :class:`~lance_hpc.loading.library.Loader`:
numeric and fixed-size-list columns as tensors, every other column as a list, with ``row_id``; and
a user's transform applied to each, in the DataLoader worker that read it.

The reader (:class:`DictReader`) takes rows as every strategy plans them, like the task readers,
but builds the batch from the Arrow table itself instead of a task's fixed-shape fields, so a
batch crosses to the main process as an ordinary pickled value (tensors through shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch

from lance_hpc.errors import UserError
from lance_hpc.loading.reader import BatchReader, MixReader
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.base import ROW_ID, Batch, Decoder, FieldSpec

Transform = Callable[[dict[str, Any]], Any]


class TransformError(UserError):
    """The user's transform raised on a batch; the message names the batch and carries the error."""


def column_value(column: pa.ChunkedArray | pa.Array) -> torch.Tensor | list[Any]:
    """A column of a batch: a ``[rows, *sizes]`` tensor for numbers (and fixed-size lists of them,
    nested or not) without nulls, else a list of Python values."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values, sizes = array, []
    while pa.types.is_fixed_size_list(values.type) and values.null_count == 0:
        sizes.append(values.type.list_size)
        values = values.flatten()  # the rows of this slice only, whatever its offset
    numeric = pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)
    if not numeric or values.null_count:
        return array.to_pylist()
    return torch.from_numpy(values.to_numpy(zero_copy_only=False, writable=True)).reshape(len(array), *sizes)


def table_batch(table: pa.Table, row_ids: np.ndarray) -> dict[str, Any]:
    """The batch of ``table`` (rows ``row_ids``): each column by :func:`column_value`, and ``row_id``."""
    batch: dict[str, Any] = {name: column_value(table.column(name)) for name in table.column_names}
    batch[ROW_ID] = torch.from_numpy(np.ascontiguousarray(row_ids, dtype=np.int64))
    return batch


class ColumnsDecoder(Decoder):
    """The columns a :class:`DictReader` takes, and the transform it applies. It fills no fields of
    its own: the reader builds the whole batch (:func:`table_batch`)."""

    def __init__(self, columns: Sequence[str], transform: Transform | None) -> None:
        self.columns = tuple(columns)
        self.transform = transform

    def fields(self) -> dict[str, FieldSpec]:
        return {}

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        return {}


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
