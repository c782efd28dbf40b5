"""The loaders the trainer uses: :func:`build_train_loader` and :func:`build_eval_loader`.

Workers fork from a server process that imported torch once (:mod:`lance_hpc.loading.workers`), open the
dataset lazily with the full options, run one intra-op thread each, and persist across epochs.
Both take the task's worker half (a :class:`~lance_hpc.tasks.base.Decoder`) and yield batches as
dicts of tensors, each with a ``row_id`` field. The train loader draws from one dataset or a mix
(:mod:`lance_hpc.loading.batch_sources`) alike, yields exactly ``steps_per_epoch`` batches on every
rank and can resume mid-epoch from its ``state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

from lance_hpc.errors import UserError
from lance_hpc.loading.batch_sources import BatchSource, DatasetBatches, MixBatches, batch_reader, io_timeout
from lance_hpc.loading.iterable import LanceIterableDataset
from lance_hpc.loading.mapstyle import BatchRequest, LanceMapDataset, PlanBatchSampler
from lance_hpc.loading.sampling import eval_batches, read_hints
from lance_hpc.loading.workers import data_loader, stop_workers_after_failure, worker_context
from lance_hpc.spec import DataSpec, JobSpec
from lance_hpc.storage.datasets import ReadStats, open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks import Task, build_task
from lance_hpc.tasks.base import Batch, DatasetInfo, Decoder

STATE_VERSION = 2


def _open(data: DataSpec, uri: str) -> tuple[Any, dict[str, str]]:
    options = storage_options(uri, data.storage_options)
    return open_dataset(uri, data.version if uri == data.uri else None, options, timeout_s=io_timeout(data)), options


def dataset_info(data: DataSpec, uri: str) -> DatasetInfo:
    """Schema, metadata and rows of ``uri`` (the training set at its pinned version), for a task
    to check before training."""
    dataset, _ = _open(data, uri)
    return DatasetInfo(uri, dataset.schema, dataset.count_rows(), dataset)


class TrainLoader:
    """This rank's training batches: dicts of the decoder's fields plus ``row_id``, drawn from a
    source of index batches (:mod:`lance_hpc.loading.batch_sources`): one dataset here, a mix in
    :class:`MixLoader`.

    Every rank yields exactly :attr:`steps_per_epoch` batches per epoch (the same on every rank); a
    short read is an error, never a silent early stop. Its position (:meth:`state_dict`) is the
    epoch and the batches handed out, with the source's part of it, and it can resume mid-epoch
    from one saved at any world size or batch size.
    """

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if data.num_workers > 0:
            worker_context()  # the server imports torch while this process reads the manifest
        self.data = data
        self.rank = rank
        self.world_size = world_size
        self.source = self._source(data, decoder, rank, world_size)
        # What the next pass starts from: the batch sampler (map style) or the dataset (iterable).
        self._epoch_source: PlanBatchSampler | LanceIterableDataset
        if data.style == "map":
            self._epoch_source = PlanBatchSampler(
                self.source.planner, self.source.steps_per_epoch, data.num_workers, data.io_depth
            )
            dataset_object = LanceMapDataset(self.source.reader, self.source.rows)
            self._loader = data_loader(dataset_object, data, pin_memory, True, batch_sampler=self._epoch_source)
        else:
            self._epoch_source = LanceIterableDataset(self.source.reader, self.source.planner)
            self._loader = data_loader(self._epoch_source, data, pin_memory, True, batch_size=None)
        self.epoch = 0
        self.consumed = 0  # batches of self.epoch handed to the trainer
        self._resume_at = 0
        self.stats = ReadStats()  # corrupt rows replaced, store requests retried: so far
        # called before each batch is handed out: the runtime's check on a loop that bypasses its steps
        self.watch: Callable[[], None] | None = None

    def _source(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int) -> BatchSource:
        """What this loader draws from: one dataset (filtered or not)."""
        return DatasetBatches(data, decoder, rank, world_size)

    @property
    def steps_per_epoch(self) -> int:
        """Batches of a whole epoch at this loader's layout."""
        return self.source.steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def epoch_steps(self) -> int:
        """Batches of the selected epoch: a whole epoch, or what remains of one resumed at a new layout."""
        return self.source.epoch_steps(self.epoch)

    @property
    def steps_remaining(self) -> int:
        """Batches the next pass yields: the whole epoch, or the rest of a restored one."""
        return self.epoch_steps - self._resume_at

    @property
    def pinned(self) -> dict[str, Any]:
        """What this loader reads, as the checkpoint keeps it for every later start."""
        return self.source.pinned

    @property
    def dataset_version(self) -> int:
        """The version of the dataset read (of a mix: its first source's)."""
        return self.source.dataset_version

    def epoch_fraction(self) -> float:
        """How much of the selected epoch all ranks have read (0 at its start, 1 at its end)."""
        return self.source.epoch_fraction(self.epoch, self.consumed)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass reads (a restored epoch keeps its offset)."""
        if epoch != self.epoch:
            self.epoch, self._resume_at = epoch, 0
        self.consumed = self._resume_at

    def __iter__(self) -> Iterator[Batch]:
        start = self._resume_at
        self._resume_at = 0
        self.consumed = start
        steps = self.epoch_steps
        if start >= steps:
            return
        self._epoch_source.set_epoch(self.epoch, start)
        if isinstance(self._epoch_source, PlanBatchSampler):
            self._epoch_source.steps = steps
        batches = iter(self._loader)
        for _ in range(start, steps):
            try:
                fields, stats = next(batches)
            except StopIteration:
                raise RuntimeError(
                    f"rank {self.rank}: the data loader ended after {self.consumed} of {steps} batches of epoch "
                    f"{self.epoch}; stopping instead of leaving the other ranks waiting"
                ) from None
            except Exception:
                stop_workers_after_failure(self._loader, batches)
                raise
            self.consumed += 1
            self.stats.add(stats)
            if self.watch is not None:
                self.watch()
            yield fields

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches already handed to the trainer, with the source's part."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_consumed": self.consumed,
            "steps_per_epoch": self.epoch_steps,
            "world_size": self.world_size,
            "batch_size": self.data.batch_size,
            **self.source.position(self.epoch, self.consumed),
            "pinned": self.pinned,
            "dataset_version": self.dataset_version,
            "skipped_rows": self.stats.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, saved at any world size, batch size or sampler settings (a mix:
        also with other weights): the next pass starts at the first batch not yet consumed."""
        resume_at = self.source.restore(state)
        self.epoch = int(state["epoch"])
        self._resume_at = self.consumed = resume_at
        self.stats = ReadStats(skipped=int(state.get("skipped_rows", 0)))
        # the planner the next pass reads with (persistent workers get it when they start, on the first pass)
        self._epoch_source.planner = self.source.planner
        if isinstance(self._epoch_source, PlanBatchSampler):
            self._epoch_source.steps = self.source.epoch_steps(self.epoch)


