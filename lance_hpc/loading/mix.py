"""Weighted mixtures of datasets (``data.mix``): what a step draws from each source.

The semantics, in the order a job meets them:

- **Draws follow the weights.** Over the whole job, source ``i`` has the ``k``-th of its draws at
  the virtual time ``(k + 1/2) / p_i`` (``p_i`` its weight over the sum of weights); the job takes
  draws in virtual-time order (ties to the earlier source). After ``n`` draws every source has
  ``n * p_i`` of them, give or take one, and that count only grows with ``n``.
- **Steps.** A step of ``world_size x batch_size`` rows takes the next draws of that order, groups
  them by source and deals them to the ranks in turn, so every rank's batch holds each source's
  share of the step to within one row, and every rank takes the same steps.
- **Each source has its own epochs.** A source's draws walk its own order of its (filtered) rows,
  reshuffled for each of its epochs from (seed, source, source epoch): a small source repeats,
  a big one is not read to its end, and within one source epoch no row is drawn twice. A step's
  draws of a source are contiguous in that order, split between the ranks in rank order.
- **The job's epoch** draws ``data.mix_epoch_rows`` rows over all ranks (default: the sources'
  selected rows together), cut to whole steps.
- **Resume.** Everything above is a function of the number of rows drawn so far over all ranks,
  whatever the world size or batch size that drew them: a job resumed at another layout continues
  from the same draw, and one resumed with new weights keeps every source's draws so far and
  follows the new weights from there (``base``), so nothing is read twice within a source epoch.

Row ids of a mix carry their source: ``source << SOURCE_BITS | row offset`` (:func:`source_of`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lance_hpc.errors import UserError
from lance_hpc.loading.sampling import FragmentTable, block_order
from lance_hpc.spec import DataSpec, MixSource

SOURCE_BITS = 40  # 2**40 rows per source
ROW_MASK = (1 << SOURCE_BITS) - 1


def source_of(row_ids: np.ndarray) -> np.ndarray:
    """The mix source of each row id."""
    return np.asarray(row_ids, dtype=np.int64) >> SOURCE_BITS


def offset_of(row_ids: np.ndarray) -> np.ndarray:
    """The row offset of each row id in its source's dataset."""
    return np.asarray(row_ids, dtype=np.int64) & ROW_MASK


def probabilities(weights: Sequence[float]) -> np.ndarray:
    """Each source's share of the draws. Divided by the largest weight before they are summed:
    the sum of weights near the float maximum (1e308) is infinite, every share 0, and then every
    draw came from the first source."""
    values = np.asarray(weights, dtype=np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"a mix's weights must be finite and positive, got {list(weights)}")
    scaled = values / values.max()
    return scaled / scaled.sum()


def draw_counts(n: int, probs: np.ndarray) -> np.ndarray:
    """Draws of each source among the first ``n`` in virtual-time order (see the module doc)."""
    sources = len(probs)
    # Below the first n for certain: the n-th draw's virtual time is at least n - sources / 2.
    counts = np.maximum(0, np.floor(n * probs - sources / 2) - 2).astype(np.int64)
    counts = np.minimum(counts, n)
    heap = [(float((counts[i] + 0.5) / probs[i]), i) for i in range(sources)]
    heapq.heapify(heap)
    for _ in range(n - int(counts.sum())):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (float((counts[i] + 0.5) / probs[i]), i))
    return counts


@dataclass(frozen=True)
class MixPart:
    """One source as the plan sees it: its selected rows per fragment and their row offsets."""

    table: FragmentTable
    offsets: np.ndarray | None  # None: every row of the dataset
    run_rows: int = 1

    @property
    def rows(self) -> int:
        return self.table.total_rows


