"""Which rows each rank and each DataLoader worker reads, per epoch, planned from fragment metadata.

Everything here is pure: fragment row counts plus (strategy, world size, batch size, seed, epoch)
in, row ids out, with no dataset and no global random state. Every rank computes the same global
order and keeps its share, so ranks agree without talking.

Equal steps on every rank, for every strategy (``full_scan`` aside, where every rank reads every
row):

- ``uneven: drop``: every rank gets ``rows // world_size`` rows (fewer than ``world_size`` rows are
  dropped per epoch); batches of ``batch_size`` with one shorter last batch, the same size on every
  rank.
- ``uneven: pad``: every rank gets ``ceil(rows / (world_size * batch_size))`` full batches; the
  missing rows repeat rows from the start of the epoch's order.

Row ids are dataset row offsets (0..rows-1 across fragments in order, deleted rows excluded), the
ids ``LanceDataset.take`` accepts. An epoch resumed at another world size is planned in
:mod:`lance_hpc.data.resume`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from lance_hpc.spec.choices import (
    EVAL_MODES,
    SAMPLERS,
    UNEVEN_MODES,
    check_registry,
)


@dataclass(frozen=True)
class FragmentTable:
    """Fragment ids and their row counts, in dataset order."""

    ids: tuple[int, ...]
    rows: tuple[int, ...]

    @classmethod
    def from_rows(cls, rows: Sequence[int], ids: Sequence[int] | None = None) -> FragmentTable:
        ids = tuple(range(len(rows))) if ids is None else tuple(int(i) for i in ids)
        if len(ids) != len(rows):
            raise ValueError("one id per fragment")
        return cls(ids, tuple(int(count) for count in rows))

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def starts(self) -> np.ndarray:
        """First row offset of each fragment."""
        return np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)[:-1]]).astype(np.int64)


@dataclass(frozen=True)
class RankShare:
    """What every rank reads in one epoch: the same for all ranks by construction."""

    rows_per_rank: int
    steps: int
    last_batch_rows: int
    dropped: int
    padded: int


def rank_share(rows: int, world_size: int, batch_size: int, uneven: str, every_rank_all_rows: bool = False) -> RankShare:
    """Rows and steps per rank, and rows dropped or padded per epoch (see the module doc)."""
    if world_size < 1 or batch_size < 1 or rows < 0:
        raise ValueError("need world_size >= 1, batch_size >= 1 and rows >= 0")
    if every_rank_all_rows:
        per_rank, dropped, padded = rows, 0, 0
    elif uneven == "drop":
        per_rank = rows // world_size
        dropped, padded = rows - per_rank * world_size, 0
    elif uneven == "pad":
        per_rank = math.ceil(rows / (world_size * batch_size)) * batch_size
        dropped, padded = 0, per_rank * world_size - rows
    else:
        raise ValueError(f"unknown uneven mode {uneven!r}: use one of {', '.join(UNEVEN_MODES)}")
    steps = math.ceil(per_rank / batch_size)
    last = per_rank - (steps - 1) * batch_size if steps else 0
    return RankShare(per_rank, steps, last, dropped, padded)


def _rng(seed: int, epoch: int, *tags: int) -> np.random.Generator:
    """A private generator for (seed, epoch, tags); never the global RNG."""
    return np.random.default_rng([seed % 2**64, epoch % 2**64, *tags])


def cyclic(sequence: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` items of ``sequence`` repeated end to end."""
    if length <= len(sequence):
        return sequence[:length]
    return np.resize(sequence, length)


def _chunks(rows: np.ndarray, batch_size: int) -> list[np.ndarray]:
    return [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]


@dataclass(frozen=True)
class EpochRequest:
    """Everything a strategy needs to lay out one rank's epoch."""

    table: FragmentTable
    rank: int
    world_size: int
    batch_size: int
    uneven: str
    shuffle: bool
    seed: int
    epoch: int

    @property
    def share(self) -> RankShare:
        return rank_share(self.table.total_rows, self.world_size, self.batch_size, self.uneven)


def distributed_batches(request: EpochRequest) -> list[np.ndarray]:
    """Map style: a global row permutation per epoch, rank r takes every world_size-th row."""
    rows = request.table.total_rows
    share = request.share
    order = _rng(request.seed, request.epoch).permutation(rows) if request.shuffle else np.arange(rows)
    sequence = cyclic(order.astype(np.int64), share.rows_per_rank * request.world_size)
    return _chunks(sequence[request.rank :: request.world_size], request.batch_size)


