"""Reading one batch: a single ``take`` of sorted row ids and only the task's columns, then the
task's decode. Shared by the map-style and iterable strategies, and safe to pickle into worker
processes: the dataset is opened lazily in each process with the full options (storage options,
pinned version).

The reader, not the task, owns what keeps ranks in step and rows accounted for: the corrupt-row
policy (a bad row is replaced by a good row of the same batch, or fails naming the row), the
augmentation seed of each batch, and the ``row_id`` field of every batch.

Read-ahead: a worker is told the rows of the next batches it will read (``ahead``) and starts their
``take`` on background threads (``io_depth`` of them) while it decodes the current batch, so
waiting on an object store overlaps decoding instead of preceding it. Lance's ``take`` runs in
Rust without the GIL, so the threads cost no decode time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from lance_hpc.errors import UserError
from lance_hpc.loading.mix import offset_of, source_of
from lance_hpc.loading.transport import SharedBatch, worker_pool
from lance_hpc.storage.cache.node_cache import open_cache
from lance_hpc.storage.datasets import Dataset, ReadStats, open_dataset
from lance_hpc.storage.integrity import explain_read_error
from lance_hpc.storage.retry import retrying
from lance_hpc.tasks.base import ROW_ID, Batch, Decoder, FieldSpec

if TYPE_CHECKING:
    from lance_hpc.spec.schema import CacheSpec

log = logging.getLogger("lance_hpc.data")
ROW_ID_FIELD = FieldSpec((), torch.int64)


class CorruptRowError(UserError):
    """A row the task could not decode, with ``on_corrupt: fail``; the message names the row."""


@dataclass
class BatchReader:
    """Reads and decodes batches of row ids; holds an open dataset only after first use."""

    uri: str
    version: int
    options: dict[str, str] = field(repr=False)
    decoder: Decoder
    on_corrupt: str = "skip"
    seed: int = 0
    rank: int = 0
    io_depth: int = 0  # batches read ahead on background threads
    cache: CacheSpec | None = None  # the node-local cache, opened per process on first take
    io_timeout_s: float = 120.0  # how long a take keeps retrying a failing store
    _dataset: Dataset | None = field(default=None, repr=False, compare=False)
    _ahead: Any = field(default=None, repr=False, compare=False)  # ReadAhead, per process
    _window: tuple[bytes, Any] | None = field(default=None, repr=False, compare=False)  # (its rows, its table)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_dataset"] = None  # Lance is not fork-safe: each process opens its own
        state["_ahead"] = None  # threads do not cross processes
        state["_window"] = None
        return state

    @property
    def dataset(self) -> Dataset:
        if self._dataset is None:
            self._dataset = open_dataset(self.uri, self.version, self.options, self.io_timeout_s, self.rank)
        return self._dataset

    @property
    def fields(self) -> dict[str, FieldSpec]:
        return {**self.decoder.fields(), ROW_ID: ROW_ID_FIELD}

    def take(self, row_ids: np.ndarray, stats: ReadStats) -> Any:
        """The task's columns of ``row_ids`` (sorted, unique) as an Arrow table: one ``take``, of
        the node-local cache for rows it holds (see :mod:`lance_hpc.storage.cache`), else of the store."""
        columns = list(self.decoder.columns)
        if self.cache is not None:
            cache = open_cache(self.cache.dir, self.cache.max_gb, self.uri, self.version, self.options, lambda: self.dataset)
            return cache.take(row_ids, columns, stats, lambda rows: self.take_from_store(rows, columns, stats))
        return self.take_from_store(row_ids, columns, stats)

    def take_from_store(self, row_ids: np.ndarray, columns: list[str], stats: ReadStats) -> Any:
        """One Lance ``take`` of the store, retried through transient faults for up to
        ``io_timeout_s`` and counted in ``stats.retries`` (see :mod:`lance_hpc.storage.retry`)."""

        def count_retry() -> None:
            stats.retries += 1

        return retrying(
            lambda: self.dataset.take(row_ids, columns=columns),
            what=f"take of {len(row_ids)} rows of {self.uri}",
            uri=self.uri,
            options=self.options,
            timeout_s=self.io_timeout_s,
            on_retry=count_retry,
            rank=self.rank,
            explain=lambda error: explain_read_error(error, self._dataset, self.uri, self.options),
        )

    def _fetch(self, unique: np.ndarray, ahead: Sequence[np.ndarray]) -> tuple[Any, ReadStats]:
        """The table of ``unique`` (read ahead earlier, or now), after starting the reads of ``ahead``."""
        if self.io_depth == 0:
            stats = ReadStats()
            return self.take(unique, stats), stats
        if self._ahead is None:
            self._ahead = ReadAhead(self, self.io_depth)
        return self._ahead.get(unique, ahead)

    def _from_window(self, window: np.ndarray, unique: np.ndarray, ahead: Sequence[np.ndarray]) -> tuple[Any, ReadStats]:
        """The rows ``unique`` out of ``window`` (sorted row ids), which is read whole, once, and
        kept until a batch of another window comes (``sampler: block``)."""
        key = window.tobytes()
        stats = ReadStats()
        if self._window is None or self._window[0] != key:
            self._window = None  # the old window's bytes go before the new ones come
            table, stats = self._fetch(window, ahead)
            self._window = (key, table)
        return self._window[1].take(np.searchsorted(window, unique)), stats

    def read(
        self,
        row_ids: np.ndarray,
        epoch: int,
        batch_index: int,
        *,
        shared: bool = True,
        ahead: Sequence[np.ndarray] = (),
        window: np.ndarray | None = None,
    ) -> tuple[Batch, ReadStats] | SharedBatch:
        """(fields, read stats) of the rows ``row_ids``, in row-id order; ``ahead``: the rows this
        process reads next, to start reading now (see the module doc); ``window``: the sorted rows
        the batch is cut from, read whole (``sampler: block``).

        In a DataLoader worker (and with ``shared``) the batch is written into one of the worker's
        shared buffers and reaches the main process as that same pair (see
        :mod:`lance_hpc.loading.transport`)."""
        ids = np.asarray(row_ids, dtype=np.int64)
        unique, inverse = np.unique(ids, return_inverse=True)  # sorted: Lance reads in file order
        if window is None:
            table, stats = self._fetch(unique, ahead)
        else:
            table, stats = self._from_window(np.asarray(window, dtype=np.int64), unique, ahead)
        if len(unique) != len(ids):  # padding can repeat a row within a batch
            table = table.take(inverse)
            unique = unique[inverse]
        return self.batch(table, unique, stats, epoch, batch_index, shared)

    def batch(
        self, table: pa.Table, unique: np.ndarray, stats: ReadStats, epoch: int, batch_index: int, shared: bool
    ) -> tuple[Batch, ReadStats] | SharedBatch:
        """The decoder's fields of ``table``, whose rows are ``unique``: the batch :meth:`read` returns."""
        # Augmentation depends only on (seed, epoch, rank, batch), not on which worker decodes.
        rng = np.random.default_rng([self.seed % 2**64, epoch, self.rank, batch_index])
        shared_batch = None
        if shared and torch.utils.data.get_worker_info() is not None:
            shared_batch = worker_pool().batch(self.fields, len(unique))
            out = shared_batch.fields
        else:
            out = {name: spec.empty(len(unique)) for name, spec in self.fields.items()}
        try:
            out[ROW_ID].copy_(torch.from_numpy(unique))
            bad = self.decoder.decode(table, out, rng)
            stats.skipped = apply_corrupt_policy(out, bad, self.on_corrupt, self.uri)
        except BaseException:
            if shared_batch is not None:
                shared_batch.release()
            raise
        if shared_batch is None:
            return out, stats
        shared_batch.stats = stats
        return shared_batch


