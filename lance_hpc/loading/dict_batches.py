"""Batches as plain dicts of a dataset's columns, for :class:`~lance_hpc.loading.library.Loader`:
numeric and fixed-size-list columns as tensors, every other column as a list, with ``row_id``; and
a user's transform applied to each, in the DataLoader worker that read it.

The reader (:class:`DictReader`) takes rows as every strategy plans them, like the task readers,
but builds the batch from the Arrow table itself instead of a task's fixed-shape fields. In a
DataLoader worker a dict batch crosses to the main process as the trainer's batches do: its plain
CPU tensors written into one of the worker's reused shared buffers
(:mod:`lance_hpc.loading.transport`), the rest pickled beside them (:class:`SharedDict`). Pickled
instead, each tensor would cost a fresh shared-memory segment, its page faults and a descriptor
passed on its own: several times the read of a batch of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import get_worker_info

from lance_hpc.errors import UserError
from lance_hpc.loading.reader import BatchReader, MixReader
from lance_hpc.loading.transport import SharedBatch, worker_pool
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.base import FieldSpec
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
    ) -> tuple[Any, ReadStats] | SharedBatch:
        value = self.transformed(table_batch(table, unique), epoch, batch_index, unique)
        if shared and isinstance(value, dict) and get_worker_info() is not None:
            return SharedDict.of(value, stats)
        return value, stats

    def transformed(self, columns: dict[str, Any], epoch: int, batch_index: int, unique: np.ndarray) -> Any:
        """``columns``, or what the user's transform makes of them."""
        transform = self.decoder.transform
        if transform is None:
            return columns
        try:
            return transform(columns)
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


def travels_shared(value: Any) -> bool:
    """Whether ``value`` crosses in the shared buffer: a plain dense CPU tensor (a subclass, such as
    a torchvision ``tv_tensors.Image``, keeps its class only by pickle; a tensor that needs its
    gradient cannot be copied without losing it)."""
    return (
        type(value) is torch.Tensor
        and value.layout is torch.strided
        and value.device.type == "cpu"
        and not value.requires_grad
        and not value.is_quantized
    )


def memory_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The order ``tensor``'s dimensions lie in memory when it is a permutation of a contiguous
    tensor (a channels-last image, for one), so its copy keeps its strides; None otherwise."""
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda dim: -strides[dim]))
    if order == tuple(range(tensor.dim())) or not tensor.permute(order).is_contiguous():
        return None
    return order


class SharedDict(SharedBatch):
    """A dict batch written in a DataLoader worker: its tensors (:func:`travels_shared`) in one of
    the worker's shared buffers, each as the one "row" of a field of its own shape, the rest of the
    dict pickled. Sent to the main process it arrives as ``(batch, stats)``, the dict in its own
    key order, its tensors over the buffer's memory (free for the worker's next batch once the
    last of them is freed)."""

    rest: dict[Any, Any]
    order: tuple[Any, ...]

    @classmethod
    def of(cls, value: dict[Any, Any], stats: ReadStats) -> SharedDict:
        tensors = {name: item for name, item in value.items() if travels_shared(item)}
        fields = {name: FieldSpec(tuple(tensor.shape), tensor.dtype, memory_order(tensor)) for name, tensor in tensors.items()}
        shared = worker_pool().batch(fields, 1, cls)
        assert isinstance(shared, cls)
        try:
            for name, tensor in tensors.items():
                shared.fields[name][0].copy_(tensor)
        except BaseException:
            shared.release()
            raise
        shared.stats = stats
        shared.rest = {name: item for name, item in value.items() if name not in tensors}
        shared.order = tuple(value)
        return shared

    def __reduce__(self) -> tuple[Any, tuple]:
        receive, arguments = super().__reduce__()
        return _receive_dict, (receive, arguments, self.rest, self.order)


def _receive_dict(
    receive: Callable[..., tuple[dict[str, torch.Tensor], ReadStats]],
    arguments: tuple,
    rest: dict[Any, Any],
    order: tuple[Any, ...],
) -> tuple[dict[Any, Any], ReadStats]:
    """Main process: the buffer's fields (mapped by the transport's ``receive``) and ``rest``, as one dict."""
    fields, stats = receive(*arguments)
    return {name: fields[name][0] if name in fields else rest[name] for name in order}, stats


def dict_reader(reader: BatchReader) -> DictReader:
    """``reader`` (of one dataset or of a mix) returning dict batches."""
    kind = MixDictReader if isinstance(reader, MixReader) else DictReader
    return kind(**{**reader.__dict__, "_dataset": None, "_ahead": None, "_window": None})


def describe_rows(rows: np.ndarray) -> str:
    """A batch's row ids for a message: all of a few, else the first and the count."""
    shown = ", ".join(str(int(row)) for row in rows[:8])
    return shown if len(rows) <= 8 else f"{shown}, ... ({len(rows)} rows)"
