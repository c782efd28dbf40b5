"""``parquet:<glob>``: Parquet files, each a shard, or each row group a shard of a file with several."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats.files import FileFormat, Part
from lance_hpc.ingest.reading import BATCH_ROWS, Reading


class Parquet(FileFormat):
    name = "parquet"

    def shards(self, source: str) -> list[str]:
        self.open(source)
        for info in self.matched():
            try:
                with self.filesystem.open_input_file(info.path) as handle:
                    groups = pq.ParquetFile(handle).metadata.num_row_groups
            except (pa.ArrowInvalid, OSError) as error:
                raise UserError(f"{self.uri(info.path)} is not a Parquet file, or is damaged: {error}") from None
            if groups > 1:
                share = info.size // groups
                self.parts.update({f"{info.path}#{group}": Part(info.path, share, group) for group in range(groups)})
            else:
                self.parts[info.path] = Part(info.path, info.size or 0)
        return list(self.parts)

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        part = self.parts[shard]
        with self.filesystem.open_input_file(part.path) as handle:
            groups = [part.row_group] if part.row_group is not None else None
            yield from pq.ParquetFile(handle).iter_batches(batch_size=BATCH_ROWS, row_groups=groups)
