"""The loaders the trainer uses: :func:`build_train_loader` and :func:`build_eval_loader`.

Workers fork from a server process that imported torch once (:func:`worker_context`), open the
dataset lazily with the full options, run one intra-op thread each, and persist across epochs.
Both take the task's worker half (a :class:`~lance_hpc.tasks.base.Decoder`) and yield batches as
dicts of tensors, each with a ``row_id`` field. The train loader yields exactly
``steps_per_epoch`` batches on every rank and can resume mid-epoch from its ``state_dict``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from lance_hpc.data.iterable import LanceIterableDataset
from lance_hpc.data.mapstyle import LanceMapDataset, PlanBatchSampler
from lance_hpc.data.reader import BatchReader, fragment_table, keep_batch
from lance_hpc.data.sampling import DataPlan, epoch_planner, eval_batches, plan_from_table
from lance_hpc.data.storage import open_dataset, storage_options
from lance_hpc.errors import UserError
from lance_hpc.spec import DataSpec
from lance_hpc.tasks.base import Batch, DatasetInfo, Decoder

log = logging.getLogger("lance_hpc.data")
STATE_VERSION = 1
# What the worker server imports before any worker forks from it. Not Lance: a process that has
# used Lance must not fork, so each worker imports it after the fork.
WORKER_PRELOAD = ("torch", "numpy", "simplejpeg", "PIL.Image", "pydantic")
# SLURM sends its preemption warning (USR2) and SIGTERM (scancel, time limit) to every process of a
# job step. The rank process turns them into a checkpoint at the next step boundary; the worker
# server and the workers must not die of them first, which would fail the epoch instead (and lose
# the batches they already prepared). SIGKILL, which follows SIGTERM, still ends them.
RANK_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def worker_context() -> BaseContext:
    """Where DataLoader workers come from: forked from a server process ("forkserver") that has
    already imported torch, so a worker is ready in a fraction of a second rather than the seconds
    a fresh interpreter takes to import torch (which "spawn" pays in every worker, every job).

    The server starts on the first call and imports in the background, so calling this early
    (before building the model) overlaps that import with other setup. It serves every loader of
    the process; workers get the environment of the moment it started, and ignore USR2 and
    SIGTERM (:data:`RANK_SIGNALS`), which are the rank process's to handle.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()  # signal dispositions can only be set from the main thread
        return context
    previous = {number: signal.signal(number, signal.SIG_IGN) for number in RANK_SIGNALS}
    try:
        forkserver.ensure_running()  # an ignored signal stays ignored in the server and its forks
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return context


def init_worker(_worker_id: int) -> None:
    """DataLoader worker setup: one intra-op thread per worker, so workers do not oversubscribe;
    :data:`RANK_SIGNALS` ignored (torch's worker setup makes SIGTERM fatal); and no hold on the
    worker server's life (see :func:`release_forkserver`)."""
    torch.set_num_threads(1)
    for number in RANK_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    release_forkserver()


def release_forkserver() -> None:
    """A process forked by multiprocessing's forkserver inherits the write end of the pipe whose
    closing tells the server that the rank process is gone. Held by a worker, it keeps the server
    (the worker's parent) alive after the rank process dies, so torch's parent watchdog never
    stops the worker: orphans holding memory and data. Closed here, the server exits with the
    rank process and the workers follow it."""
    server = getattr(forkserver, "_forkserver", None)
    descriptor = getattr(server, "_forkserver_alive_fd", None)
    if descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)
        server._forkserver_alive_fd = None


def _data_loader(dataset: Any, data: DataSpec, pin_memory: bool, persistent: bool, **kwargs: Any) -> DataLoader:
    workers = data.num_workers
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = dict(
            multiprocessing_context=worker_context(),
            persistent_workers=persistent,
            prefetch_factor=data.prefetch_factor,
            worker_init_fn=init_worker,
        )
    return DataLoader(dataset, num_workers=workers, pin_memory=pin_memory, collate_fn=keep_batch, **extra, **kwargs)


def _open(data: DataSpec, uri: str) -> tuple[Any, dict[str, str]]:
    options = storage_options(uri, data.storage_options)
    return open_dataset(uri, data.version if uri == data.uri else None, options), options


def dataset_info(data: DataSpec, uri: str) -> DatasetInfo:
    """Schema, metadata and rows of ``uri`` (the training set at its pinned version), for a task
    to check before training."""
    dataset, _ = _open(data, uri)
    return DatasetInfo(uri, dataset.schema, dataset.count_rows(), dataset)


