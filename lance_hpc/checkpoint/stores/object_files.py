"""DCP's file-system interface over object storage (:class:`ObjectFiles`), for the shards
:class:`~lance_hpc.checkpoint.stores.objects.ObjectStore` writes and reads there; imported only by
it, with ``torch.distributed.checkpoint`` itself."""

from __future__ import annotations

import io
import os
from collections.abc import Generator
from contextlib import contextmanager

from pyarrow import fs
from torch.distributed.checkpoint.filesystem import FileSystemBase


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
