"""The node cache's files: where they live, and how one process fetches each while the others wait.
The cache's directories are made in :mod:`lance_hpc.storage.cache.dirs`, and it stays under its size
by :mod:`lance_hpc.storage.cache.eviction`, which never touches what the cache did not write.

Lance data files and deletion files are immutable and uniquely named, so the cache keeps whole
files. ``<dir>/lance_hpc-<uid>/<dataset key>/`` is itself a Lance dataset root: ``data/`` and
``_deletions/`` hold the files fetched so far, ``_versions/`` the manifest of every version read
through the cache (see :mod:`lance_hpc.storage.cache.node_cache` for how a process reads through it). Files
are created 0600, temporary files exclusively, and no file is created or opened through a symlink.
A file is mirrored only under a name Lance writes, inside its root
(:mod:`lance_hpc.storage.cache.names`): the manifest's author chooses the names.

- one process fetches a file: it holds an ``fcntl`` lock on the file's lock file under ``.locks/``
  while it downloads; the others find the lock taken and read from the store meanwhile (as does
  a process that cannot open the lock file: it warns once and leaves that file uncached);
- a fetch writes ``<name>.<pid>-<thread>.partial``, fsyncs it, checks its size against the
  manifest and renames it to ``<name>`` (then fsyncs the directory): a process killed mid-download
  leaves only a ``.partial`` file, which no reader opens and the next fetcher deletes. A cached
  file is used only when it is a regular file of the size the manifest gives (data files; the
  store's size for the manifest), and fetched again otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from pyarrow import fs

from lance_hpc.errors import UserError
from lance_hpc.storage.cache.names import (
    MANIFEST_DIR,
    PARTIAL,
    OutsideRoot,
    Uncacheable,
    inside,
    is_cached_name,
    lock_path,
)
from lance_hpc.storage.files import replaced_atomically
from lance_hpc.storage.options import filesystem_arguments

log = logging.getLogger("lance_hpc.data")
_warned: set[str] = set()  # warn_once keys already warned of


CHUNK_BYTES = 16 * 2**20  # one ranged GET per chunk; the memory a fetch holds


FILE_MODE = 0o600


GIB = 2**30


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
    """The files a fragment's rows are read from, or None when the cache keeps not all of them (see
    :func:`own_files`, and :func:`.cache_names.is_cached_name`): its rows are read from the store."""
    files = own_files(fragment)
    return files if files is not None and all(is_cached_name(file.path) for file in files) else None


def own_files(fragment: Any) -> tuple[CachedFile, ...] | None:
    """The files a fragment's rows are read from, as its manifest names them, or None when one
    lives under another base path (the cache only mirrors the dataset's own root)."""
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


class UnusableLock(Uncacheable):
    """A lock file the cache cannot open (a symlink, a directory, not writable): the file it guards
    is left uncached, and the rows read from the store."""


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
    :class:`UnusableLock` when its lock file cannot be opened, :class:`OutsideRoot` when its name
    is not one Lance writes or leads outside ``root``."""
    if not is_cached_name(file.path):
        raise OutsideRoot(errno.EINVAL, "not a name Lance writes: the cache mirrors no other", file.path)
    final = inside(root, file.path)
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
