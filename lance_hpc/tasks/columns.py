"""The decode-only task ``columns``: a training loop of your own (``entry``) that builds its own
model names the columns it reads, and gets them as dict batches, as :class:`lance_hpc.Loader` gives
them: numeric and fixed-size-list columns as tensors, every other column as a list, with ``row_id``.

It has no model, loss or metrics: the loop brings its own, so a checkpoint's lineage names the
entry that trained it, beside this task that only decoded its rows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from lance_hpc.errors import UserError
from lance_hpc.tasks.base import ROW_ID, Batch, DatasetInfo, Decoder, FieldSpec, Task, TaskError
from lance_hpc.tasks.options import ColumnsOptions

Transform = Callable[[dict[str, Any]], Any]


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
    """The columns a dict reader (:mod:`lance_hpc.loading.dict_batches`) takes, their types
    (``schema``) and the transform it applies. It fills no fields of its own: the reader builds the
    whole batch (:func:`table_batch`)."""

    def __init__(self, columns: Sequence[str], transform: Transform | None, schema: pa.Schema) -> None:
        self.columns = tuple(columns)
        self.transform = transform
        self.schema = pa.schema([schema.field(name) for name in self.columns])

    def fields(self) -> dict[str, FieldSpec]:
        return {}

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        return {}

    def empty_batch(self) -> Batch:
        """A batch of no rows with the columns' types: each tensor ``[0, *sizes]``, each list empty."""
        return table_batch(self.schema.empty_table(), np.empty(0, dtype=np.int64))


class Columns(Task[ColumnsOptions]):
    """``task: {name: columns, options: {columns: [...]}}``: the named columns as dict batches, for
    an entry that builds, runs and scores its own model."""

    Options = ColumnsOptions
    metrics = ()

    def __init__(self, options: ColumnsOptions, train: DatasetInfo, val: DatasetInfo | None = None) -> None:
        super().__init__(options, train, val)
        problems = [
            f"task.options.columns: column {name!r} is not in {info.uri}; its columns:{info.describe_columns()}\n"
            "      fix: name columns the dataset has"
            for info in (train, val)
            if info is not None
            for name in options.columns
            if name not in info.schema.names
        ]
        if problems:
            raise TaskError("columns", problems)

    def decoder(self, train: bool) -> Decoder:
        info = self.train_info if train or self.val_info is None else self.val_info
        return ColumnsDecoder(self.options.columns, None, info.schema)

    def build_model(self) -> nn.Module:
        raise UserError(
            "task columns only decodes rows: it has no model to build\n"
            "  fix: build your model in the entry and pass it to ctx.wrap(model), or name a task that has one"
        )

    def to_device(self, batch: Batch, device: torch.device) -> Batch:
        """The batch's tensors on the device; its lists (strings, bytes, nulls) stay as they are."""
        return {
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in batch.items()
        }

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        raise UserError(
            "task columns has no loss: the entry computes its own\n  fix: compute the loss in the entry from the batch"
        )

    def report(self, sums: dict[str, float], prefix: str, seconds: float | None = None) -> dict[str, float]:
        return {}
