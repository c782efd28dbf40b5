"""What a checkpoint store does, whatever holds it (:class:`Store`): list, write, read and delete
checkpoint files by name, the shard directories beside them, the directory's lease, and getting
written files onto stable storage. :mod:`.local` implements it for a directory, :mod:`.objects` for
a prefix on S3-compatible object storage.

A reader never sees half a checkpoint: a store's :meth:`Store.write` publishes a file whole or not
at all. Small files beside checkpoints (a JSON manifest) are written the same way, and read back
only up to a size (anyone who may write to a shared checkpoint directory may have put a FIFO, a
device or a huge file there): such a file is :class:`~lance_hpc.storage.files.Refused`.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from lance_hpc.checkpoint.lease.holders import LeaseStore

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from lance_hpc.checkpoint.shards.reading import DataOnlyReader

# Temporary files of a checkpoint being written: ``.step-XXXXXXXX.pt.<pid>.tmp``.
TEMP_SUFFIX = ".tmp"
# What to do with a small file in a checkpoint directory that read_bytes refuses.
SMALL_FILE_FIX = (
    "remove it: lance_hpc keeps only small regular files beside its checkpoints, which are listed by name without them"
)

Location = Path | str  # a local checkpoint is a Path, one on object storage an s3:// URI


class NoSpace(Exception):
    """The file system filled up, or the user's quota ran out, while ``path`` was written. The
    partial file is gone and ``path`` is as it was; ``free`` is what the file system had left after
    that, ``written`` how far the write had got (0 when unknown)."""

    def __init__(self, path: Path, code: int, written: int, free: int) -> None:
        super().__init__(f"{path}: {os.strerror(code)}")
        self.path, self.quota, self.written, self.free = path, code == errno.EDQUOT, written, free


class Store(ABC):
    """Checkpoint files, small files and shard directories by name in one directory or prefix.
    Opened once (:func:`lance_hpc.checkpoint.stores.open_store`) and handed to whatever saves,
    loads, prunes or leases there."""

    where: str  # the checkpoint.dir, as messages name it
    # whether written files reach stable storage only once fsynced (a file system), not once
    # closed (object storage): a save then flushes its shards before it publishes them
    needs_flush: bool

    @abstractmethod
    def location(self, name: str) -> Location:
        """Where the file ``name`` is: a Path, or an s3:// URI."""

    @abstractmethod
    def names(self) -> list[str]:
        """The files in the store (not its shard directories)."""

    @abstractmethod
    def write(self, name: str, state: dict[str, Any]) -> None:
        """Publish ``state`` as the checkpoint file ``name``: a reader finds all of it or nothing."""

    @abstractmethod
    def read(self, name: str) -> dict[str, Any]:
        """The checkpoint file ``name``, loaded as data only (``weights_only``)."""

    @abstractmethod
    def write_bytes(self, name: str, payload: bytes) -> None:
        """Publish the small file ``name`` as :meth:`write` publishes a checkpoint."""

    @abstractmethod
    def read_bytes(self, name: str, limit: int, fix: str = SMALL_FILE_FIX) -> bytes:
        """The small file ``name``, at most ``limit`` bytes; :class:`~lance_hpc.storage.files.Refused` (with ``fix``) past
        that or for anything but a regular file; FileNotFoundError when it is gone."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove the file ``name``; nothing when it is gone already."""

    @abstractmethod
    def shard_directories(self) -> list[str]:
        """The names of the shard directories (``step-N.dcp``) in the store, complete or not."""

    @abstractmethod
    def delete_shards(self, name: str) -> None:
        """Remove the shard directory ``name`` and everything in it."""

    @abstractmethod
    def flush_shards(self, name: str) -> None:
        """Every file of the shard directory ``name`` on stable storage (fsync)."""

    @abstractmethod
    def shard_writer(self, name: str, reuse: dcp.FileSystemWriter | None = None, synced: bool = True) -> dcp.FileSystemWriter:
        """A DCP writer of the shards ``name``; ``reuse`` (a writer of an earlier background save to
        this store) keeps its staging buffers in pinned host memory on a GPU machine, so a save
        copies the state into memory it already has. ``synced=False``: the files are left to
        :meth:`flush_shards`."""

    @abstractmethod
    def shard_reader(self, name: str) -> DataOnlyReader:
        """A reader of the shards ``name``, as data only (:mod:`lance_hpc.checkpoint.shards.reading`)."""

    @abstractmethod
    def lease(self) -> LeaseStore:
        """The store's lease (:mod:`lance_hpc.checkpoint.lease`)."""


def save_state(state: dict[str, Any], file: BinaryIO) -> None:
    """torch.save ``state`` into ``file``."""
    # torch is imported where a checkpoint is written or read, not with this module: status and
    # cancel list checkpoint directories on login nodes, where importing torch costs seconds
    import torch

    torch.save(state, file)


def load_state(source: str | Path | BinaryIO) -> dict[str, Any]:
    """A checkpoint, as data only: a file that asks to run code is refused by torch."""
    import torch

    return torch.load(source, map_location="cpu", weights_only=True)


def out_of_space(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT when ``error``, or an error it was raised from or while handling, is one:
    torch.save turns a full disk into RuntimeError("... unexpected pos ...") raised while handling
    the OSError that says so."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return cause.errno
        cause = cause.__cause__ or cause.__context__
    return None
