"""What a task is: a worker half that turns Lance rows into fixed-shape fields, and a rank half
that builds the model and turns batches into a loss and summed metrics.

The worker half (:class:`Decoder`) is pickled into DataLoader workers and imported there after the
fork, so it stays light. The reader around it owns everything that must not depend on user code:
the ``take``, the corrupt-row policy, augmentation seeds, the ``row_id`` field, shared memory.

The rank half (:class:`Task`) reports metrics as *sums* over a fixed tuple of names, so every
rank all-reduces the same vector whatever its batches held, and :meth:`Task.report` turns the
reduced sums into the values TensorBoard shows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from lance_hpc.errors import UserError, listing
from lance_hpc.storage.datasets import Dataset
from lance_hpc.tasks.options import TaskOptions

Batch = dict[str, torch.Tensor]
ROW_ID = "row_id"  # the field the reader adds to every batch: the dataset row each sample came from


@dataclass(frozen=True)
class FieldSpec:
    """One field of a batch, per row: its shape and dtype as the model sees them.

    ``memory_order`` lays the dimensions out in memory in another order: an image of shape
    ``(3, H, W)`` with ``memory_order=(1, 2, 0)`` is stored ``H x W x 3`` (channels-last), so a
    decoder writes each decoded image with a plain copy.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    memory_order: tuple[int, ...] | None = None

    def empty(self, rows: int) -> torch.Tensor:
        """A ``[rows, *shape]`` tensor in this field's memory layout."""
        return self.view(torch.empty((rows, *self.stored_shape), dtype=self.dtype))

    @property
    def stored_shape(self) -> tuple[int, ...]:
        order = self.memory_order or tuple(range(len(self.shape)))
        return tuple(self.shape[dim] for dim in order)

    def view(self, stored: torch.Tensor) -> torch.Tensor:
        """``[rows, *stored_shape]`` memory seen as ``[rows, *shape]``."""
        if self.memory_order is None:
            return stored
        return stored.permute(0, *(1 + self.memory_order.index(dim) for dim in range(len(self.shape))))

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


class Decoder(ABC):
    """The worker half of a task: reads ``columns`` and fills the fields of :meth:`fields`."""

    columns: tuple[str, ...] = ()

    @abstractmethod
    def fields(self) -> dict[str, FieldSpec]:
        """The fields every batch carries (not ``row_id``, which the reader adds)."""

    @abstractmethod
    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        """Write row ``i`` of ``table`` into ``out[name][i]`` for every field; return the rows that
        could not be decoded as ``{position: reason}`` (the reader skips or fails them by policy).
        ``rng`` is seeded from ``(seed, epoch, rank, batch)``: draw augmentation from it only."""

    def empty_batch(self) -> Batch:
        """A batch of no rows, with every field and ``row_id``: what a rank whose rows ran out
        evaluates while the others still have some (``train.parallelism: fsdp``)."""
        return {name: field.empty(0) for name, field in self.fields().items()} | {ROW_ID: torch.empty(0, dtype=torch.int64)}


@dataclass
class DatasetInfo:
    """What a task may check before training: the dataset's schema, metadata and row count."""

    uri: str
    schema: pa.Schema
    rows: int
    dataset: Dataset | None = field(repr=False, default=None)  # the open dataset, to read a column

    @property
    def metadata(self) -> dict[str, str]:
        return {key.decode(): value.decode(errors="replace") for key, value in (self.schema.metadata or {}).items()}

    def describe_columns(self, indent: str = "        ") -> str:
        """Every column with its type, on lines of their own (:func:`~lance_hpc.errors.listing`)."""
        return listing([f"{item.name} ({item.type})" for item in self.schema], indent)


OptionsT = TypeVar("OptionsT", bound=TaskOptions)