class ReadAhead:
    """Takes started ahead of need on ``depth`` threads, keyed by their row ids; the oldest are
    dropped when a guess of what comes next was wrong, so memory stays at ``depth`` batches."""

    def __init__(self, reader: BatchReader, depth: int) -> None:
        self.reader = reader
        self.depth = depth
        self.pool = ThreadPoolExecutor(depth, thread_name_prefix="lance_hpc-read-ahead")
        self.started: OrderedDict[bytes, Future] = OrderedDict()
        self.lock = threading.Lock()

    def _take(self, unique: np.ndarray) -> tuple[Any, ReadStats]:
        stats = ReadStats()
        return self.reader.take(unique, stats), stats

    def get(self, unique: np.ndarray, ahead: Sequence[np.ndarray]) -> tuple[Any, ReadStats]:
        with self.lock:
            future = self.started.pop(unique.tobytes(), None)
            for rows in ahead[: self.depth]:
                rows = np.unique(np.asarray(rows, dtype=np.int64))
                key = rows.tobytes()
                if key not in self.started:
                    self.started[key] = self.pool.submit(self._take, rows)
            while len(self.started) > self.depth:
                _, stale = self.started.popitem(last=False)
                stale.cancel()
        return future.result() if future is not None else self._take(unique)


def apply_corrupt_policy(batch: Batch, bad: dict[int, str], on_corrupt: str, dataset: str) -> int:
    """Replace each bad row by a good row of the batch (every field, so the batch keeps its size
    and every rank its step count), logging each; with ``fail`` raise naming the first bad row.
    Returns the rows replaced. ``row_id`` keeps naming the row a sample now came from."""
    if not bad:
        return 0
    rows = batch[ROW_ID]
    if on_corrupt == "fail":
        index, reason = min(bad.items())
        raise CorruptRowError(
            f"cannot decode row {int(rows[index])} of {dataset or 'the dataset'}: {reason}. Fix or delete the row, "
            "or set data.on_corrupt: skip to replace such rows and count them."
        )
    good = [index for index in range(len(rows)) if index not in bad]
    for position, (index, reason) in enumerate(sorted(bad.items())):
        log.warning("skipping corrupt row %d of %s: %s", int(rows[index]), dataset or "the dataset", reason)
        for values in batch.values():
            if good:
                values[index].copy_(values[good[position % len(good)]])
            else:
                values[index].zero_()  # a batch with no decodable row keeps its shape
    return len(bad)


def keep_batch(batch: Any) -> Any:
    """collate_fn for batches that the dataset already returns as tensors."""
    return batch


@dataclass
class MixReader(BatchReader):
    """Reads a batch of a mix: each source's rows with that source's reader, one table, one decode."""

    parts: tuple[BatchReader, ...] = ()

    def _fetch(self, unique: np.ndarray, ahead: Sequence[np.ndarray]) -> tuple[Any, ReadStats]:
        sources = source_of(unique)
        tables, stats = [], ReadStats()
        for source in np.unique(sources):
            later = [offset_of(rows[source_of(rows) == source]) for rows in ahead]
            table, part_stats = self.parts[int(source)]._fetch(offset_of(unique[sources == source]), [r for r in later if len(r)])
            tables.append(table)
            stats.add(part_stats)
        if len(tables) == 1:
            return tables[0], stats
        return pa.concat_tables(tables, promote_options="permissive"), stats
