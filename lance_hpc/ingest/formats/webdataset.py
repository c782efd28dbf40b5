"""``webdataset:<glob of .tar>``: LAION/DataComp style tars, each a shard; the files of one sample
share a key (``0001.jpg``, ``0001.cls``, ``0001.json``), read within bounds by
:mod:`lance_hpc.ingest.formats.tar_samples`."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa

from lance_hpc.ingest.formats.files import FileFormat
from lance_hpc.ingest.formats.tar_samples import webdataset_batches
from lance_hpc.ingest.reading import Reading

# Extensions of a sample's image file, in the order one is picked when a sample has several.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")


class WebDataset(FileFormat):
    name = "webdataset"

    def shards(self, source: str) -> list[str]:
        self.open(source)
        return self.one_per_file(self.matched())

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        with self.filesystem.open_input_stream(self.parts[shard].path, compression="detect") as stream:
            yield from webdataset_batches(stream, self.where(shard), self.settings.max_record_bytes, reading)

    def column_fields(self, fields: list[str]) -> dict[str, str]:
        image = next((extension for extension in IMAGE_EXTENSIONS if extension in fields), "jpg")
        return {"image": image, "label": "cls", "text": "txt", "key": "__key__"}

    def not_columns(self, fields: list[str]) -> frozenset[str]:
        return frozenset(IMAGE_EXTENSIONS)  # a sample's other image files
