"""What a training loader draws its batches from: a source of index batches.

:class:`DatasetBatches` is one dataset: its selected rows (``data.filter``, ``data.tag``), planned by
a strategy (:mod:`lance_hpc.loading.sampling`), an epoch resumable at another world size or batch
size (:mod:`lance_hpc.loading.resume`). :class:`MixBatches` is a weighted mix of datasets
(:mod:`lance_hpc.loading.mix`), whose position is the rows drawn over all ranks. The loader
(:class:`~lance_hpc.loading.loader.TrainLoader`) reads either the same way: the source gives the
reader of a batch and the planner of each epoch, says how many steps an epoch has and how far into
it a position is, and saves and restores its own part of the loader's position.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Protocol

import numpy as np

from lance_hpc.errors import UserError
from lance_hpc.loading.dict_batches import dict_reader
from lance_hpc.loading.epoch_plan import DataPlan, spec_plan
from lance_hpc.loading.mix import MixPart, MixPlanner, MixSchedule, epoch_rows, mix_steps, source_name
from lance_hpc.loading.reader import BatchReader, MixReader
from lance_hpc.loading.resume import EpochOrigin, ResumedEpoch, Segment, remainder_share_rows, rows_read
from lance_hpc.loading.sampling import epoch_planner
from lance_hpc.loading.selection import select_training_rows
from lance_hpc.spec import DataSpec
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks.base import Decoder
from lance_hpc.tasks.columns import ColumnsDecoder

log = logging.getLogger("lance_hpc.data")


def io_timeout(data: DataSpec) -> float:
    """data.io_timeout_s, or (for a DataSpec outside a job spec, which sets it) 120 s."""
    return data.io_timeout_s if data.io_timeout_s is not None else 120.0


def batch_reader(data: DataSpec, uri: str, version: int, options: dict[str, str], decoder: Decoder, rank: int) -> BatchReader:
    """The batch reader of ``uri`` at ``version``, with the spec's reading settings; of dict batches
    for a :class:`~lance_hpc.tasks.columns.ColumnsDecoder`."""
    reader = BatchReader(
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
    return dict_reader(reader) if isinstance(decoder, ColumnsDecoder) else reader


class BatchSource(Protocol):
    """What a training loader reads: the same for one dataset and for a mix."""

    #: reads a planned batch of row ids, in a DataLoader worker
    reader: BatchReader
    #: rows the map-style dataset reports as its length
    rows: int
    #: the version of the (first) dataset read
    dataset_version: int

    @property
    def planner(self) -> Callable[[int], list[np.ndarray]]:
        """This rank's batches of row ids of an epoch (the planner of the epoch a position restored)."""
        ...

    @property
    def steps_per_epoch(self) -> int:
        """Batches of a whole epoch at this rank's layout."""
        ...

    @property
    def pinned(self) -> dict[str, Any]:
        """What is read, as the checkpoint keeps it for every later start."""
        ...

    def epoch_steps(self, epoch: int) -> int:
        """Batches of ``epoch``: a whole one, or what remains of one a position restored."""
        ...

    def epoch_fraction(self, epoch: int, consumed: int) -> float:
        """How much of ``epoch`` all ranks have read once ``consumed`` batches of it are, from 0 to 1."""
        ...

    def position(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The source's part of a saved position."""
        ...

    def restore(self, state: dict[str, Any]) -> int:
        """Continue from a saved position (any world size, batch size or weights); the batch of
        ``state["epoch"]`` the next pass starts at."""
        ...


class DatasetBatches:
    """One dataset's rows for this rank: every rank takes exactly :attr:`steps_per_epoch` batches
    per epoch (from fragment metadata, the same on every rank). Restored from a position saved at
    another world size or batch size, it reads the rest of the interrupted epoch exactly once
    (:class:`~lance_hpc.loading.resume.ResumedEpoch`), then plans the following epochs for its own layout."""

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int):
        self.data, self.rank, self.world_size = data, rank, world_size
        options = storage_options(data.uri, data.storage_options)
        dataset, self.selection = select_training_rows(
            data.uri, options, data.version, data.tag, data.filter, timeout_s=io_timeout(data)
        )
        self.dataset_version: int = int(dataset.version)
        table = self.table = self.selection.table
        selected = self.selection.describe() if data.filter else ""
        self.plan: DataPlan = spec_plan(data, table, world_size, uri=data.uri, version=self.dataset_version, selected=selected)
        if self.plan.steps_per_rank == 0:
            raise UserError(
                f"{data.uri} has {self.plan.rows} rows, too few for {world_size} ranks with uneven: {data.uneven}: "
                "use uneven: pad, fewer ranks, or a bigger dataset"
            )
        if data.sampler == "full_scan":
            log.warning("full_scan: every rank reads every row, so DDP ranks train on the same data")
        self.reader = batch_reader(data, data.uri, self.dataset_version, options, decoder, rank)
        self.rows = self.plan.rows
        self.workers = max(1, data.num_workers)
        self.run_rows = self.selection.run_rows(data.block_kb)
        # the epochs' own plan; an epoch resumed at another layout is planned apart (self.planner)
        self.planned = epoch_planner(
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
        self.planner: Callable[[int], list[np.ndarray]] = self.planned
        self.resumed: ResumedEpoch | None = None  # an epoch begun at another layout, continued here
        self._resumed_steps = 0
        self._shape: tuple[int, tuple[int, int, np.ndarray, int, bool]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_rank

    @property
    def pinned(self) -> dict[str, Any]:
        return {"uri": self.data.uri, "version": self.dataset_version, "tag": self.data.tag, "filter": self.data.filter}

    def _resuming(self, epoch: int) -> bool:
        return self.resumed is not None and epoch == self.resumed.origin.epoch

    def epoch_steps(self, epoch: int) -> int:
        return self._resumed_steps if self._resuming(epoch) else self.steps_per_epoch

    def _origin(self, epoch: int) -> EpochOrigin:
        data = self.data
        if data.sampler != "block":  # the block layout's settings mean nothing to the other strategies
            return EpochOrigin(data.sampler, data.uneven, data.shuffle, data.seed, epoch)
        return EpochOrigin(
            data.sampler, data.uneven, data.shuffle, data.seed, epoch, self.workers, self.run_rows, data.block_window
        )

    def _segments(self, epoch: int, consumed: int) -> tuple[EpochOrigin, tuple[Segment, ...]]:
        """The epoch as a chain of segments, the last one ending at ``consumed``."""
        here = Segment(self.world_size, self.data.batch_size, consumed)
        if self.resumed is not None and self._resuming(epoch):
            return self.resumed.origin, (*self.resumed.segments[:-1], here)
        return self._origin(epoch), (here,)

    def epoch_fraction(self, epoch: int, consumed: int) -> float:
        """In rows: progress in samples, whatever world sizes the epoch was read at."""
        total, before, shares, steps, remainder = self._epoch_shape(epoch)
        if total == 0:
            return 1.0
        return min(1.0, (before + rows_read(shares, steps, self.data.batch_size, remainder, consumed)) / total)

    def _epoch_shape(self, epoch: int) -> tuple[int, int, np.ndarray, int, bool]:
        """The epoch's rows, those read by earlier segments, this segment's rows per rank, its
        steps, and whether it is a remainder (cut into even pieces); cached per epoch."""
        if self._shape is not None and self._shape[0] == epoch:
            return self._shape[1]
        if self.resumed is not None and self._resuming(epoch):
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
        self._shape = (epoch, shape)
        return shape

    def position(self, epoch: int, consumed: int) -> dict[str, Any]:
        origin, segments = self._segments(epoch, consumed)
        return {
            "origin": origin.saved(),
            "segments": [[segment.world_size, segment.batch_size, segment.consumed] for segment in segments],
        }

    def restore(self, state: dict[str, Any]) -> int:
        """At the same layout every rank continues its own batches; at another, the rest of the
        interrupted epoch is split anew over this job's ranks, keeping the order it was planned in."""
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
        self._shape = None
        resume_at = segments[-1].consumed
        if len(segments) == 1 and origin == self._origin(epoch):
            self.resumed = None  # the epoch's own plan, continued where this rank stopped
            self.planner = self.planned
            return resume_at
        self.resumed = ResumedEpoch(origin, tuple(segments))
        batches = self.resumed.batches(self.table, self.rank)
        if resume_at > len(batches):
            raise UserError(
                f"cannot resume epoch {epoch}: the checkpoint says {resume_at} batches were read "
                f"of a segment of {len(batches)}; it does not belong to this dataset"
            )
        self._resumed_steps = len(batches)
        self.planner = replace(self.planned, fixed=(epoch, tuple(batches)))
        return resume_at


class MixBatches:
    """This rank's rows of a weighted mix of datasets (``data.mix``; the semantics are in
    :mod:`lance_hpc.loading.mix`). Row ids carry their source (:func:`~lance_hpc.loading.mix.source_of`).
    Its position is the rows drawn over all ranks, so it resumes at any world size or batch size,
    and with new weights."""

    def __init__(self, data: DataSpec, decoder: Decoder, rank: int, world_size: int):
        assert data.mix is not None
        self.data = data
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
            readers.append(batch_reader(data, source.uri, selection.version, options, decoder, rank))
        self.dataset_version = self.selections[0].version
        self.schedule = MixSchedule(
            tuple(parts), tuple(source.weight for source in data.mix), data.sampler, data.shuffle, data.seed, data.block_window
        )
        self.epoch_rows = epoch_rows(data, parts)
        steps = mix_steps(self.epoch_rows, world_size, data.batch_size)
        reader = MixReader(**{**readers[0].__dict__, "_dataset": None}, parts=tuple(readers))
        self.reader: BatchReader = dict_reader(reader) if isinstance(decoder, ColumnsDecoder) else reader
        self.rows = 0
        self.planner = MixPlanner(self.schedule, world_size, data.batch_size, rank, steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.planner.steps_per_epoch

    def epoch_steps(self, epoch: int) -> int:
        return self.planner.steps(epoch)

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

    def rows_drawn(self, epoch: int, consumed: int) -> int:
        """Rows drawn over all ranks once ``consumed`` batches of ``epoch`` are."""
        return self.planner.start(epoch) + consumed * self.planner.rows_per_step

    def figures(self, epoch: int, consumed: int) -> dict[str, float]:
        """Per source: rows drawn over all ranks so far, and source epochs read (TensorBoard's data/mix/*)."""
        assert self.data.mix is not None
        draws = self.schedule.draws_at(self.rows_drawn(epoch, consumed))
        figures = {}
        for index, (source, part) in enumerate(zip(self.data.mix, self.schedule.parts)):
            name = source_name(source, index)
            figures[f"data/mix/{name}/rows"] = float(draws[index])
            figures[f"data/mix/{name}/epochs"] = float(draws[index]) / part.rows
        return figures

    def epoch_fraction(self, epoch: int, consumed: int) -> float:
        steps = self.epoch_steps(epoch)
        return min(1.0, consumed / steps) if steps else 1.0

    def position(self, epoch: int, consumed: int) -> dict[str, Any]:
        return {
            "mix": {
                "weights": list(self.schedule.weights),
                "base_rows": self.schedule.base_rows,
                "base_draws": list(self.schedule.base_draws),
                "epoch_start_rows": self.planner.start(epoch),
                "epoch_steps": self.epoch_steps(epoch),
                "rows_per_step": self.planner.rows_per_step,
            }
        }

    def restore(self, state: dict[str, Any]) -> int:
        """From the rows drawn so far: at the same layout and weights, from the same batch; else the
        rest of the interrupted epoch's rows in this layout's steps, with today's weights."""
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
        planner = self.planner
        same_weights = tuple(old.weights) == tuple(self.schedule.weights)
        if same_weights and step_rows == planner.rows_per_step:
            self.schedule = old
            anchor = replace(planner, schedule=old, anchor_epoch=epoch, anchor_rows=int(saved["epoch_start_rows"]))
            self.planner = replace(anchor, anchor_steps=epoch_steps)
            return consumed
        self.schedule = old if same_weights else old.rebased(drawn, self.schedule.weights)
        left = (epoch_steps - consumed) * step_rows
        steps = left // planner.rows_per_step if left >= planner.rows_per_step else int(left > 0)
        self.planner = replace(planner, schedule=self.schedule, anchor_epoch=epoch, anchor_rows=drawn, anchor_steps=steps)
        if not same_weights:
            log.info("the mix's weights changed: its sources' draws so far are kept, the next follow the new weights")
        return 0
