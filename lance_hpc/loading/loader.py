"""The loaders the trainer uses: :func:`build_train_loader` and :func:`build_eval_loader`.

Workers fork from a server process that imported torch once (:mod:`lance_hpc.loading.workers`), open the
dataset lazily with the full options, run one intra-op thread each, and persist across epochs.
Both take the task's worker half (a :class:`~lance_hpc.tasks.base.Decoder`) and yield batches as
dicts of tensors, each with a ``row_id`` field. The train loader yields exactly
``steps_per_epoch`` batches on every rank and can resume mid-epoch from its ``state_dict``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np
import torch

from lance_hpc.errors import UserError
from lance_hpc.loading.epoch_plan import DataPlan, plan_from_table
from lance_hpc.loading.iterable import LanceIterableDataset
from lance_hpc.loading.mapstyle import BatchRequest, LanceMapDataset, PlanBatchSampler
from lance_hpc.loading.mix import MixPart, MixPlanner, MixReader, MixSchedule, epoch_rows, mix_steps, source_name
from lance_hpc.loading.reader import BatchReader
from lance_hpc.loading.resume import EpochOrigin, ResumedEpoch, Segment, remainder_share_rows, rows_read
from lance_hpc.loading.sampling import epoch_planner, eval_batches, read_hints
from lance_hpc.loading.selection import select_training_rows
from lance_hpc.loading.workers import data_loader, stop_workers_after_failure, worker_context
from lance_hpc.spec import DataSpec, JobSpec
from lance_hpc.storage.datasets import ReadStats, open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks import Task, build_task
from lance_hpc.tasks.base import Batch, DatasetInfo, Decoder

log = logging.getLogger("lance_hpc.data")
STATE_VERSION = 2


def _open(data: DataSpec, uri: str) -> tuple[Any, dict[str, str]]:
    options = storage_options(uri, data.storage_options)
    return open_dataset(uri, data.version if uri == data.uri else None, options, timeout_s=io_timeout(data)), options


def dataset_info(data: DataSpec, uri: str) -> DatasetInfo:
    """Schema, metadata and rows of ``uri`` (the training set at its pinned version), for a task
    to check before training."""
    dataset, _ = _open(data, uri)
    return DatasetInfo(uri, dataset.schema, dataset.count_rows(), dataset)


def io_timeout(data: DataSpec) -> float:
    """data.io_timeout_s, or (for a DataSpec outside a job spec, which sets it) 120 s."""
    return data.io_timeout_s if data.io_timeout_s is not None else 120.0


def _reader(data: DataSpec, uri: str, version: int, options: dict[str, str], decoder: Decoder, rank: int) -> BatchReader:
    """The batch reader of ``uri`` at ``version``, with the spec's reading settings."""
    return BatchReader(
        uri,
        version,
        options,
        decoder,
        on_corrupt=data.on_corrupt,
        seed=data.seed,
        rank=rank,
        io_depth=data.io_depth,
        cache=data.cache,
        io_timeout_s=io_timeout(data),
    )