class TrainLoader:
    """This rank's training batches: dicts of the decoder's fields plus ``row_id``.

    Every rank yields exactly :attr:`steps_per_epoch` batches per epoch (computed from fragment
    metadata, the same on every rank); a short read is an error, never a silent early stop.
    """

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if data.num_workers > 0:
            worker_context()  # the server imports torch while this process reads the manifest
        self.data = data
        self.rank = rank
        self.world_size = world_size
        dataset, options = _open(data, data.uri)
        self.dataset_version: int = int(dataset.version)
        table = fragment_table(dataset)
        self.plan: DataPlan = plan_from_table(
            table, world_size, data.batch_size, style=data.style, sampler=data.sampler,
            uneven=data.uneven, uri=data.uri, version=self.dataset_version,
        )
        if self.plan.steps_per_rank == 0:
            raise UserError(
                f"{data.uri} has {self.plan.rows} rows, too few for {world_size} ranks with uneven: {data.uneven}: "
                "use uneven: pad, fewer ranks, or a bigger dataset"
            )
        if data.sampler == "full_scan":
            log.warning("full_scan: every rank reads every row, so DDP ranks train on the same data")
        reader = BatchReader(data.uri, self.dataset_version, options, decoder, data.on_corrupt, data.seed, rank)
        planner = epoch_planner(
            table, data.sampler, rank, world_size, data.batch_size, uneven=data.uneven, shuffle=data.shuffle, seed=data.seed
        )
        # What the next pass starts from: the batch sampler (map style) or the dataset (iterable).
        self._epoch_source: PlanBatchSampler | LanceIterableDataset
        if data.style == "map":
            self._epoch_source = PlanBatchSampler(planner, self.plan.steps_per_rank)
            dataset_object = LanceMapDataset(reader, self.plan.rows)
            self._loader = _data_loader(dataset_object, data, pin_memory, True, batch_sampler=self._epoch_source)
        else:
            self._epoch_source = LanceIterableDataset(reader, planner)
            self._loader = _data_loader(self._epoch_source, data, pin_memory, True, batch_size=None)
        self.epoch = 0
        self.consumed = 0  # batches of self.epoch handed to the trainer
        self._resume_at = 0
        self.skipped_rows = 0  # corrupt rows replaced so far (on_corrupt: skip)

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_rank

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def steps_remaining(self) -> int:
        """Batches the next pass yields: the whole epoch, or the rest of a restored one."""
        return self.steps_per_epoch - self._resume_at

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass reads (a restored epoch keeps its offset)."""
        if epoch != self.epoch:
            self.epoch, self._resume_at = epoch, 0
        self.consumed = self._resume_at

    def __iter__(self) -> Iterator[Batch]:
        start = self._resume_at
        self._resume_at = 0
        self.consumed = start
        steps = self.steps_per_epoch
        if start >= steps:
            return
        self._epoch_source.set_epoch(self.epoch, start)
        batches = iter(self._loader)
        for _ in range(start, steps):
            try:
                fields, skipped = next(batches)
            except StopIteration:
                raise RuntimeError(
                    f"rank {self.rank}: the data loader ended after {self.consumed} of {steps} batches of epoch "
                    f"{self.epoch}; stopping instead of leaving the other ranks waiting"
                ) from None
            self.consumed += 1
            self.skipped_rows += skipped
            yield fields

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches already handed to the trainer."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_consumed": self.consumed,
            "steps_per_epoch": self.steps_per_epoch,
            "world_size": self.world_size,
            "sampler": self.data.sampler,
            "seed": self.data.seed,
            "dataset_version": self.dataset_version,
            "skipped_rows": self.skipped_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass starts at the first batch not yet consumed."""
        mismatched = [
            f"{key} was {state.get(key)!r}, now {value!r}"
            for key, value in (
                ("world_size", self.world_size),
                ("steps_per_epoch", self.steps_per_epoch),
                ("sampler", self.data.sampler),
                ("seed", self.data.seed),
            )
            if key in state and state[key] != value
        ]
        if mismatched:
            raise UserError(
                "cannot resume the data order mid-epoch: " + "; ".join(mismatched)
                + ". Resume with the same data settings and world size, or start the epoch over"
            )
        if state.get("dataset_version") not in (None, self.dataset_version):
            log.warning(
                "resuming on dataset version %s, the checkpoint read version %s: set data.version to pin it",
                self.dataset_version, state.get("dataset_version"),
            )
        self.epoch = int(state["epoch"])
        self._resume_at = self.consumed = int(state["batches_consumed"])
        self.skipped_rows = int(state.get("skipped_rows", 0))


class EvalLoader:
    """Evaluation batches of one rank: ``sharded`` (every row once over all ranks; step counts may
    differ by one) or ``full_scan`` (every rank all rows), with eval transforms."""

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not data.val_uri:
            raise UserError("data.val_uri is not set: there is no validation set to evaluate on")
        dataset, options = _open(data, data.val_uri)
        self.dataset_version = int(dataset.version)
        rows = dataset.count_rows()
        self.batches = eval_batches(rows, rank, world_size, data.batch_size, data.val_sampler)
        self.rows = sum(len(batch) for batch in self.batches)
        reader = BatchReader(data.val_uri, self.dataset_version, options, decoder, data.on_corrupt, data.seed, rank)
        self._loader = _data_loader(
            LanceMapDataset(reader, rows), data, pin_memory, True, batch_sampler=_FixedBatches(self.batches)
        )
        self.skipped_rows = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for fields, skipped in self._loader:
            self.skipped_rows += skipped
            yield fields


class _FixedBatches(torch.utils.data.Sampler):
    def __init__(self, batches: list):
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        for index, batch in enumerate(self.batches):
            yield 0, index, batch

    def __len__(self) -> int:
        return len(self.batches)


def build_train_loader(
    data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False
) -> TrainLoader:
    return TrainLoader(data, decoder, rank, world_size, pin_memory=pin_memory)


def build_eval_loader(
    data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False
) -> EvalLoader:
    return EvalLoader(data, decoder, rank, world_size, pin_memory=pin_memory)
