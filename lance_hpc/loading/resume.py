"""An epoch resumed at another world size: what each earlier segment of it (a run at one world
size) read, and how the rows left are split over the ranks now, so that no row is read twice and
none is skipped (:class:`ResumedEpoch`).

An interrupted epoch is a chain of segments: the first read with the epoch's own plan, each later
one after a resume that changed the world size or the per-rank batch. A new segment splits the rows
the epoch has not yet consumed (in their planned order) into one contiguous share per rank, each cut
into the same number of batches; shares differ by at most one row, so batches may differ by one row
between ranks while every rank takes the same number of steps. The rest of the epoch is thus read
exactly once. Two corners: with a batch of 1, a rank with the bigger share reads one batch of 2
rows; with fewer rows left than ranks, a rank with no share repeats rows of the remainder (those
repeats are never counted as read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lance_hpc.loading.sampling import EpochRequest, FragmentTable, cyclic, rank_share, strategy_function


@dataclass(frozen=True)
class Segment:
    """Part of an epoch read at one layout: ``consumed`` batches taken by every rank."""

    world_size: int
    batch_size: int
    consumed: int


@dataclass(frozen=True)
class EpochOrigin:
    """How an epoch was planned when it started (the order its remainder keeps)."""

    sampler: str
    uneven: str
    shuffle: bool
    seed: int
    epoch: int
    num_workers: int = 1  # sampler: block plans per worker
    run_rows: int = 1
    window_runs: int = 32

    def saved(self) -> dict[str, object]:
        """The fields a checkpoint keeps (the epoch is saved beside them)."""
        return {name: value for name, value in self.__dict__.items() if name != "epoch"}


def _origin_request(table: FragmentTable, origin: EpochOrigin, segment: Segment, rank: int) -> EpochRequest:
    return EpochRequest(
        table,
        rank,
        segment.world_size,
        segment.batch_size,
        origin.uneven,
        origin.shuffle,
        origin.seed,
        origin.epoch,
        origin.num_workers,
        origin.run_rows,
        origin.window_runs,
    )


def _remainder_steps(rows: int, world_size: int, batch_size: int) -> int:
    """Steps of a remainder of ``rows`` rows: enough for the bigger shares, but no more than the
    smaller shares have rows (unless they have none)."""
    if rows == 0:
        return 0
    steps = math.ceil(math.ceil(rows / world_size) / batch_size)
    smaller = rows // world_size
    return min(steps, smaller) if smaller else steps


def _remainder_share(rows: np.ndarray, world_size: int, batch_size: int, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s batches of a remainder: a contiguous share cut into the common step count."""
    steps = _remainder_steps(len(rows), world_size, batch_size)
    if steps == 0:
        return []
    share = rows[len(rows) * rank // world_size : len(rows) * (rank + 1) // world_size]
    if len(share) == 0:  # fewer rows left than ranks
        share = cyclic(rows, steps)
    return list(np.array_split(share, steps))


def _segment_batches(
    table: FragmentTable, origin: EpochOrigin, before: Sequence[Segment], segment: Segment, rank: int
) -> list[np.ndarray]:
    """The batches ``rank`` reads in ``segment``, which follows the segments ``before``."""
    if not before:
        return strategy_function(origin.sampler)(_origin_request(table, origin, segment, rank))
    rows = remaining_rows(table, origin, before)
    return _remainder_share(rows, segment.world_size, segment.batch_size, rank)


def remaining_rows(table: FragmentTable, origin: EpochOrigin, segments: Sequence[Segment]) -> np.ndarray:
    """The rows of an epoch that ``segments`` have not consumed, in planned order (rank by rank)."""
    if not segments:
        raise ValueError("an epoch has at least its first segment")
    rest: np.ndarray | None = None
    for index, segment in enumerate(segments):
        per_rank = []
        for rank in range(segment.world_size):
            if index == 0:
                batches = strategy_function(origin.sampler)(_origin_request(table, origin, segment, rank))
            elif rest is not None and len(rest) * (rank + 1) // segment.world_size > len(rest) * rank // segment.world_size:
                batches = _remainder_share(rest, segment.world_size, segment.batch_size, rank)
            else:  # a rank with no share of its own only repeated rows
                continue
            per_rank.extend(batches[segment.consumed :])
        rest = np.concatenate(per_rank).astype(np.int64) if per_rank else np.zeros(0, dtype=np.int64)
    assert rest is not None  # the loop ran: there is a first segment
    return rest


@dataclass(frozen=True)
class ResumedEpoch:
    """An interrupted epoch continued at a new layout: its origin and every segment so far (the last
    is the one being read now, by this job's world size and batch)."""

    origin: EpochOrigin
    segments: tuple[Segment, ...]

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def batches(self, table: FragmentTable, rank: int) -> list[np.ndarray]:
        """This rank's batches of the current segment, from its first (skip ``current.consumed``)."""
        return _segment_batches(table, self.origin, self.segments[:-1], self.current, rank)

    def epoch_rows(self, table: FragmentTable) -> int:
        """Rows the whole epoch reads over all ranks, as first planned (padding included)."""
        first = self.segments[0]
        share = rank_share(table.total_rows, first.world_size, first.batch_size, self.origin.uneven)
        return share.rows_per_rank * first.world_size

    def rows_before(self, table: FragmentTable) -> int:
        """Rows the earlier segments consumed, over all ranks."""
        if len(self.segments) == 1:
            return 0
        return self.epoch_rows(table) - len(remaining_rows(table, self.origin, self.segments[:-1]))


def rows_read(share_rows: np.ndarray, steps: int, batch_size: int, remainder: bool, consumed: int) -> int:
    """Rows all ranks have read after ``consumed`` batches of a segment: ``share_rows`` per rank,
    cut into ``batch_size`` batches (a first segment) or ``steps`` even pieces (a remainder)."""
    if not remainder:
        return int(np.minimum(consumed * batch_size, share_rows).sum())
    consumed = min(consumed, steps)
    return int((consumed * (share_rows // steps) + np.minimum(consumed, share_rows % steps)).sum()) if steps else 0


def remainder_share_rows(rows: int, world_size: int) -> np.ndarray:
    """Rows of each rank's own share of a remainder of ``rows`` rows (repeats not counted)."""
    return np.diff(np.array([rows * rank // world_size for rank in range(world_size + 1)], dtype=np.int64))