@dataclass(frozen=True)
class MixSchedule:
    """The draws of a mix as a function of the rows drawn so far over all ranks (see the module doc)."""

    parts: tuple[MixPart, ...]
    weights: tuple[float, ...]
    sampler: str = "distributed"
    shuffle: bool = True
    seed: int = 0
    window_runs: int = 32
    base_rows: int = 0  # rows drawn before these weights applied
    base_draws: tuple[int, ...] = ()  # each source's draws then

    @property
    def probs(self) -> np.ndarray:
        return probabilities(self.weights)

    def draws_at(self, drawn: int) -> np.ndarray:
        """Each source's draws after ``drawn`` rows over all ranks."""
        base = np.asarray(self.base_draws or [0] * len(self.parts), dtype=np.int64)
        if drawn < self.base_rows:
            raise ValueError("a mix's weights changed after this point; it cannot be planned from here")
        return base + draw_counts(drawn - self.base_rows, self.probs)

    def rebased(self, drawn: int, weights: Sequence[float]) -> MixSchedule:
        """The same draws up to ``drawn`` rows, then new weights."""
        return MixSchedule(
            self.parts,
            tuple(float(w) for w in weights),
            self.sampler,
            self.shuffle,
            self.seed,
            self.window_runs,
            drawn,
            tuple(int(value) for value in self.draws_at(drawn)),
        )

    def source_order(self, source: int, epoch: int) -> np.ndarray:
        """Source ``source``'s row offsets in the order its epoch ``epoch`` draws them."""
        part = self.parts[source]
        rng = np.random.default_rng([self.seed % 2**64, 1 + source, epoch % 2**64])
        if self.sampler == "distributed":
            order = rng.permutation(part.rows) if self.shuffle else np.arange(part.rows)
        else:  # runs of neighbouring rows, shuffled together a window of runs at a time
            order = block_order(part.table, part.run_rows, self.shuffle, rng)
            if self.sampler == "block" and self.shuffle:
                window = max(1, part.run_rows) * self.window_runs
                order = np.concatenate([rng.permutation(order[i : i + window]) for i in range(0, len(order), window)])
        order = order.astype(np.int64)
        return part.offsets[order] if part.offsets is not None else order

    def row_ids(self, source: int, draws: np.ndarray) -> np.ndarray:
        """The row ids (source bits set) of a source's draw numbers."""
        rows = self.parts[source].rows
        epochs, positions = np.divmod(draws, rows)
        out = np.empty(len(draws), dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.source_order(source, int(epoch))[positions[chosen]]
        return (np.int64(source) << SOURCE_BITS) | out

    def rank_batches(self, start: int, steps: int, world_size: int, batch_size: int, rank: int) -> list[np.ndarray]:
        """Rank ``rank``'s batches of ``steps`` steps from ``start`` rows drawn (all ranks)."""
        if steps <= 0:
            return []
        per_step = world_size * batch_size
        count = steps * per_step
        probs = self.probs
        base = np.asarray(self.base_draws or [0] * len(self.parts), dtype=np.int64)
        first, last = self.draws_at(start), self.draws_at(start + count)
        sources = np.concatenate([np.full(last[i] - first[i], i, dtype=np.int64) for i in range(len(probs))])
        times = np.concatenate([(np.arange(first[i], last[i]) - base[i] + 0.5) / probs[i] for i in range(len(probs))])
        merged = sources[np.lexsort((sources, times))]  # the source of every draw, in draw order
        # Within a step, draws grouped by source and dealt to the ranks in turn: every rank gets
        # each source's share of the step to within one row, and exactly batch_size rows.
        slot = np.arange(count, dtype=np.int64)
        step = slot // per_step
        slot_source = merged[np.lexsort((slot, merged, step))]
        slot_rank = (slot % per_step) % world_size
        # A step's draws of a source are contiguous, split between ranks in rank order.
        order = np.lexsort((slot, slot_rank, step, slot_source))
        group_start = np.searchsorted(slot_source[order], np.arange(len(probs)))
        draw = np.empty(count, dtype=np.int64)
        within = np.arange(count) - group_start[slot_source[order]]
        draw[order] = first[slot_source[order]] + within
        mine = slot[slot_rank == rank]
        ids = np.empty(len(mine), dtype=np.int64)
        for source in range(len(probs)):
            chosen = slot_source[mine] == source
            ids[chosen] = self.row_ids(source, draw[mine][chosen])
        return [ids[i : i + batch_size] for i in range(0, len(ids), batch_size)]


@dataclass(frozen=True)
class MixPlanner:
    """One rank's batches of any job epoch of a mix. The epoch ``anchor_epoch`` starts (or, for a
    resumed one, continues) at ``anchor_rows`` drawn and has ``anchor_steps`` steps; each later
    epoch has ``steps_per_epoch``."""

    schedule: MixSchedule
    world_size: int
    batch_size: int
    rank: int
    steps_per_epoch: int
    anchor_epoch: int = 0
    anchor_rows: int = 0
    anchor_steps: int | None = None

    @property
    def rows_per_step(self) -> int:
        return self.world_size * self.batch_size

    def steps(self, epoch: int) -> int:
        if epoch == self.anchor_epoch and self.anchor_steps is not None:
            return self.anchor_steps
        return self.steps_per_epoch

    def start(self, epoch: int) -> int:
        """Rows drawn over all ranks when ``epoch`` starts (or continues, for the anchor epoch)."""
        if epoch < self.anchor_epoch:
            raise ValueError(f"epoch {epoch} was drawn before this plan begins (epoch {self.anchor_epoch})")
        if epoch == self.anchor_epoch:
            return self.anchor_rows
        return self.anchor_rows + (self.steps(self.anchor_epoch) + (epoch - self.anchor_epoch - 1) * self.steps_per_epoch) * (
            self.rows_per_step
        )

    def __call__(self, epoch: int) -> list[np.ndarray]:
        return self.schedule.rank_batches(self.start(epoch), self.steps(epoch), self.world_size, self.batch_size, self.rank)


def epoch_rows(data: DataSpec, parts: Sequence[MixPart]) -> int:
    """Rows a job epoch of the mix draws over all ranks, before it is cut to whole steps."""
    return data.mix_epoch_rows or sum(part.rows for part in parts)


def mix_steps(rows: int, world_size: int, batch_size: int) -> int:
    """Whole steps of ``rows`` rows (at least one)."""
    return max(1, rows // (world_size * batch_size))


def source_name(source: MixSource, index: int) -> str:
    """A short name of a source for logs and TensorBoard tags: its dataset's file name."""
    name = source.uri.rstrip("/").rsplit("/", 1)[-1].removesuffix(".lance") or f"source{index}"
    return f"{index}_{name}"


def pinned_mix(data: DataSpec, pinned: Sequence[dict[str, Any]], start_over: str) -> list[MixSource]:
    """The spec's mix with each source's version pinned as the checkpoint read it. The sources
    and their filters must be those of the checkpoint; weights may change."""
    sources = data.mix or []
    if [s.uri for s in sources] != [p["uri"] for p in pinned] or [s.filter for s in sources] != [p.get("filter") for p in pinned]:
        was = ", ".join(f"{p['uri']}" + (f" where {p['filter']}" if p.get("filter") else "") for p in pinned)
        raise UserError(
            f"data.mix names other sources or filters than the checkpoint was trained on ({was})\n"
            f"  fix: restore them (weights may change), or {start_over}"
        )
    pinned_sources = []
    for source, saved in zip(sources, pinned):
        if source.version is not None and source.version != saved["version"]:
            raise UserError(
                f"data.mix source {source.uri}: version {source.version} but the checkpoint was trained on version "
                f"{saved['version']}\n  fix: remove its version to resume, or {start_over}"
            )
        pinned_sources.append(source.model_copy(update={"version": saved["version"], "tag": None}))
    return pinned_sources