def sharded_batch_batches(request: EpochRequest) -> list[np.ndarray]:
    """Contiguous blocks of batch_size rows dealt round-robin to ranks; block order shuffled per epoch.

    The short block at the end of the dataset stays last, so every other block is read as one
    contiguous range; the tail that does not fill a round is split evenly between ranks.
    """
    rows, batch_size, world_size = request.table.total_rows, request.batch_size, request.world_size
    share = request.share
    full_blocks = rows // batch_size
    block_order = _rng(request.seed, request.epoch).permutation(full_blocks) if request.shuffle else np.arange(full_blocks)
    sequence = np.concatenate(
        [(block_order[:, None] * batch_size + np.arange(batch_size)).ravel(), np.arange(full_blocks * batch_size, rows)]
    ).astype(np.int64)
    sequence = cyclic(sequence, share.rows_per_rank * world_size)
    rounds = share.rows_per_rank // batch_size
    round_rows = rounds * world_size * batch_size
    batches = list(sequence[:round_rows].reshape(rounds, world_size, batch_size)[:, request.rank, :])
    tail = share.rows_per_rank - rounds * batch_size
    if tail:
        start = round_rows + request.rank * tail
        batches.append(sequence[start : start + tail])
    return batches


def sharded_fragment_batches(request: EpochRequest) -> list[np.ndarray]:
    """Whole fragments in a per-epoch order, cut into one contiguous run of equal length per rank.

    A rank reads its run fragment by fragment; at most world_size - 1 fragments are split between
    two ranks, which is what keeps every rank at the same row count whatever the fragment sizes.
    With shuffle, the order of a rank's full batches is shuffled too (each stays contiguous).
    """
    table, share, batch_size = request.table, request.share, request.batch_size
    count = len(table.rows)
    fragment_order = _rng(request.seed, request.epoch).permutation(count) if request.shuffle else np.arange(count)
    starts = table.starts
    pieces = [np.arange(starts[index], starts[index] + table.rows[index], dtype=np.int64) for index in fragment_order]
    sequence = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    sequence = cyclic(sequence, share.rows_per_rank * request.world_size)
    mine = sequence[request.rank * share.rows_per_rank : (request.rank + 1) * share.rows_per_rank]
    batches = _chunks(mine, batch_size)
    full = share.rows_per_rank // batch_size
    if request.shuffle and full > 1:
        order = _rng(request.seed, request.epoch, 1 + request.rank).permutation(full)
        batches = [batches[index] for index in order] + batches[full:]
    return batches


def full_scan_batches(request: EpochRequest) -> list[np.ndarray]:
    """Every rank reads every row (evaluation and inference, not DDP training)."""
    rows = request.table.total_rows
    order = _rng(request.seed, request.epoch).permutation(rows) if request.shuffle else np.arange(rows)
    return _chunks(order.astype(np.int64), request.batch_size)


STRATEGIES: dict[str, Callable[[EpochRequest], list[np.ndarray]]] = {
    "distributed": distributed_batches,
    "sharded_batch": sharded_batch_batches,
    "sharded_fragment": sharded_fragment_batches,
    "full_scan": full_scan_batches,
}
check_registry(STRATEGIES, SAMPLERS, "data.sampler")


def strategy_function(sampler: str) -> Callable[[EpochRequest], list[np.ndarray]]:
    try:
        return STRATEGIES[sampler]
    except KeyError:
        raise ValueError(f"unknown sampler {sampler!r}: use one of {', '.join(STRATEGIES)}") from None


@dataclass(frozen=True)
class EpochPlanner:
    """One rank's batches for any epoch, recomputed from (seed, epoch) wherever they are needed:
    in the main process or in a DataLoader worker. ``fixed`` holds the batches of one epoch that
    were planned otherwise (an epoch resumed at a new layout, see :class:`ResumedEpoch`)."""

    sampler: str
    layout: EpochRequest  # everything but the epoch, which each call supplies
    fixed: tuple[int, tuple[np.ndarray, ...]] | None = None

    def __call__(self, epoch: int) -> list[np.ndarray]:
        if self.fixed is not None and epoch == self.fixed[0]:
            return list(self.fixed[1])
        return strategy_function(self.sampler)(replace(self.layout, epoch=epoch))


