"""``jsonl:<glob>``: JSON Lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``), each a shard."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa
import pyarrow.json as pajson

from lance_hpc.ingest.formats.files import FileFormat, sliced
from lance_hpc.ingest.reading import Reading

# JSON Lines are parsed in blocks this big; a line must fit in one (base64 images make long lines).
JSON_BLOCK_BYTES = 16 << 20


class JsonLines(FileFormat):
    name = "jsonl"

    def shards(self, source: str) -> list[str]:
        self.open(source)
        return self.one_per_file(self.matched())

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        for batch in sliced(self._blocks(shard)):
            batch.validate(full=True)  # pyarrow's JSON reader lets invalid UTF-8 through; Lance would not read it
            yield batch

    def _blocks(self, shard: str) -> Iterator[pa.RecordBatch]:
        # .gz and .zst are decompressed on the way (pyarrow detects them by extension)
        with self.filesystem.open_input_stream(self.parts[shard].path, compression="detect") as stream:
            try:
                reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=JSON_BLOCK_BYTES))
            except pa.ArrowInvalid as error:
                if "Empty JSON stream" in str(error):
                    return  # an empty file (or one of blank lines) holds no record
                raise
            yield from reader
