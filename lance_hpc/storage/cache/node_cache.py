"""Reading through the node-local cache (see :mod:`lance_hpc.storage.cache`).

A process opens the cache's dataset root (:mod:`lance_hpc.storage.cache.files`: where the files
live, how they are fetched and locked; :mod:`lance_hpc.storage.cache.dirs`: the directories, and
:mod:`lance_hpc.storage.cache.eviction`: how they are evicted) at its pinned version; rows of fragments whose
files are all there are read from it, the other rows from the store, while a background thread
fetches the missing fragments. Every rank and DataLoader worker of the user on the node shares the
cache. The dataset key is the dataset's URI and endpoint, and the manifest decides which files a
version reads: a process checks that the cached manifest lists the same files as the store's
manifest of its version (the same version number of a dataset deleted and written again does not),
and fetches it again otherwise, so a reader never gets another version's bytes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.storage.cache.dirs import cache_root, user_directory
from lance_hpc.storage.cache.eviction import evict
from lance_hpc.storage.cache.files import (
    GIB,
    CachedFile,
    FileLock,
    Source,
    dataset_key,
    fetch,
    fragment_files,
    is_whole,
    manifest_names,
    own_files,
    touch,
    warn_once,
)
from lance_hpc.storage.cache.names import MANIFEST_DIR, Uncacheable, is_cached_name, lock_path
from lance_hpc.storage.datasets import Dataset, ReadStats

log = logging.getLogger("lance_hpc.data")

TOUCH_INTERVAL_S = 10.0  # a process marks a fragment used at most this often
RETRY_FETCH_S = 60.0  # after a failed fetch, the fragment is read from the store this long
DELETIONS = -2  # the fill job that fetches every deletion file of the version
STOP = -1  # the fill thread's last job


_opening = threading.Lock()
_open: dict[tuple, NodeCache] = {}


def open_cache(
    directory: str, max_gb: float, uri: str, version: int, options: Mapping[str, str], dataset: Callable[[], Dataset]
) -> NodeCache:
    """This process's :class:`NodeCache` of ``uri`` at ``version`` (opened on first use; threads
    share it). ``dataset``: the dataset opened on the store, asked for only on first use."""
    key = (os.getpid(), directory, max_gb, uri, version, options.get("endpoint"))
    with _opening:
        if key not in _open:
            try:
                _open[key] = NodeCache(directory, max_gb, uri, version, options, dataset())
            except OSError as error:
                if error.filename is None:  # not the cache directory: the store's error as it is
                    raise
                raise UserError(
                    f"data.cache.dir {directory}: {error.strerror or error}: choose a writable directory on a "
                    "node-local disk, or remove data.cache"
                ) from None
        return _open[key]


class NodeCache:
    """One dataset version through the node-local cache, in one process (thread-safe)."""

    def __init__(self, directory: str, max_gb: float, uri: str, version: int, options: Mapping[str, str], dataset: Any):
        self.directory = user_directory(Path(os.path.expandvars(os.path.expanduser(directory))))
        self.max_bytes = int(max_gb * GIB)
        self.root = cache_root(self.directory, dataset_key(uri, options), uri)
        self.version = version
        self.source = Source(uri, options)
        fragments = dataset.get_fragments()
        self.files = [fragment_files(fragment) for fragment in fragments]
        self._warn_of_foreign_names(uri, fragments)
        rows = [int(f.metadata.num_rows if f.metadata.num_rows is not None else f.count_rows()) for f in fragments]
        self.starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)[:-1]]).astype(np.int64)
        self.ids = [fragment.fragment_id for fragment in fragments]
        self.signature = list(zip(self.ids, self.files))
        # A take by dataset row offset reads the deletion file of every fragment, a take by
        # fragment only its own: the first needs them all cached, and is the faster for rows
        # spread over many fragments (one call instead of one per fragment).
        self.deletions = [file for files in self.files for file in files or () if file.path.startswith("_deletions/")]
        self.deletions_cached = False
        self.deletions_checked = -RETRY_FETCH_S
        self.lock = threading.Lock()
        self.complete: set[int] = set()  # fragments whose files were all here when last looked
        self.touched: dict[int, float] = {}
        self.failed: dict[int, float] = {}  # fragment -> when its fetch failed
        self.queued: set[int] = set()
        self.fetched: list[str] = []  # files this process downloaded, in order
        self.fetched_bytes = 0
        self.todo: queue.Queue[int] = queue.Queue()
        self.filler: threading.Thread | None = None
        self.in_use = FileLock(Path(), shared=True)
        self.local = self._open_local()

    def _warn_of_foreign_names(self, uri: str, fragments: list[Any]) -> None:
        """One warning when the manifest names files under names Lance never writes (a manifest
        written by hand, perhaps to make the cache write outside its directory): their fragments
        are read from the store, uncached."""
        foreign = [
            (fragment.fragment_id, file.path)
            for fragment, files in zip(fragments, self.files)
            if files is None
            for file in own_files(fragment) or ()
            if not is_cached_name(file.path)
        ]
        if foreign:
            warn_once(
                f"foreign names of {uri} at {self.version}",
                "node cache: in version %d of %s, %d of the fragments name files under names Lance never "
                "writes (fragment %d: %r); the cache keeps only Lance's own names inside its directory, so these "
                "fragments are read from the store, uncached",
                self.version,
                uri,
                len({fragment for fragment, _ in foreign}),
                *foreign[0],
            )

    def _open_local(self) -> Any:
        """The cache root opened at this version: its manifest fetched (or checked against the
        store's) first, and held in use so that eviction leaves it. None when a lock file of the
        manifest cannot be opened: every row is read from the store then."""
        import lance

        manifest = next(
            (CachedFile(name, size) for name in manifest_names(self.version) if (size := self.source.size(name)) is not None),
            None,
        )
        if manifest is None:
            raise UserError(f"data.cache: no manifest of version {self.version} under {self.source.root}/{MANIFEST_DIR}")
        name = manifest.path
        self.in_use = FileLock(lock_path(self.root, name, "use"), shared=True)
        try:
            self.in_use.acquire()
            for _attempt in range(2):
                fetch(self.source, self.root, manifest, wait=True)
                local = lance.dataset(str(self.root), version=self.version)
                if [(f.fragment_id, fragment_files(f)) for f in local.get_fragments()] == self.signature:
                    return local
                log.warning(
                    "node cache: %s holds another dataset's version %d; fetching its manifest again", self.root, self.version
                )
                (self.root / name).unlink(missing_ok=True)
        except Uncacheable as error:
            warn_once(
                error.filename,
                "node cache: reading version %d of %s from the store, uncached: %s",
                self.version,
                self.source.root,
                error,
            )
            return None
        raise UserError(f"data.cache: the cached manifest {self.root / name} keeps differing from the store's")

    def close(self) -> None:
        """Stop fetching (a fetch under way finishes) and let eviction take this version's manifest."""
        with self.lock:
            self.queued.clear()
            while not self.todo.empty():
                self.todo.get_nowait()
        self.todo.put(STOP)
        if self.filler is not None:
            self.filler.join()
            self.filler = None
        self.in_use.release()

    def drain(self) -> None:
        """Wait until every fetch asked for so far has ended."""
        self.todo.join()

    def take(self, row_ids: np.ndarray, columns: list[str], stats: ReadStats, from_store: Callable[[np.ndarray], Any]) -> Any:
        """``columns`` of ``row_ids`` (sorted, unique): rows of cached fragments from local disk,
        the others through ``from_store``; counts rows in ``stats.cache_hits`` / ``cache_misses``."""
        if self.local is None:
            stats.cache_misses += len(row_ids)
            return from_store(row_ids)
        fragment_of = np.searchsorted(self.starts, row_ids, side="right") - 1
        by_offset = self._all_deletions_cached()
        cached = self._cached(np.unique(fragment_of))
        local = np.isin(fragment_of, cached)
        if local.any():
            try:
                if by_offset:
                    local_table = self.local.take(row_ids[local], columns=columns)
                else:
                    local_table = self._take_by_fragment(row_ids[local], fragment_of[local], columns)
            except OSError:  # evicted between the check and the read
                with self.lock:
                    self.complete.difference_update(int(index) for index in cached)
                    self.deletions_cached = False
                local = np.zeros(len(row_ids), dtype=bool)
        hits = int(local.sum())
        stats.cache_hits += hits
        stats.cache_misses += len(row_ids) - hits
        if hits == 0:
            return from_store(row_ids)
        if hits == len(row_ids):
            return local_table
        store_table = from_store(row_ids[~local])
        order = np.argsort(np.concatenate([row_ids[local], row_ids[~local]]), kind="stable")
        return pa.concat_tables([local_table, store_table]).take(order)

    def _take_by_fragment(self, row_ids: np.ndarray, fragment_of: np.ndarray, columns: list[str]) -> Any:
        bounds = np.flatnonzero(np.diff(fragment_of)) + 1
        parts = []
        for rows, index in zip(np.split(row_ids, bounds), fragment_of[np.concatenate([[0], bounds])]):
            fragment = self.local.get_fragment(self.ids[index])
            parts.append(fragment.take(rows - self.starts[index], columns=columns))
        return pa.concat_tables(parts)

    def _all_deletions_cached(self) -> bool:
        """Whether every deletion file of the version is here (looked for at most once a second;
        fetched in the background when not)."""
        if self.deletions_cached:
            return True
        now = time.monotonic()
        with self.lock:
            if now - self.deletions_checked < 1.0:
                return False
            self.deletions_checked = now
        if all(is_whole(self.root / file.path, file.size) for file in self.deletions):
            self.deletions_cached = True
            return True
        self._ask([DELETIONS], now)
        return False

    def _cached(self, fragments: np.ndarray) -> list[int]:
        """Of ``fragments``, those whose files are all cached, marked used; fetches the others."""
        now = time.monotonic()
        cached, missing = [], []
        for index in (int(value) for value in fragments):
            files = self.files[index]
            if files is None:
                continue
            with self.lock:
                known = index in self.complete
            if not known and not all(is_whole(self.root / file.path, file.size) for file in files):
                missing.append(index)
                continue
            if now - self.touched.get(index, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S:
                try:
                    for file in files:
                        touch(self.root / file.path)
                except FileNotFoundError:  # evicted
                    with self.lock:
                        self.complete.discard(index)
                    missing.append(index)
                    continue
                self.touched[index] = now
            with self.lock:
                self.complete.add(index)
            cached.append(index)
        self._ask(missing, now)
        return cached

    def _ask(self, fragments: list[int], now: float) -> None:
        with self.lock:
            for index in fragments:
                if index in self.queued or now - self.failed.get(index, -RETRY_FETCH_S) < RETRY_FETCH_S:
                    continue
                if index != DELETIONS and sum(file.size or 0 for file in self.files[index] or ()) > self.max_bytes:
                    continue  # would evict itself
                self.queued.add(index)
                self.todo.put(index)
            if self.filler is None and self.queued:
                self.filler = threading.Thread(target=self._fill, name="lance_hpc-cache-fill", daemon=True)
                self.filler.start()

    def _fill(self) -> None:
        while True:
            index = self.todo.get()
            try:
                if index == STOP:
                    return
                with self.lock:
                    if index not in self.queued:
                        continue  # dropped by close
                self._fill_fragment(index)
            finally:
                with self.lock:
                    self.queued.discard(index)
                self.todo.task_done()

    def _fill_fragment(self, index: int) -> None:
        downloaded = 0
        try:
            for file in self.deletions if index == DELETIONS else self.files[index] or ():
                size = fetch(self.source, self.root, file)
                if size is None and index != DELETIONS:
                    return  # another process is fetching it; rows come from the store meanwhile
                if size:
                    downloaded += size
                    with self.lock:
                        self.fetched.append(file.path)
                        self.fetched_bytes += size
        except OSError as error:
            with self.lock:
                self.failed[index] = time.monotonic()
            what = "the deletion files" if index == DELETIONS else f"fragment {self.ids[index]}"
            if isinstance(error, Uncacheable):
                warn_once(error.filename, "node cache: reading %s of %s from the store, uncached: %s", what, self.root, error)
                return
            log.warning(
                "node cache: cannot fetch %s into %s (reading from the store for %.0f s): %s",
                what,
                self.root,
                RETRY_FETCH_S,
                error,
            )
            return
        if downloaded:
            evict(self.directory, self.max_bytes)
