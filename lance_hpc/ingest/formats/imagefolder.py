"""``imagefolder:<dir>``: one sub-directory per class, each file one image; shards are runs of
``files_per_shard`` images, the classes numbered in the order of their sorted names."""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats.files import FileFormat, hidden
from lance_hpc.ingest.formats.webdataset import IMAGE_EXTENSIONS
from lance_hpc.ingest.reading import Reading


class ImageFolder(FileFormat):
    name = "imagefolder"

    @property
    def base(self) -> str:
        return self.pattern.rstrip("/")

    def shards(self, source: str) -> list[str]:
        self.open(source)
        return self.file_runs(self._images())

    def _images(self) -> list[pafs.FileInfo]:
        """The images (``<dir>/<class>/.../<file>``), the class directories noted, in an order mixed
        by a hash of each file's key so that classes are mixed in every shard and fragment
        (contiguous reads see every class), the same order on every run."""
        images = [
            info
            for info in self.listing(self.base)
            if info.type == pafs.FileType.File
            and "/" in self.key(info.path)
            and not hidden(self.key(info.path))
            and info.path.rpartition(".")[2].lower() in IMAGE_EXTENSIONS
        ]
        if not images:
            raise UserError(
                f"imagefolder:{self.uri(self.base)} has no images in class sub-directories (e.g. "
                f"{self.uri(self.base)}/cat/1.jpg)\n  fix: point it at the folder that holds one directory per class"
            )
        self.classes = sorted({self.key(info.path).split("/", 1)[0] for info in images})
        return sorted(images, key=lambda info: (hashlib.blake2b(self.key(info.path).encode(), digest_size=8).digest(), info.path))

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        return self.run_batches(shard, reading, "image", self._record)

    def _record(self, key: str, data: bytes) -> dict[str, Any]:
        return {"image": data, "label": self.classes.index(key.split("/", 1)[0]), "__key__": key}

    def class_names(self, label_field: str) -> list[str] | None:
        return list(self.classes) or None