class MixLoader(TrainLoader):
    """This rank's training batches of a weighted mix of datasets (``data.mix``): a
    :class:`TrainLoader` drawing from :class:`~lance_hpc.loading.batch_sources.MixBatches`, whose
    position is the rows drawn over all ranks, so it resumes at any world size or batch size, and
    with new weights."""

    source: MixBatches

    def _source(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int) -> MixBatches:
        return MixBatches(data, decoder, rank, world_size)

    def source_figures(self) -> dict[str, float]:
        """Per source: rows drawn over all ranks so far, and source epochs read (TensorBoard's data/mix/*)."""
        return self.source.figures(self.epoch, self.consumed)


class RowsLoader:
    """Batches of the given row ids of ``uri`` at ``version``, in the order given, with the decoder's
    fields and ``row_id`` (a row the decoder cannot read is replaced as data.on_corrupt says: its
    ``row_id`` then names the row that replaced it)."""

    def __init__(
        self,
        data: DataSpec,
        decoder: Decoder,
        rank: int,
        uri: str,
        version: int | None,
        batches: list[np.ndarray],
        *,
        pin_memory: bool = False,
    ):
        dataset, options = _open(data, uri)
        if version is not None and int(dataset.version) != version:
            dataset = dataset.checkout_version(version)
        self.dataset_version = int(dataset.version)
        self.batches = batches
        self.rows = sum(len(batch) for batch in batches)
        reader = batch_reader(data, uri, self.dataset_version, options, decoder, rank)
        self._loader = data_loader(
            LanceMapDataset(reader, dataset.count_rows()),
            data,
            pin_memory,
            True,
            batch_sampler=_FixedBatches(self.batches, data.num_workers, data.io_depth),
        )
        self.stats = ReadStats()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        batches = iter(self._loader)
        while True:
            try:
                fields, stats = next(batches)
            except StopIteration:
                return
            except Exception:
                stop_workers_after_failure(self._loader, batches)
                raise
            self.stats.add(stats)
            yield fields


class EvalLoader(RowsLoader):
    """Evaluation batches of one rank: ``sharded`` (every row once over all ranks; step counts may
    differ by one) or ``full_scan`` (every rank all rows), with eval transforms."""

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not data.val_uri:
            raise UserError("data.val_uri is not set: there is no validation set to evaluate on")
        rows = _open(data, data.val_uri)[0].count_rows()
        batches = eval_batches(rows, rank, world_size, data.batch_size, data.val_sampler)
        super().__init__(data, decoder, rank, data.val_uri, None, batches, pin_memory=pin_memory)


class _FixedBatches(torch.utils.data.Sampler):
    def __init__(self, batches: list, num_workers: int, io_depth: int):
        self.batches = batches
        self.num_workers, self.io_depth = num_workers, io_depth

    def __iter__(self) -> Iterator[BatchRequest]:
        for index in range(len(self.batches)):
            window, ahead = read_hints(self.batches, index, self.num_workers, self.io_depth)
            yield 0, index, self.batches[index], ahead, window

    def __len__(self) -> int:
        return len(self.batches)


def build_train_loader(data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False) -> TrainLoader:
    """The loader of one dataset (filtered or not), or of a weighted mix of datasets (data.mix)."""
    if data.mix is not None:
        return MixLoader(data, decoder, rank, world_size, pin_memory=pin_memory)
    return TrainLoader(data, decoder, rank, world_size, pin_memory=pin_memory)


def build_eval_loader(data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False) -> EvalLoader:
    return EvalLoader(data, decoder, rank, world_size, pin_memory=pin_memory)


def load_task(spec: JobSpec) -> Task:
    """The spec's task, checked against the spec's training and validation datasets."""
    data = spec.data
    val = dataset_info(data, data.val_uri) if data.val_uri else None
    return build_task(spec.task.name, spec.task.options, dataset_info(data, data.uri), val)