class TrainLoader:
    """This rank's training batches: dicts of the decoder's fields plus ``row_id``.

    Every rank yields exactly :attr:`steps_per_epoch` batches per epoch (computed from fragment
    metadata, the same on every rank); a short read is an error, never a silent early stop.
    Restored from a position saved at another world size or batch size, it reads the rest of the
    interrupted epoch exactly once (:class:`~lance_hpc.loading.resume.ResumedEpoch`), then plans
    the following epochs for its own layout.
    """

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if data.num_workers > 0:
            worker_context()  # the server imports torch while this process reads the manifest
        self.data = data
        self.rank = rank
        self.world_size = world_size
        options = storage_options(data.uri, data.storage_options)
        dataset, self.selection = select_training_rows(
            data.uri, options, data.version, data.tag, data.filter, timeout_s=io_timeout(data)
        )
        self.dataset_version: int = int(dataset.version)
        table = self.table = self.selection.table
        self.plan: DataPlan = plan_from_table(
            table,
            world_size,
            data.batch_size,
            style=data.style,
            sampler=data.sampler,
            uneven=data.uneven,
            uri=data.uri,
            version=self.dataset_version,
            selected=self.selection.describe() if data.filter else "",
        )
        if self.plan.steps_per_rank == 0:
            raise UserError(
                f"{data.uri} has {self.plan.rows} rows, too few for {world_size} ranks with uneven: {data.uneven}: "
                "use uneven: pad, fewer ranks, or a bigger dataset"
            )
        if data.sampler == "full_scan":
            log.warning("full_scan: every rank reads every row, so DDP ranks train on the same data")
        reader = _reader(data, data.uri, self.dataset_version, options, decoder, rank)
        self.workers = max(1, data.num_workers)
        self.run_rows = self.selection.run_rows(data.block_kb)
        planner = self._planner = epoch_planner(
            table,
            data.sampler,
            rank,
            world_size,
            data.batch_size,
            uneven=data.uneven,
            shuffle=data.shuffle,
            seed=data.seed,
            num_workers=self.workers,
            run_rows=self.run_rows,
            window_runs=data.block_window,
            rows=self.selection.offsets,
        )
        # What the next pass starts from: the batch sampler (map style) or the dataset (iterable).
        self._epoch_source: PlanBatchSampler | LanceIterableDataset
        if data.style == "map":
            self._epoch_source = PlanBatchSampler(planner, self.plan.steps_per_rank, data.num_workers, data.io_depth)
            dataset_object = LanceMapDataset(reader, self.plan.rows)
            self._loader = data_loader(dataset_object, data, pin_memory, True, batch_sampler=self._epoch_source)
        else:
            self._epoch_source = LanceIterableDataset(reader, planner)
            self._loader = data_loader(self._epoch_source, data, pin_memory, True, batch_size=None)
        self.epoch = 0
        self.consumed = 0  # batches of self.epoch handed to the trainer
        self._resume_at = 0
        self.stats = ReadStats()  # corrupt rows replaced, store requests retried: so far
        # called before each batch is handed out: the runtime's check on a loop that bypasses its steps
        self.watch: Callable[[], None] | None = None
        self.resumed: ResumedEpoch | None = None  # an epoch begun at another layout, continued here
        self._resumed_steps = 0
        self._shape: tuple[int, tuple[int, int, np.ndarray, int, bool]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Batches of a whole epoch at this loader's layout."""
        return self.plan.steps_per_rank

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def epoch_steps(self) -> int:
        """Batches of the selected epoch: a whole epoch, or what remains of one resumed at a new layout."""
        if self.resumed is not None and self.epoch == self.resumed.origin.epoch:
            return self._resumed_steps
        return self.steps_per_epoch

    @property
    def steps_remaining(self) -> int:
        """Batches the next pass yields: the whole epoch, or the rest of a restored one."""
        return self.epoch_steps - self._resume_at

    @property
    def pinned(self) -> dict[str, Any]:
        """What this loader reads, as the checkpoint keeps it for every later start."""
        return {"uri": self.data.uri, "version": self.dataset_version, "tag": self.data.tag, "filter": self.data.filter}

    def _origin(self, epoch: int) -> EpochOrigin:
        data = self.data
        if data.sampler != "block":  # the block layout's settings mean nothing to the other strategies
            return EpochOrigin(data.sampler, data.uneven, data.shuffle, data.seed, epoch)
        return EpochOrigin(
            data.sampler, data.uneven, data.shuffle, data.seed, epoch, self.workers, self.run_rows, data.block_window
        )

    def _segments(self) -> tuple[EpochOrigin, tuple[Segment, ...]]:
        """The selected epoch as a chain of segments, the last one ending at the current position."""
        here = Segment(self.world_size, self.data.batch_size, self.consumed)
        if self.resumed is not None and self.epoch == self.resumed.origin.epoch:
            return self.resumed.origin, (*self.resumed.segments[:-1], here)
        return self._origin(self.epoch), (here,)

    def epoch_fraction(self) -> float:
        """How much of the selected epoch all ranks have read, in rows (0 at its start, 1 at its end):
        progress in samples, whatever world sizes the epoch was read at."""
        total, before, shares, steps, remainder = self._epoch_shape()
        if total == 0:
            return 1.0
        return min(1.0, (before + rows_read(shares, steps, self.data.batch_size, remainder, self.consumed)) / total)

    def _epoch_shape(self) -> tuple[int, int, np.ndarray, int, bool]:
        """The selected epoch's rows, those read by earlier segments, this segment's rows per rank,
        its steps, and whether it is a remainder (cut into even pieces); cached per epoch."""
        if self._shape is not None and self._shape[0] == self.epoch:
            return self._shape[1]
        if self.resumed is not None and self.epoch == self.resumed.origin.epoch:
            total = self.resumed.epoch_rows(self.table)
            if len(self.resumed.segments) == 1:
                shape = (total, 0, np.full(self.world_size, total // self.world_size), self._resumed_steps, False)
            else:
                before = self.resumed.rows_before(self.table)
                shares = remainder_share_rows(total - before, self.world_size)
                shape = (total, before, shares, self._resumed_steps, True)
        else:
            per_rank = self.plan.rows_per_rank
            shape = (per_rank * self.world_size, 0, np.full(self.world_size, per_rank), self.steps_per_epoch, False)
        self._shape = (self.epoch, shape)
        return shape

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
        """Where this rank is: the epoch and the batches already handed to the trainer."""
        origin, segments = self._segments()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_consumed": self.consumed,
            "steps_per_epoch": self.epoch_steps,
            "world_size": self.world_size,
            "batch_size": self.data.batch_size,
            "origin": origin.saved(),
            "pinned": self.pinned,
            "segments": [[segment.world_size, segment.batch_size, segment.consumed] for segment in segments],
            "dataset_version": self.dataset_version,
            "skipped_rows": self.stats.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next pass starts at the first batch not yet consumed.

        ``state`` may come from any world size, batch size or sampler settings: at the same layout
        every rank continues its own batches; at another, the rest of the interrupted epoch is split
        anew over this job's ranks, keeping the order it was planned in."""
        if state.get("dataset_version") not in (None, self.dataset_version):
            log.warning(
                "resuming on dataset version %s, the checkpoint read version %s: set data.version to pin it",
                self.dataset_version,
                state.get("dataset_version"),
            )
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        origin = self._origin(epoch)
        if state.get("origin"):
            origin = EpochOrigin(**state["origin"], epoch=epoch)
        saved = state.get("segments") or [[state["world_size"], self.data.batch_size, consumed]]  # version 1
        segments = [Segment(*(int(value) for value in segment)) for segment in saved]
        if (segments[-1].world_size, segments[-1].batch_size) != (self.world_size, self.data.batch_size):
            segments.append(Segment(self.world_size, self.data.batch_size, 0))
        self.epoch, self._shape = epoch, None
        self._resume_at = self.consumed = segments[-1].consumed
        self.stats = ReadStats(skipped=int(state.get("skipped_rows", 0)))
        if len(segments) == 1 and origin == self._origin(epoch):
            self.resumed = None  # the epoch's own plan, continued where this rank stopped
            self._set_planner(self._planner)
            return
        self.resumed = ResumedEpoch(origin, tuple(segments))
        batches = self.resumed.batches(self.table, self.rank)
        if self._resume_at > len(batches):
            raise UserError(
                f"cannot resume epoch {epoch}: the checkpoint says {self._resume_at} batches were read "
                f"of a segment of {len(batches)}; it does not belong to this dataset"
            )
        self._resumed_steps = len(batches)
        self._set_planner(replace(self._planner, fixed=(epoch, tuple(batches))))

    def _set_planner(self, planner: Callable[[int], list[np.ndarray]]) -> None:
        """The planner the next pass reads with (persistent workers get it when they start, on the first pass)."""
        self._epoch_source.planner = planner


class MixLoader(TrainLoader):
    """This rank's training batches of a weighted mix of datasets (``data.mix``; the semantics are
    in :mod:`lance_hpc.loading.mix`). Row ids carry their source (:func:`~lance_hpc.loading.mix.source_of`).
    Its position is the rows drawn over all ranks, so it resumes at any world size or batch size,
    and with new weights."""

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int, *, pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if data.num_workers > 0:
            worker_context()
        assert data.mix is not None
        self.data, self.rank, self.world_size = data, rank, world_size
        self.selections, readers, parts = [], [], []
        for index, source in enumerate(data.mix):
            options = storage_options(
                source.uri, source.storage_options if source.storage_options is not None else data.storage_options
            )
            _, selection = select_training_rows(
                source.uri, options, source.version, source.tag, source.filter, f"data.mix[{index}]", io_timeout(data)
            )
            self.selections.append(selection)
            parts.append(MixPart(selection.table, selection.offsets, selection.run_rows(data.block_kb)))
            readers.append(_reader(data, source.uri, selection.version, options, decoder, rank))
        self.dataset_version = self.selections[0].version
        self.schedule = MixSchedule(
            tuple(parts), tuple(source.weight for source in data.mix), data.sampler, data.shuffle, data.seed, data.block_window
        )
        self.epoch_rows = epoch_rows(data, parts)
        steps = mix_steps(self.epoch_rows, world_size, data.batch_size)
        first = readers[0]
        reader = MixReader(**{**first.__dict__, "_dataset": None}, parts=tuple(readers))
        self.mix_planner = MixPlanner(self.schedule, world_size, data.batch_size, rank, steps)
        self._epoch_source: PlanBatchSampler | LanceIterableDataset
        if data.style == "map":
            self._epoch_source = PlanBatchSampler(self.mix_planner, steps, data.num_workers, data.io_depth)
            self._loader = data_loader(LanceMapDataset(reader, 0), data, pin_memory, True, batch_sampler=self._epoch_source)
        else:
            self._epoch_source = LanceIterableDataset(reader, self.mix_planner)
            self._loader = data_loader(self._epoch_source, data, pin_memory, True, batch_size=None)
        self.epoch, self.consumed, self._resume_at = 0, 0, 0
        self.stats = ReadStats()
        self.watch = None
        self.resumed = None

    @property
    def steps_per_epoch(self) -> int:
        return self.mix_planner.steps_per_epoch

    @property
    def epoch_steps(self) -> int:
        return self.mix_planner.steps(self.epoch)

    @property
    def pinned(self) -> dict[str, Any]:
        assert self.data.mix is not None
        return {
            "sources": [
                {
                    "uri": source.uri,
                    "version": selection.version,
                    "tag": source.tag,
                    "filter": source.filter,
                    "weight": source.weight,
                }
                for source, selection in zip(self.data.mix, self.selections)
            ]
        }

    def rows_drawn(self) -> int:
        """Rows drawn over all ranks up to the current position."""
        planner = self.mix_planner
        return planner.start(self.epoch) + self.consumed * planner.rows_per_step

    def source_figures(self) -> dict[str, float]:
        """Per source: rows drawn over all ranks so far, and source epochs read (TensorBoard's data/mix/*)."""
        assert self.data.mix is not None
        draws = self.schedule.draws_at(self.rows_drawn())
        figures = {}
        for index, (source, part) in enumerate(zip(self.data.mix, self.schedule.parts)):
            name = source_name(source, index)
            figures[f"data/mix/{name}/rows"] = float(draws[index])
            figures[f"data/mix/{name}/epochs"] = float(draws[index]) / part.rows
        return figures

    def epoch_fraction(self) -> float:
        steps = self.epoch_steps
        return min(1.0, self.consumed / steps) if steps else 1.0

    def state_dict(self) -> dict[str, Any]:
        planner = self.mix_planner
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches_consumed": self.consumed,
            "steps_per_epoch": self.epoch_steps,
            "world_size": self.world_size,
            "batch_size": self.data.batch_size,
            "mix": {
                "weights": list(self.schedule.weights),
                "base_rows": self.schedule.base_rows,
                "base_draws": list(self.schedule.base_draws),
                "epoch_start_rows": planner.start(self.epoch),
                "epoch_steps": self.epoch_steps,
                "rows_per_step": planner.rows_per_step,
            },
            "pinned": self.pinned,
            "dataset_version": self.dataset_version,
            "skipped_rows": self.stats.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the rows drawn so far: at the same layout and weights, from the same batch;
        else the rest of the interrupted epoch's rows in this layout's steps, with today's weights."""
        saved = state.get("mix")
        if not saved:
            raise UserError("this checkpoint was not written by a data.mix job: start over with a new checkpoint.dir")
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        old = MixSchedule(
            self.schedule.parts,
            tuple(saved["weights"]),
            self.schedule.sampler,
            self.schedule.shuffle,
            self.schedule.seed,
            self.schedule.window_runs,
            int(saved["base_rows"]),
            tuple(int(value) for value in saved["base_draws"]),
        )
        step_rows, epoch_steps = int(saved["rows_per_step"]), int(saved["epoch_steps"])
        drawn = int(saved["epoch_start_rows"]) + consumed * step_rows
        planner = self.mix_planner
        same_weights = tuple(old.weights) == tuple(self.schedule.weights)
        if same_weights and step_rows == planner.rows_per_step:
            self.schedule = old
            anchor = replace(planner, schedule=old, anchor_epoch=epoch, anchor_rows=int(saved["epoch_start_rows"]))
            anchor = replace(anchor, anchor_steps=epoch_steps)
            self._resume_at = self.consumed = consumed
        else:
            self.schedule = old if same_weights else old.rebased(drawn, self.schedule.weights)
            left = (epoch_steps - consumed) * step_rows
            steps = left // planner.rows_per_step if left >= planner.rows_per_step else int(left > 0)
            anchor = replace(planner, schedule=self.schedule, anchor_epoch=epoch, anchor_rows=drawn, anchor_steps=steps)
            self._resume_at = self.consumed = 0
            if not same_weights:
                log.info("the mix's weights changed: its sources' draws so far are kept, the next follow the new weights")
        self.epoch = epoch
        self.stats = ReadStats(skipped=int(state.get("skipped_rows", 0)))
        self.mix_planner = anchor
        self._set_planner(anchor)
        if isinstance(self._epoch_source, PlanBatchSampler):
            self._epoch_source.steps = anchor.steps(epoch)


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
        reader = _reader(data, uri, self.dataset_version, options, decoder, rank)
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
