"""The node cache's files: where they live, how one process fetches each while the others wait,
and how the cache stays under its size, never touching what it did not write.

Lance data files and deletion files are immutable and uniquely named, so the cache keeps whole
files. ``<dir>/lance_hpc-<uid>/<dataset key>/`` is itself a Lance dataset root: ``data/`` and
``_deletions/`` hold the files fetched so far, ``_versions/`` the manifest of every version read
through the cache (see :mod:`lance_hpc.storage.cache` for how a process reads through it).

``<dir>`` may be shared by every user of the node (``/local/nvme/...``), so each user gets a
directory of their own in it, ``lance_hpc-<uid>``, mode 0700; the cache refuses one that is a
symlink, another user's, or open to others. Inside, a dataset root exists only with the marker file
the cache wrote into it (the root is renamed into place with it), and eviction deletes only files
of a marked root under the names the cache writes, never following a symlink: nothing else in
``<dir>`` is ever touched. Files are created 0600, temporary files exclusively, and no file is
created or opened through a symlink. A file is mirrored only under a name Lance writes, inside its
root (:mod:`lance_hpc.storage.cache_names`): the manifest's author chooses the names.

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
  ``fcntl`` lock) is never deleted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from pyarrow import fs

from lance_hpc.errors import UserError
from lance_hpc.storage.cache_names import (
    CACHED_DIRS,
    CACHED_NAMES,
    MANIFEST_DIR,
    PARTIAL,
    PARTIAL_NAME,
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


ROOT_MARKER = ".lance_hpc-cache-root"


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
