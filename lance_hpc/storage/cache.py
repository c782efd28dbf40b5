"""The node-local cache (``data.cache``): Lance data files fetched once, read from local disk after.

Lance data files and deletion files are immutable and uniquely named, so the cache keeps whole
files. ``<dir>/lance_hpc-<uid>/<dataset key>/`` is itself a Lance dataset root: ``data/`` and
``_deletions/`` hold the files fetched so far, ``_versions/`` the manifest of every version read
through the cache. A process opens that root at its pinned version; rows of fragments whose files
are all there are read from it, the other rows from the store, while a background thread fetches
the missing fragments.

``<dir>`` may be shared by every user of the node (``/local/nvme/...``), so each user gets a
directory of their own in it, ``lance_hpc-<uid>``, mode 0700; the cache refuses one that is a
symlink, another user's, or open to others. Inside, a dataset root exists only with the marker file
the cache wrote into it (the root is renamed into place with it), and eviction deletes only files
of a marked root under the names the cache writes, never following a symlink: nothing else in
``<dir>`` is ever touched. Files are created 0600, temporary files exclusively, and no file is
created or opened through a symlink.

Every rank and DataLoader worker of the user on the node shares their directory:

- one process fetches a file: it holds an ``fcntl`` lock on the file's lock file under ``.locks/``
  while it downloads; the others find the lock taken and read from the store meanwhile (as does
  a process that cannot open the lock file: it warns once and leaves that file uncached);
- a fetch writes ``<name>.<pid>-<thread>.partial``, fsyncs it, checks its size against the
  manifest and renames it to ``<name>`` (then fsyncs the directory): a process killed mid-download
  leaves only a ``.partial`` file, which no reader opens and the next fetcher deletes. A cached
  file is used only when it is a regular file of the size the manifest gives (data files; the
  store's size for the manifest), and fetched again otherwise;
- the cache stays under ``max_gb``: after each fetch, data files are deleted oldest use first (a
  file's modification time is its last use; readers touch it), then deletion files and manifests.
  A deleted file still open by a reader stays readable (Linux); a reader that finds a file gone
  reads those rows from the store. The manifest of a version some process has open (a shared
  ``fcntl`` lock) is never deleted;
- the dataset key is the dataset's URI and endpoint, and the manifest decides which files a
  version reads. A process checks that the cached manifest lists the same files as the store's
  manifest of its version (the same version number of a dataset deleted and written again does
  not), and fetches it again otherwise, so a reader never gets another version's bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import queue
import re
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pyarrow as pa
from pyarrow import fs

from lance_hpc.errors import UserError
from lance_hpc.storage.checkpoint_store import filesystem_arguments
from lance_hpc.storage.datasets import Dataset, ReadStats
from lance_hpc.storage.files import replaced_atomically

log = logging.getLogger("lance_hpc.data")

CHUNK_BYTES = 16 * 2**20  # one ranged GET per chunk; the memory a fetch holds
TOUCH_INTERVAL_S = 10.0  # a process marks a fragment used at most this often
RETRY_FETCH_S = 60.0  # after a failed fetch, the fragment is read from the store this long
PARTIAL = ".partial"
MANIFEST_DIR = "_versions"
CACHED_DIRS = ("data", "_deletions", MANIFEST_DIR)
# The names the cache writes under each of CACHED_DIRS (Lance's names): eviction deletes nothing else
CACHED_NAMES = {
    "data": re.compile(r"[\w-]+\.lance"),
    "_deletions": re.compile(r"\d+-\d+-\d+\.(?:arrow|bin)"),
    MANIFEST_DIR: re.compile(r"\d+\.manifest"),
}
PARTIAL_NAME = re.compile(rf"(?P<final>.+)\.\d+-\d+{re.escape(PARTIAL)}")  # <name>.<pid>-<thread>.partial
ROOT_MARKER = ".lance_hpc-cache-root"
FILE_MODE = 0o600
GIB = 2**30
DELETIONS = -2  # the fill job that fetches every deletion file of the version
STOP = -1  # the fill thread's last job


@dataclass(frozen=True)
class CachedFile:
    """A file of the dataset, by its path under the dataset root; ``size`` from the manifest (None
    where it does not say)."""

    path: str
    size: int | None = None


def dataset_key(uri: str, options: Mapping[str, str]) -> str:
    """The cache subdirectory of a dataset: readable name plus a hash of its URI and endpoint."""
    identity = f"{options.get('endpoint', '')}|{uri.rstrip('/')}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", uri.rstrip("/").rsplit("/", 1)[-1])[:60] or "dataset"
    return f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def manifest_names(version: int) -> tuple[str, str]:
    """A version's manifest as Lance names it: the newer scheme first (u64 max minus the version,
    20 digits), then the older one."""
    return f"{MANIFEST_DIR}/{2**64 - 1 - version:020d}.manifest", f"{MANIFEST_DIR}/{version}.manifest"


def fragment_files(fragment: Any) -> tuple[CachedFile, ...] | None:
    """The files a fragment's rows are read from, or None when one lives under another base path
    (the cache only mirrors the dataset's own root)."""
    metadata = fragment.metadata
    files = []
    for data_file in metadata.files:
        if getattr(data_file, "base_id", None) is not None:
            return None
        files.append(CachedFile(f"data/{data_file.path}", data_file.file_size_bytes or None))
    deletion = metadata.deletion_file
    if deletion is not None:
        if getattr(deletion, "base_id", None) is not None:
            return None
        files.append(CachedFile(deletion.path(fragment.fragment_id)))
    return tuple(files)


class Source:
    """Whole files of a dataset root on local disk or S3-compatible storage, read sequentially."""

    def __init__(self, uri: str, options: Mapping[str, str]):
        scheme, separator, rest = uri.rstrip("/").partition("://")
        if not separator:
            self.filesystem, self.root = fs.LocalFileSystem(), os.path.abspath(uri)
        elif scheme == "file":
            self.filesystem, self.root = fs.LocalFileSystem(), rest
        elif scheme == "s3":
            self.filesystem, self.root = fs.S3FileSystem(**filesystem_arguments(options)), rest
        else:
            raise UserError(f"data.cache: {uri}: only local and s3:// datasets can be cached; remove data.cache")

    def size(self, path: str) -> int | None:
        """The size of the file at ``path``; None where there is no file."""
        info = self.filesystem.get_file_info(f"{self.root}/{path}")
        return info.size if info.type == fs.FileType.File else None

    def chunks(self, path: str) -> Iterator[bytes]:
        with self.filesystem.open_input_stream(f"{self.root}/{path}") as stream:
            while chunk := stream.read(CHUNK_BYTES):
                yield chunk


class UnusableLock(OSError):
    """A lock file the cache cannot open (a symlink, a directory, not writable): the file it guards
    is left uncached, and the rows read from the store."""


_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log ``message`` the first time this process meets ``key``; a lock that cannot be opened now
    will not open at the next batch either."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


class FileLock:
    """An exclusive or shared ``flock`` on a lock file; per open file, so threads exclude each other too."""

    def __init__(self, path: Path, shared: bool = False, wait: bool = True):
        self.path, self.shared, self.wait = path, shared, wait
        self.handle: int | None = None

    def acquire(self) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        except OSError as error:
            raise UnusableLock(error.errno, f"cannot open the lock file: {error.strerror}", str(self.path)) from None
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | (0 if self.wait else fcntl.LOCK_NB)
        try:
            fcntl.flock(handle, mode)
        except BlockingIOError:
            os.close(handle)
            return False
        self.handle = handle
        return True

    def release(self) -> None:
        if self.handle is not None:
            os.close(self.handle)  # closing the last descriptor drops the lock
            self.handle = None


def lock_path(root: Path, path: str, kind: str) -> Path:
    return root / ".locks" / f"{path.replace('/', '%')}.{kind}"


def is_whole(path: Path, size: int | None) -> bool:
    """Whether ``path`` is a regular file (not a symlink) of ``size`` bytes (any size where None)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and (size is None or info.st_size == size)


def fetch(source: Source, root: Path, file: CachedFile, wait: bool = False) -> int | None:
    """Copy ``file`` into ``root`` atomically unless it is there whole: the bytes downloaded, 0 if
    it was there, None if another process holds its lock (and ``wait`` is false). Raises
    :class:`UnusableLock` when its lock file cannot be opened."""
    final = root / file.path
    if is_whole(final, file.size):
        return 0
    lock = FileLock(lock_path(root, file.path, "fill"), wait=wait)
    if not lock.acquire():
        return None
    try:
        if is_whole(final, file.size):  # another process finished it while we took the lock
            return 0
        final.parent.mkdir(parents=True, exist_ok=True)
        for stale in final.parent.glob(f"{final.name}.*{PARTIAL}"):  # left by a fetcher that died
            stale.unlink(missing_ok=True)
        partial = final.with_name(f"{final.name}.{os.getpid()}-{threading.get_ident()}{PARTIAL}")
        size = 0
        with replaced_atomically(final, partial, mode=FILE_MODE, exclusive=True) as out:
            for chunk in source.chunks(file.path):
                out.write(chunk)
                size += len(chunk)
            if file.size is not None and size != file.size:
                raise OSError(f"{file.path}: read {size} bytes, the manifest says {file.size}")
        touch(final)
        return size
    finally:
        lock.release()


def touch(path: Path) -> None:
    """Mark ``path`` used now (its modification time orders eviction; nanoseconds, not the kernel's tick)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now), follow_symlinks=False)


def evict(directory: Path, max_bytes: int) -> int:
    """Delete least recently used files the cache wrote under ``directory`` (every dataset root in
    it that bears the cache's marker) until they total at most ``max_bytes``: data files, then
    deletion files, then manifests of versions not in use; delete partial files nobody is writing.
    Returns the bytes freed; 0 if another process is evicting."""
    guard = FileLock(directory / ".evict.lock", wait=False)
    try:
        if not guard.acquire():
            return 0
    except UnusableLock as error:
        warn_once(error.filename, "node cache: not evicting from %s: %s", directory, error)
        return 0
    try:
        files: list[tuple[int, int, Path, Path]] = []  # (last use, size, path, dataset root)
        for root, path, info in _cached_files(directory):
            if PARTIAL_NAME.fullmatch(path.name):
                _remove_abandoned(root, path)
            else:
                files.append((info.st_mtime_ns, info.st_size, path, root))
        total = sum(size for _, size, _, _ in files)
        freed = 0
        # data files first, least recently used first; deletion files (small, and all of them
        # make reads faster) and manifests only when the data files alone do not free enough
        order = sorted(files, key=lambda entry: (CACHED_DIRS.index(entry[2].parent.name), entry[0]))
        for _, size, path, root in order:
            if total - freed <= max_bytes:
                break
            relative = f"{path.parent.name}/{path.name}"
            if path.parent.name == MANIFEST_DIR:
                in_use = FileLock(lock_path(root, relative, "use"), wait=False)
                try:
                    if not in_use.acquire():
                        continue
                except UnusableLock:  # nobody can mark it in use either: kept, as if it were
                    continue
                try:
                    path.unlink(missing_ok=True)
                finally:
                    in_use.release()
            else:
                path.unlink(missing_ok=True)
            freed += size
            log.debug("node cache: evicted %s (%d bytes)", path, size)
        return freed
    finally:
        guard.release()


def _cached_files(directory: Path) -> Iterator[tuple[Path, Path, os.stat_result]]:
    """(dataset root, path, lstat) of each regular file under the cache's names in the cached
    directories of each marked root in ``directory``; symlinks are neither followed nor listed."""
    with os.scandir(directory) as entries:
        roots = [Path(entry.path) for entry in entries if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False)]
    for root in (root for root in roots if is_whole(root / ROOT_MARKER, None)):
        for sub in CACHED_DIRS:
            try:
                if not stat.S_ISDIR(os.lstat(root / sub).st_mode):
                    continue
                with os.scandir(root / sub) as entries:
                    found = [entry for entry in entries if entry.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                continue
            for entry in found:
                partial = PARTIAL_NAME.fullmatch(entry.name)
                if not CACHED_NAMES[sub].fullmatch(partial["final"] if partial else entry.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
                yield root, Path(entry.path), info


def _remove_abandoned(root: Path, partial: Path) -> None:
    named = PARTIAL_NAME.fullmatch(partial.name)
    assert named is not None, partial  # only partial directories come here
    final_name = named["final"]
    lock = FileLock(lock_path(root, f"{partial.parent.name}/{final_name}", "fill"), wait=False)
    try:
        if not lock.acquire():
            return
    except UnusableLock:
        return
    try:
        partial.unlink(missing_ok=True)
    finally:
        lock.release()


SHARED_MODE = 0o1777  # like /tmp: everyone adds their own directory, no one removes or renames another's


def shared_directory(directory: Path) -> None:
    """Make sure ``directory``, which the node's users share, lets each of them add a directory
    that no one else can swap: made mode 1777 where missing, refused where others may write to it
    without the sticky bit (they could rename this user's directory and put their own in its place)."""
    try:
        os.stat(directory)
    except FileNotFoundError:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(directory)
            # mkdir's mode is masked by the umask, which would leave the directory to its first user alone.
            os.chmod(directory, SHARED_MODE)
        except FileExistsError:  # another process (or user) made it meanwhile: checked below like any other
            pass
        except OSError as error:
            raise UserError(
                f"data.cache.dir: cannot create {directory}: {error.strerror or error}\n"
                "  fix: create it once with mode 1777 (mkdir -m 1777 DIR), or choose a data.cache.dir "
                "you can write on a node-local disk"
            ) from None
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise UserError(f"data.cache.dir: {directory} is not a directory\n  fix: choose another data.cache.dir")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise UserError(
            f"data.cache.dir: {directory} is writable by other users without the sticky bit (mode "
            f"{stat.filemode(info.st_mode)}), so they could replace your cache directory in it with "
            f"their own\n  fix: have its owner run chmod +t {directory}, or choose another data.cache.dir"
        )


def user_directory(directory: Path) -> Path:
    """This user's directory in ``directory`` (which other users of the node may share), created
    0700 on first use; refused where it is a symlink, another user's, or open to other users."""
    shared_directory(directory)
    mine = directory / f"lance_hpc-{os.geteuid()}"
    try:
        os.mkdir(mine, 0o700)
    except FileExistsError:
        pass
    except PermissionError:
        if not os.path.lexists(mine):
            raise UserError(
                f"data.cache.dir: you cannot create your cache directory {mine}: {directory} is not "
                f"writable by you (mode {stat.filemode(os.stat(directory).st_mode)})\n"
                f"  fix: have its owner run chmod 1777 {directory}, or choose another data.cache.dir"
            ) from None
    info = os.lstat(mine)
    fix = "remove it (or have its owner or an administrator remove it), or choose another data.cache.dir"
    if not stat.S_ISDIR(info.st_mode):
        raise UserError(
            f"data.cache.dir: {mine} is not a directory (a symlink or a file) where the cache keeps your files: {fix}"
        )
    if info.st_uid != os.geteuid():
        raise UserError(
            f"data.cache.dir: {mine} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}), "
            f"and the cache would keep your files there: {fix}"
        )
    if info.st_mode & 0o077:
        raise UserError(
            f"data.cache.dir: {mine} is open to other users (mode {stat.filemode(info.st_mode)}) and holds "
            f"your cached data: run chmod 700 {mine}"
        )
    return mine


def cache_root(directory: Path, key: str, uri: str) -> Path:
    """The dataset root ``directory/key``, made on first use with its marker already inside (a
    directory renamed into place), so that eviction never meets a root of its own unmarked."""
    root = directory / key
    if _is_marked(root):
        return root
    made = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=directory))
    marker = os.open(made / ROOT_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with open(marker, "w") as file:
        file.write(f"lance_hpc node-local cache of {uri}: its files are deleted by lance_hpc's eviction\n")
    try:
        os.rename(made, root)
    except OSError:  # another process made it first (or something else is there: refused below)
        (made / ROOT_MARKER).unlink()
        made.rmdir()
    if not _is_marked(root):
        raise UserError(
            f"data.cache.dir: {root} is not a cache directory lance_hpc made (no {ROOT_MARKER} in it): "
            "remove it, or choose another data.cache.dir"
        )
    return root


def _is_marked(root: Path) -> bool:
    """Whether ``root`` is a directory (not a symlink) that the cache made: its marker is in it."""
    try:
        return stat.S_ISDIR(os.lstat(root).st_mode) and is_whole(root / ROOT_MARKER, None)
    except FileNotFoundError:
        return False


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
        except UnusableLock as error:
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
            if isinstance(error, UnusableLock):
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
