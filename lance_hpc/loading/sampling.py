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
:mod:`lance_hpc.loading.resume`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from lance_hpc.spec.choices import (
    EVAL_MODES,
    SAMPLERS,
    UNEVEN_MODES,
    check_registry,
)

if TYPE_CHECKING:
    from lance_hpc.storage.datasets import Dataset


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
    num_workers: int = 1  # sampler: block: the DataLoader workers each window is dealt to
    run_rows: int = 1  # sampler: block: rows of one read (a run of neighbouring rows)
    window_runs: int = 32  # sampler: block: runs shuffled together

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


class BlockPlan(list):
    """A rank's batches (a list of row-id arrays) that also knows the window each batch is cut from:
    ``windows[window_of[index]]`` holds the sorted rows of batch ``index``'s window."""

    def __init__(self, batches: list[np.ndarray], windows: list[np.ndarray], window_of: np.ndarray):
        super().__init__(batches)
        self.windows = windows
        self.window_of = window_of

    def mapped(self, rows: np.ndarray) -> BlockPlan:
        """The same plan with every row id looked up in ``rows`` (a filtered dataset's row offsets)."""
        return BlockPlan([rows[batch] for batch in self], [rows[window] for window in self.windows], self.window_of)


def runs_of(table: FragmentTable, run_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(first row, length) of every run: each fragment cut into pieces of ``run_rows`` rows."""
    run_rows = max(1, run_rows)
    counts = np.array([math.ceil(rows / run_rows) for rows in table.rows], dtype=np.int64)
    fragment = np.repeat(np.arange(len(table.rows)), counts)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = table.starts[fragment] + within * run_rows
    lengths = np.minimum(run_rows, np.asarray(table.rows, dtype=np.int64)[fragment] - within * run_rows)
    return starts.astype(np.int64), lengths.astype(np.int64)


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The row ids of runs laid end to end."""
    if len(starts) == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets


def block_order(table: FragmentTable, run_rows: int, shuffle: bool, rng: np.random.Generator) -> np.ndarray:
    """Every row once: runs of neighbouring rows from all fragments, in shuffled run order."""
    starts, lengths = runs_of(table, run_rows)
    order = rng.permutation(len(starts)) if shuffle else np.arange(len(starts))
    return expand_runs(starts[order], lengths[order])


def block_batches(request: EpochRequest) -> BlockPlan:
    """Runs of ``run_rows`` neighbouring rows (about data.block_kb each, one read) from every
    fragment in a shuffled order; each rank takes one contiguous share of that run sequence, cut
    into one part per DataLoader worker, and each part into windows of ``window_runs`` runs (a
    multiple of the batch). A window's rows are shuffled together and cut into that worker's
    batches, so a worker reads each run once, in one request, and holds one window at a time.

    Batch j of the rank comes from worker ``j % num_workers``, as the DataLoader deals them; the
    plan depends on the worker count, which an epoch resumed at another layout keeps."""
    table, share, batch_size = request.table, request.share, request.batch_size
    rng = _rng(request.seed, request.epoch)
    sequence = cyclic(block_order(table, request.run_rows, request.shuffle, rng), share.rows_per_rank * request.world_size)
    mine = sequence[request.rank * share.rows_per_rank : (request.rank + 1) * share.rows_per_rank]
    steps, workers = share.steps, max(1, request.num_workers)
    window_rows = math.ceil(max(1, request.run_rows) * request.window_runs / batch_size) * batch_size
    batches: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * steps
    window_of = np.zeros(steps, dtype=np.int64)
    windows: list[np.ndarray] = []
    start = 0
    for worker in range(min(workers, steps)):
        indices = range(worker, steps, workers)
        rows = len(indices) * batch_size - (batch_size - share.last_batch_rows if (steps - 1) % workers == worker else 0)
        part = mine[start : start + rows]
        start += rows
        for first in range(0, len(part), window_rows):
            window = part[first : first + window_rows]
            if request.shuffle:
                window = _rng(request.seed, request.epoch, 1 + request.rank, 1 + worker, first).permutation(window)
            windows.append(np.unique(window))
            for offset in range(0, len(window), batch_size):
                index = indices[(first + offset) // batch_size]
                batches[index] = window[offset : offset + batch_size]
                window_of[index] = len(windows) - 1
    return BlockPlan(batches, windows, window_of)


def full_scan_batches(request: EpochRequest) -> list[np.ndarray]:
    """Every rank reads every row (evaluation and inference, not DDP training)."""
    rows = request.table.total_rows
    order = _rng(request.seed, request.epoch).permutation(rows) if request.shuffle else np.arange(rows)
    return _chunks(order.astype(np.int64), request.batch_size)


STRATEGIES: dict[str, Callable[[EpochRequest], list[np.ndarray]]] = {
    "distributed": distributed_batches,
    "block": block_batches,
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
    rows: np.ndarray | None = None  # a filtered dataset: the row offset of each selected row

    def __call__(self, epoch: int) -> list[np.ndarray]:
        if self.fixed is not None and epoch == self.fixed[0]:
            batches = list(self.fixed[1])
        else:
            batches = strategy_function(self.sampler)(replace(self.layout, epoch=epoch))
        if self.rows is None:
            return batches
        if isinstance(batches, BlockPlan):
            return batches.mapped(self.rows)
        return [self.rows[batch] for batch in batches]


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
    num_workers: int = 1,
    run_rows: int = 1,
    window_runs: int = 32,
    rows: np.ndarray | None = None,
) -> EpochPlanner:
    """The planner of one rank; an unknown sampler or a rank outside the world fails here.
    ``rows``: the row offsets of a filtered dataset's selected rows (``table`` counts them)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    strategy_function(sampler)
    request = EpochRequest(
        table, rank, world_size, batch_size, uneven, shuffle, seed, 0, max(1, num_workers), run_rows, window_runs
    )
    return EpochPlanner(sampler, request, rows=rows)


def epoch_batches(
    table: FragmentTable, sampler: str, rank: int, world_size: int, batch_size: int, *, epoch: int = 0, **options: Any
) -> list[np.ndarray]:
    """This rank's batches (arrays of row ids) for one epoch; the same count on every rank.
    ``options``: ``uneven``, ``shuffle`` and ``seed``, as :func:`epoch_planner` takes them."""
    return epoch_planner(table, sampler, rank, world_size, batch_size, **options)(epoch)


def read_hints(
    batches: list[np.ndarray], index: int, num_workers: int, depth: int
) -> tuple[np.ndarray | None, tuple[np.ndarray, ...]]:
    """(the window of batch ``index`` or None, the rows to start reading ahead) for the worker
    that reads it: a block plan's next window of that worker, else its next ``depth`` batches
    (every ``num_workers``-th: the DataLoader deals batches to its workers round-robin)."""
    step = max(num_workers, 1)
    if isinstance(batches, BlockPlan):
        window = batches.window_of[index]
        later = batches.window_of[index + step :: step]
        following = later[later != window]
        ahead = (batches.windows[int(following[0])],) if depth and len(following) else ()
        return batches.windows[int(window)], ahead
    return None, tuple(batches[index + step * k] for k in range(1, depth + 1) if index + step * k < len(batches))


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


def fragment_table(dataset: Dataset) -> FragmentTable:
    """Fragment ids and live row counts from the manifest (no data files read)."""
    fragments = dataset.get_fragments()
    rows = []
    for fragment in fragments:
        count = fragment.metadata.num_rows
        rows.append(int(count) if count is not None else fragment.count_rows())
    return FragmentTable.from_rows(rows, [fragment.fragment_id for fragment in fragments])
