"""The interface of an ingest format: what an ingest asks of a source, whatever it holds.

A format lists a source's shards (the units of work, split between the workers) and reads one shard
as Arrow record batches; every worker makes its own instance and lists the shards before it reads
any, so a format may keep what the listing found. The rest is optional, each with a default that
suits a format of rows: a shard's size (to balance the workers), where each column is found, the
class names of a label, the fields that are never columns, how a message names a shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Iterator, Mapping

import pyarrow as pa

from lance_hpc.ingest.reading import Reading
from lance_hpc.limits import DEFAULT_RECORD_MB

# Files per shard of a format whose shards are runs of small files (an image folder, a text corpus).
FILES_PER_SHARD = 1000
# Where each column is found unless the spec or the format says otherwise.
COLUMN_FIELDS = {"image": "image", "label": "label", "text": "text", "key": "__key__"}


@dataclass(frozen=True)
class ReadSettings:
    """What an ingest tells its format: the object store's options (region, endpoint, credentials),
    the files per shard of a run of files, and the largest record read whole."""

    storage_options: Mapping[str, str] = field(default_factory=dict)
    files_per_shard: int = FILES_PER_SHARD
    max_record_bytes: int = DEFAULT_RECORD_MB << 20


class ShardFormat:
    """A format of ingest sources: subclass it, define :meth:`shards` and :meth:`batches`, and name
    it as the source's prefix by import path (``my_formats.py:CsvRows:/data/*.csv``).

    Each worker builds one instance with no arguments, sets :attr:`settings`, calls :meth:`shards`
    with the text after the prefix, then :meth:`batches` for each shard it writes. A batch's fields
    become the dataset's columns: ``image`` (encoded bytes), ``label`` (class numbers), ``text`` and
    ``key`` by those names (or as ``data.ingest.columns`` maps them), every other field under its
    own name; a row without a key field (``__key__`` by default) is keyed by its shard and row, and
    the validation split is drawn by that key. Raise :class:`lance_hpc.UserError` for a source that
    cannot be read, with the fix in its message.
    """

    #: a text corpus: its documents are tokenised unless ``data.ingest.tokenize`` is false
    corpus: ClassVar[bool] = False
    #: what the ingest told the format (set on each instance before :meth:`shards`)
    settings: ReadSettings = ReadSettings()

    def shards(self, source: str) -> list[str]:
        """The source's shards, each named by a string unique within it, in the same order on every
        call (the ingest's records and its resume hold these names)."""
        raise NotImplementedError(f"{type(self).__name__} defines no shards()")

    def batches(self, shard: str) -> Iterator[pa.RecordBatch]:
        """The shard's rows, as record batches of a few hundred rows at most each."""
        return self.read(shard, Reading())

    def read(self, shard: str, reading: Reading) -> Iterator[pa.RecordBatch]:
        """The shard's rows within ``reading``'s bounds (a record over them is skipped and counted);
        a format that bounds its records overrides this, the others define :meth:`batches`."""
        return self.batches(shard)

    def shard_bytes(self, shard: str) -> int:
        """The shard's size, which the workers are balanced by: a local file's size by default, else 1."""
        return os.path.getsize(shard) if os.path.isfile(shard) else 1

    def column_fields(self, fields: list[str]) -> dict[str, str]:
        """Where each column is found in a batch of these ``fields`` unless the spec says otherwise."""
        return dict(COLUMN_FIELDS)

    def not_columns(self, fields: list[str]) -> frozenset[str]:
        """Fields of a batch that never become columns of their own."""
        return frozenset()

    def class_names(self, label_field: str) -> list[str] | None:
        """The names of the label's classes, kept in the dataset's schema; None when the source has none."""
        return None

    def where(self, shard: str) -> str:
        """The shard as a message names it (a file's URI, say)."""
        return shard