def epoch_planner(
    table: FragmentTable,
    sampler: str,
    rank: int,
    world_size: int,
    batch_size: int,
    *,
    uneven: str = "drop",
    shuffle: bool = True,
    seed: int = 0,
) -> EpochPlanner:
    """The planner of one rank; an unknown sampler or a rank outside the world fails here."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    strategy_function(sampler)
    return EpochPlanner(sampler, EpochRequest(table, rank, world_size, batch_size, uneven, shuffle, seed, epoch=0))


def epoch_batches(
    table: FragmentTable, sampler: str, rank: int, world_size: int, batch_size: int, *, epoch: int = 0, **options: Any
) -> list[np.ndarray]:
    """This rank's batches (arrays of row ids) for one epoch; the same count on every rank.
    ``options``: ``uneven``, ``shuffle`` and ``seed``, as :func:`epoch_planner` takes them."""
    return epoch_planner(table, sampler, rank, world_size, batch_size, **options)(epoch)


def worker_steps(steps: int, start: int, worker: int, num_workers: int) -> range:
    """Batch indices one DataLoader worker reads when an epoch resumes at ``start``.

    Worker w takes every num_workers-th batch from start + w; the DataLoader collects its workers
    round-robin, so the batches come out in plan order.
    """
    return range(start + worker, steps, num_workers)


def eval_batches(rows: int, rank: int, world_size: int, batch_size: int, mode: str = "sharded") -> list[np.ndarray]:
    """Evaluation rows of one rank: ``sharded`` a contiguous 1/world_size share (sizes differ by at
    most one row; every row exactly once over all ranks), ``full_scan`` every row."""
    if mode == "full_scan":
        start, stop = 0, rows
    elif mode == "sharded":
        start, stop = rows * rank // world_size, rows * (rank + 1) // world_size
    else:
        raise ValueError(f"unknown evaluation mode {mode!r}: use one of {', '.join(EVAL_MODES)}")
    return _chunks(np.arange(start, stop, dtype=np.int64), batch_size)


@dataclass(frozen=True)
class DataPlan:
    """One epoch of a training job, for every rank: computed from fragment metadata only."""

    style: str
    sampler: str
    rows: int
    fragments: int
    min_fragment_rows: int
    max_fragment_rows: int
    world_size: int
    batch_size: int
    uneven: str
    rows_per_rank: int
    steps_per_rank: int
    last_batch_rows: int
    dropped: int
    padded: int
    uri: str = ""
    version: int | None = None

    @property
    def batches(self) -> int:
        """Batches per epoch over all ranks."""
        return self.steps_per_rank * self.world_size

    def __str__(self) -> str:
        every = self.sampler == "full_scan"
        lines = [
            ("dataset", f"{self.uri}" + (f" (version {self.version})" if self.version is not None else "")),
            ("strategy", f"{self.style} / {self.sampler}" + ("" if every else f", uneven: {self.uneven}")),
            (
                "rows",
                f"{self.rows:,} in {self.fragments:,} fragments"
                + (f" ({self.min_fragment_rows:,}..{self.max_fragment_rows:,} rows each)" if self.fragments else ""),
            ),
            ("world size", f"{self.world_size:,} ranks x batch {self.batch_size:,}"),
            ("rows per rank", f"{self.rows_per_rank:,}" + (" (every rank reads every row)" if every else "")),
            (
                "steps per rank",
                f"{self.steps_per_rank:,}, the same on every rank"
                + (f" (last batch {self.last_batch_rows:,} rows)" if self.last_batch_rows not in (0, self.batch_size) else ""),
            ),
            ("batches", f"{self.batches:,} per epoch over all ranks"),
            ("dropped", f"{self.dropped:,} rows per epoch"),
            ("padded", f"{self.padded:,} rows per epoch (repeated)"),
        ]
        if not self.uri:
            lines = lines[1:]
        width = max(len(name) for name, _ in lines)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in lines)


def plan_from_table(
    table: FragmentTable,
    world_size: int,
    batch_size: int,
    *,
    style: str = "map",
    sampler: str = "distributed",
    uneven: str = "drop",
    uri: str = "",
    version: int | None = None,
) -> DataPlan:
    """The DataPlan of a strategy on a fragment table; O(fragments), whatever the row count."""
    strategy_function(sampler)
    rows = table.total_rows
    share = rank_share(rows, world_size, batch_size, uneven, every_rank_all_rows=sampler == "full_scan")
    return DataPlan(
        style=style,
        sampler=sampler,
        rows=rows,
        fragments=len(table.rows),
        min_fragment_rows=min(table.rows, default=0),
        max_fragment_rows=max(table.rows, default=0),
        world_size=world_size,
        batch_size=batch_size,
        uneven=uneven,
        rows_per_rank=share.rows_per_rank,
        steps_per_rank=share.steps,
        last_batch_rows=share.last_batch_rows,
        dropped=share.dropped,
        padded=share.padded,
        uri=uri,
        version=version,
    )


# ---- Resuming an epoch on a different world size or batch size --------------------------------
#
# An interrupted epoch is a chain of segments: the first read with the epoch's own plan, each later
# one after a resume that changed the world size or the per-rank batch. A new segment splits the
# rows the epoch has not yet consumed (in their planned order) into one contiguous share per rank,
# each cut into the same number of batches; shares differ by at most one row, so batches may differ
# by one row between ranks while every rank takes the same number of steps. The rest of the epoch
# is thus read exactly once. Two corners: with a batch of 1, a rank with the bigger share reads one
# batch of 2 rows; with fewer rows left than ranks, a rank with no share repeats rows of the
# remainder (those repeats are never counted as read).
