"""Where the shards of a sharded checkpoint go: a directory of a local or shared file system, or a
prefix on S3-compatible object storage, written and read by every rank directly.

``torch.distributed.checkpoint`` writes and reads through a small file-system interface; on object
storage it gets one over the same pyarrow S3 client, endpoint and credentials as every other
checkpoint file (:class:`lance_hpc.checkpoint.stores.ObjectStore`). Each rank uploads its own
files in one stream each; rank 0 writes ``.metadata`` once all are complete.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from pyarrow import fs
from torch.distributed.checkpoint.filesystem import FileSystemBase

from lance_hpc.checkpoint.stores import LocalDirectory, ObjectStore, Store, open_store
from lance_hpc.storage.files import sync_to_disk


class ObjectFiles(FileSystemBase):
    """DCP's file-system interface over a pyarrow S3 file system (paths are ``bucket/key``)."""

    def __init__(self, filesystem: fs.S3FileSystem) -> None:
        self.filesystem = filesystem

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode == "wb":
            with self.filesystem.open_output_stream(str(path)) as stream:
                yield stream
        elif mode == "rb":
            with self.filesystem.open_input_file(str(path)) as stream:
                yield stream
        else:
            raise ValueError(f"object storage opens shards for wb or rb, not {mode}")

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.filesystem.move(str(path), str(new_path))

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        """Object storage has no directories: a key's prefix needs no creating."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.filesystem.get_file_info(str(path)).type != fs.FileType.NotFound

    def rm_file(self, path: str | os.PathLike) -> None:
        self.filesystem.delete_file(str(path))


def is_local(directory: str | Path) -> bool:
    """Whether checkpoint.dir ``directory`` is a file system (whose writes reach the disk at fsync),
    not object storage (where a stream's data is there once it is closed)."""
    return not isinstance(open_store(directory), ObjectStore)


def flush(path: Path) -> None:
    """Every file of the shard directory ``path`` and the directory itself on disk (fsync)."""
    for entry in sorted(path.iterdir()):
        if entry.is_file() and not entry.is_symlink():
            sync_to_disk(entry)
    sync_to_disk(path)


def writer(
    directory: str | Path, name: str, reuse: dcp.FileSystemWriter | None = None, synced: bool = True
) -> dcp.FileSystemWriter:
    """A DCP writer of the shards ``name`` in checkpoint.dir ``directory``; ``reuse`` (a writer of an
    earlier background save to the same directory) keeps its staging buffers in pinned host memory
    on a GPU machine, so a save copies the state into memory it already has instead of allocating it.
    ``synced=False``: the files are left to the caller to :func:`flush`."""
    store = open_store(directory)
    remote = isinstance(store, ObjectStore)
    path = f"{store.prefix}/{name}" if isinstance(store, ObjectStore) else str(Path(directory) / name)
    if reuse is not None:
        reuse.reset(path)
        return reuse
    # Object storage has no fsync: a stream's data is there once the stream is closed. Staging
    # buffers are kept (in pinned memory, which needs CUDA) only on a machine with a GPU.
    writing = dcp.FileSystemWriter(path, sync_files=synced and not remote, cache_staged_state_dict=torch.cuda.is_available())
    if isinstance(store, ObjectStore):
        writing.fs = ObjectFiles(store.filesystem)  # type: ignore[assignment]
        writing.path = path
    return writing


def reader(directory: str | Path, name: str) -> dcp.FileSystemReader:
    """A DCP reader of the shards ``name`` in checkpoint.dir ``directory``."""
    store = open_store(directory)
    if isinstance(store, ObjectStore):
        reading = dcp.FileSystemReader(f"{store.prefix}/{name}")
        reading.fs = ObjectFiles(store.filesystem)  # type: ignore[assignment]
        return reading
    return dcp.FileSystemReader(str(Path(directory) / name))


def shard_directories(store: Store) -> list[str]:
    """The names of the shard directories (``step-N.dcp``) in ``store``, complete or not."""
    if isinstance(store, ObjectStore):
        found = store.filesystem.get_file_info(fs.FileSelector(store.prefix, allow_not_found=True))
        return [info.base_name for info in found if info.type == fs.FileType.Directory]
    if isinstance(store, LocalDirectory) and store.directory.is_dir():
        return [path.name for path in store.directory.iterdir() if path.is_dir()]
    return []


def delete_shards(store: Store, name: str) -> None:
    """Remove the shard directory ``name`` and everything in it."""
    if isinstance(store, ObjectStore):
        try:
            store.filesystem.delete_dir(f"{store.prefix}/{name}")
        except FileNotFoundError:
            pass
        except OSError as error:
            raise store.error(str(error), "delete checkpoint shards", store.location(name)) from None
    elif isinstance(store, LocalDirectory):
        shutil.rmtree(store.location(name), ignore_errors=True)
