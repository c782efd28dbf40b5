"""``text:<glob>``: each file one document; shards are runs of ``files_per_shard`` files."""

from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa

from lance_hpc.ingest.formats.files import FileFormat
from lance_hpc.ingest.reading import Reading


class Text(FileFormat):
    name = "text"
    corpus = True

    def shards(self, source: str) -> list[str]:
        self.open(source)
        return self.file_runs(self.matched())

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        return self.run_batches(shard, reading, "text", document)


def document(key: str, data: bytes) -> dict[str, Any]:
    return {"text": data.decode("utf-8", errors="replace"), "__key__": key}
