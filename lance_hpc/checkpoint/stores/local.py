"""Checkpoints in a directory of a local or shared file system (:class:`LocalDirectory`).

A file is written to a temporary file, fsynced, renamed into place and the directory fsynced, so a
crash at any moment leaves either the new file or none. A write that fills the file system raises
:class:`~lance_hpc.checkpoint.stores.base.NoSpace`, the partial file removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

from lance_hpc.checkpoint.stores.base import (
    SMALL_FILE_FIX,
    TEMP_SUFFIX,
    NoSpace,
    Store,
    load_state,
    out_of_space,
    save_state,
)
from lance_hpc.checkpoint.stores.local_lease import LeaseFile
from lance_hpc.errors import UserError
from lance_hpc.storage.files import Refused, read_regular, replaced_atomically, sync_to_disk

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from lance_hpc.checkpoint.shards.reading import DataOnlyReader


class LocalDirectory(Store):
    """Checkpoint files in a directory of a local or shared file system."""

    needs_flush = True

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.where = str(directory)

    def location(self, name: str) -> Path:
        return self.directory / name

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        with os.scandir(self.directory) as entries:  # the kind of each from the listing: no stat per entry
            return [entry.name for entry in entries if not entry.is_dir(follow_symlinks=False)]

    def write(self, name: str, state: dict[str, Any]) -> None:
        """torch.save to a temporary file, fsync, rename over ``name``, fsync the directory."""
        self._write(name, lambda file: save_state(state, file))

    def read(self, name: str) -> dict[str, Any]:
        return load_state(self.location(name))

    def write_bytes(self, name: str, payload: bytes) -> None:
        self._write(name, lambda file: file.write(payload))

    def read_bytes(self, name: str, limit: int, fix: str = SMALL_FILE_FIX) -> bytes:
        try:
            found = read_regular(self.location(name), limit, fix=fix)
        except UserError as error:  # a FIFO, a device, a link, or more than lance_hpc writes there
            raise Refused(str(error)) from None
        if found is None:
            raise FileNotFoundError(self.location(name))
        return found

    def _write(self, name: str, dump: Callable[[BinaryIO], object]) -> None:
        """``dump`` into a temporary file that replaces ``name`` once complete; NoSpace when the
        file system fills up on the way (torch.save reports that as an obscure RuntimeError)."""
        path = self.location(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
        written = 0
        try:
            with replaced_atomically(path, temp) as file:
                try:
                    dump(file)
                except BaseException:
                    written = file.tell()
                    raise
        except Exception as error:
            code = out_of_space(error)
            if code is None:
                raise
            raise NoSpace(path, code, written, shutil.disk_usage(self.directory).free) from error

    def delete(self, name: str) -> None:
        self.location(name).unlink(missing_ok=True)

    def shard_directories(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return [path.name for path in self.directory.iterdir() if path.is_dir()]

    def delete_shards(self, name: str) -> None:
        shutil.rmtree(self.location(name), ignore_errors=True)

    def flush_shards(self, name: str) -> None:
        path = self.location(name)
        for entry in sorted(path.iterdir()):
            if entry.is_file() and not entry.is_symlink():
                sync_to_disk(entry)
        sync_to_disk(path)

    def shard_writer(self, name: str, reuse: dcp.FileSystemWriter | None = None, synced: bool = True) -> dcp.FileSystemWriter:
        # torch.distributed.checkpoint is imported where shards are written or read: importing it
        # takes about 0.6 s (DTensor, sympy), which a rank that never shards would pay at every start
        import torch
        import torch.distributed.checkpoint as dcp

        path = str(self.location(name))
        if reuse is not None:
            reuse.reset(path)
            return reuse
        # Staging buffers are kept (in pinned memory, which needs CUDA) only on a machine with a GPU.
        return dcp.FileSystemWriter(path, sync_files=synced, cache_staged_state_dict=torch.cuda.is_available())

    def shard_reader(self, name: str) -> DataOnlyReader:
        from lance_hpc.checkpoint.shards.reading import DataOnlyReader

        return DataOnlyReader(str(self.location(name)), self, name)

    def lease(self) -> LeaseFile:
        return LeaseFile(self.directory)
