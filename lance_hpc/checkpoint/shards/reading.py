"""Reading shards as data, never as code: a checkpoint directory may come from anyone (a shared
file system, a colleague's bucket), and exporting, resuming from or evaluating it must not run
what its files say.

``torch.distributed.checkpoint`` (DCP) would: it unpickles ``.metadata`` with ``pickle.load`` and
the non-tensor items of the shards (an optimizer's hyperparameters) with
``torch.load(weights_only=False)``. Here ``.metadata`` is read by an unpickler that builds only
DCP's own metadata classes and the few torch and standard types they hold
(:class:`DataOnlyReader`), the items with ``weights_only=True`` (:class:`DataOnlyPlanner`), and
every file name the metadata gives must be a plain name inside the shard directory. A file that
asks for more is refused with one :class:`~lance_hpc.errors.UserError` naming it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lance_hpc.checkpoint.shards.names import plain_name, refused
from lance_hpc.errors import UserError
from lance_hpc.storage.files import Refused


class ShardFiles(Protocol):
    """What reading shards asks of their checkpoint store (:class:`lance_hpc.checkpoint.stores.Store`):
    where a file is, and a small file read with a bound."""

    def location(self, name: str) -> Path | str: ...

    def read_bytes(self, name: str, limit: int, fix: str = ...) -> bytes: ...


# What a DCP ``.metadata`` pickle may name: DCP's metadata classes, and the torch and standard
# types inside them (sizes, dtypes, layouts; the checkpoint's path). Each only stores its
# arguments: none opens a file, imports a module or runs a command.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused, before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


class DataOnlyReader(dcp.FileSystemReader):
    """DCP's reader of the shard directory ``name`` of ``store`` (at ``path``, through ``files``
    on object storage), its ``.metadata`` read by :class:`MetadataUnpickler` and every data file it
    names checked to be a plain name in the directory. Stores make these
    (:meth:`~lance_hpc.checkpoint.stores.Store.shard_reader`)."""

    def __init__(self, path: str, store: ShardFiles, name: str, files: FileSystemBase | None = None) -> None:
        plain_name(name, str(store.location(name)))
        super().__init__(path)
        self.store, self.name = store, name
        if files is not None:
            self.fs = files  # type: ignore[assignment]

    def read_metadata(self) -> Metadata:
        """The checkpoint's one ``.metadata`` (lance_hpc never writes DCP's per-rank ones)."""
        path = self._get_metadata_path()
        try:
            metadata = MetadataUnpickler(io.BytesIO(self.metadata_bytes(path))).load()
        except UserError:
            raise
        except Exception as error:  # whatever the bytes make the unpickler fail with, they are not metadata
            raise refused(str(path), f"not DCP metadata ({error})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise refused(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
        for stored in metadata.storage_data.values():
            if not isinstance(stored, _StorageInfo) or not isinstance(stored.relative_path, str):
                raise refused(str(path), "its index of the data files is not DCP's")
            plain_name(stored.relative_path, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def metadata_bytes(self, path: Any) -> bytes:
        """``.metadata`` whole, at most :data:`METADATA_BYTES`, as the store reads a small file: on a
        file system only a regular file, never through a link or from a FIFO (a checkpoint directory
        may be shared)."""
        try:
            return self.store.read_bytes(f"{self.name}/.metadata", METADATA_BYTES, fix=METADATA_FIX)
        except Refused as error:  # a FIFO, a device, a link, or more than DCP ever writes
            raise refused(str(path), str(error).splitlines()[0]) from None


# DCP's index of a checkpoint's tensors: a few hundred bytes a tensor shard, so a model of
# hundreds of thousands of shards stays far below this.
METADATA_BYTES = 512 * 1024 * 1024
METADATA_FIX = "point at a checkpoint lance_hpc wrote, or save it again"


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor items read with ``torch.load(weights_only=True)``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise refused(self.where, f"its item {key!r} is a pickle of more than plain data") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], item)
        else:
            self.state_dict[key] = item


def load(state: dict[str, Any], reading: DataOnlyReader, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` through ``reading`` as data only; a refusal on any rank is raised
    as its UserError, as is a tensor file that is not plain data (DCP reads tensors with
    ``weights_only=True`` itself, and reports that as an error of its own)."""
    where = str(reading.path)
    reading.read_metadata()  # refused here, in one message: DCP would log the refusal's traceback and go on
    try:
        dcp.load(state, storage_reader=reading, planner=DataOnlyPlanner(where), no_dist=no_dist)
    except CheckpointException as failed:
        errors = [error for error, _ in failed.failures.values()]
        user = next((error for error in errors if isinstance(error, UserError)), None)
        if user is not None:
            raise user from None
        if any(isinstance(error, pickle.UnpicklingError) for error in errors):
            raise refused(where, "a tensor in its data files is a pickle of more than plain data") from None
        raise
