"""Where the shards of a sharded checkpoint go: a directory of a local or shared file system, or a
prefix on S3-compatible object storage, written and read by every rank directly.

``torch.distributed.checkpoint`` writes and reads through a small file-system interface; on object
storage it gets one over the same pyarrow S3 client, endpoint and credentials as every other
checkpoint file (:class:`lance_hpc.checkpoint.stores.ObjectStore`). Each rank uploads its own
files in one stream each; rank 0 writes ``.metadata`` once all are complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pyarrow import fs

from lance_hpc.checkpoint.stores import LocalDirectory, ObjectStore, Store, open_store
from lance_hpc.errors import UserError
from lance_hpc.storage.files import sync_to_disk

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

# torch.distributed.checkpoint is imported where shards are written or read: importing it takes
# about 0.6 s (DTensor, sympy), which a rank that never shards would pay at every start.


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
    import torch.distributed.checkpoint as dcp

    from lance_hpc.checkpoint.shard_objects import ObjectFiles

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


def plain_name(name: object, where: str) -> str:
    """``name``, read from a checkpoint's files, when it is a plain file name: no directory part,
    not ``.`` or ``..``; otherwise a UserError naming ``where`` it was read. A checkpoint from
    elsewhere must not make a reader open files outside its directory."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise refused(where, f"it names {name!r} as a file of the checkpoint, which is not a plain name inside its directory")
    return name


def refused(where: str, why: str) -> UserError:
    """The one message of a checkpoint file that asks for more than data: ``where`` it is, ``why``."""
    return UserError(
        f"refusing checkpoint file {where}: {why}\n  fix: export, resume and evaluate only checkpoints written by "
        "lance_hpc; a checkpoint from elsewhere is read as data, and this one asks to run code or to read outside "
        "its directory"
    )


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