class Task(ABC, Generic[OptionsT]):
    """The rank half of a task. Subclass it, set :attr:`Options`, :attr:`metrics` and :attr:`tags`,
    and name the class in a spec: ``task: {name: my_pkg.tasks:MyTask, options: {...}}``.

    ``__init__`` gets the validated options and the training (and validation) dataset; it checks
    them against each other (columns, types, class counts) and raises :class:`TaskError` listing
    every problem, before any worker starts or any step runs.
    """

    Options: ClassVar[type[TaskOptions]] = TaskOptions
    metrics: ClassVar[tuple[str, ...]] = ("loss_sum", "samples")  # summed on every rank, then all-reduced
    tags: ClassVar[dict[str, str]] = {}  # TensorBoard tags of report(), with a one-line meaning each
    headline_metric: ClassVar[str] = "loss"  # what the final line and the HParams tab lead with

    def __init__(self, options: OptionsT, train: DatasetInfo, val: DatasetInfo | None = None) -> None:
        self.options = options
        self.train_info = train
        self.val_info = val

    @abstractmethod
    def decoder(self, train: bool) -> Decoder:
        """The worker half for the training (augmenting) or the evaluation pass."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (every rank seeds the same, so all start equal)."""

    def weights_file(self) -> str | None:
        """The file of a fresh model's initial weights, when the options name one (a resumed job's
        checkpoint replaces them): a state dict saved with torch.save, or a lance_hpc checkpoint
        file. lance_hpc loads it (:func:`lance_hpc.checkpoint.weights.load_weights`); by default none."""
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module] | None:
        """The repeated blocks of ``model`` that ``train.parallelism: fsdp`` shards one by one (a
        transformer's layers, an image model's stages); None lets lance_hpc choose (the modules of the
        model's largest ModuleList or Sequential) and say so."""
        return None

    def to_device(self, batch: Batch, device: torch.device) -> Batch:
        """Move (and normalise) a batch on the device; uint8 data crosses as uint8."""
        return {name: value.to(device, non_blocking=True) for name, value in batch.items()}

    def prepare_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Move the model to the device (a task may choose a memory format here)."""
        return model.to(device)

    @abstractmethod
    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss to backpropagate, float tensor of the sums named by :attr:`metrics`)."""

    @abstractmethod
    def report(self, sums: dict[str, float], prefix: str, seconds: float | None = None) -> dict[str, float]:
        """Reported values (``{prefix}/loss``, ...) from all-reduced sums; ``seconds`` is the
        wall time the sums took, for rates (None for evaluation)."""

    # What infer() can write as columns (job: infer's infer.outputs), each one value or a vector per row.
    outputs: ClassVar[tuple[str, ...]] = ()

    def infer(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-row outputs of the model on a batch on the device, by name (each of :attr:`outputs`),
        every tensor's first dimension the batch's rows; a task without outputs has none to write."""
        raise TaskError(type(self).__name__, ["this task has no outputs to write; give infer.function instead"])

    def headline(self, metrics: dict[str, float]) -> str:
        """One line on validation results, e.g. ``accuracy: 0.9944 (loss 0.0243)``."""
        main = f"val/{self.headline_metric}" if f"val/{self.headline_metric}" in metrics else "val/loss"
        short = [tag.split("/", 1)[-1] for tag in metrics]  # the prefix kept where two would print the same
        names = {tag: name if short.count(name) == 1 else tag for tag, name in zip(metrics, short)}
        rest = ", ".join(f"{names[tag]} {value:.4g}" for tag, value in metrics.items() if tag != main)
        return f"{main.split('/', 1)[1].replace('_', ' ')}: {metrics[main]:.4f}" + (f" ({rest})" if rest else "")


class TaskError(UserError):
    """What is wrong between a task's options and its dataset, every problem at once."""

    def __init__(self, task: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"task {task}: {len(problems)} problem{'s' if len(problems) != 1 else ''} with the dataset\n"
            + "\n".join(f"  {problem}" for problem in problems)
        )


def column_problems(info: DatasetInfo, option: str, column: str, kind: str, accepts: Any) -> list[str]:
    """Problems with ``column`` (named by ``task.options.<option>``) in ``info``: missing, or of a
    type ``accepts`` refuses; ``kind`` says what was expected, e.g. "binary (encoded images)"."""
    if column not in info.schema.names:
        return [
            f"task.options.{option}: column {column!r} is not in {info.uri}; its columns:{info.describe_columns()}\n"
            f"      fix: set task.options.{option} to the column that holds {kind}"
        ]
    found = info.schema.field(column).type
    if not accepts(found):
        return [
            f"task.options.{option}: column {column!r} of {info.uri} is {found}, expected {kind}\n"
            f"      fix: point task.options.{option} at a column of {kind}"
        ]
    return []
