"""Keeping the node cache under its size: the least recently used files it wrote are deleted, and
nothing else.

After each fetch, data files are deleted oldest use first (a file's modification time is its last
use; readers touch it), then deletion files and manifests. A deleted file still open by a reader
stays readable (Linux); a reader that finds a file gone reads those rows from the store. The
manifest of a version some process has open (a shared ``fcntl`` lock) is never deleted. Only files
of a root that bears the cache's marker (:mod:`lance_hpc.storage.cache.dirs`), under the names the
cache writes, are deleted, and no symlink is followed.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Iterator

from lance_hpc.storage.cache.dirs import ROOT_MARKER
from lance_hpc.storage.cache.files import FileLock, UnusableLock, is_whole, warn_once
from lance_hpc.storage.cache.names import CACHED_DIRS, CACHED_NAMES, MANIFEST_DIR, PARTIAL_NAME, lock_path

log = logging.getLogger("lance_hpc.data")


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
