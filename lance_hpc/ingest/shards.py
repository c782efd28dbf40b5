"""Sources as shards: the unit of work of an ingest job.

A source is a format and where its rows are: ``<format>:<location>``, the format a built-in one
(``parquet:``, ``jsonl:``, ``webdataset:``, ``hf:``, ``imagefolder:``, ``text:``, ``python-stdlib``)
or one of your own by import path (``my_formats.py:CsvRows:/data/*.csv``), each a
:class:`~lance_hpc.ingest.formats.ShardFormat` (:mod:`lance_hpc.ingest.formats`). Its shards are
listed in a stable order, the same on every worker; reading a shard as batches of the dataset's
columns is :mod:`lance_hpc.ingest.shard_batches`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats import FILES_PER_SHARD, FORMATS, ReadSettings, ShardFormat, format_class
from lance_hpc.limits import DEFAULT_RECORD_MB


@dataclass(frozen=True)
class Shard:
    """One unit of ingest work, as its format names it, and its size the workers are balanced by."""

    id: str
    bytes: int


@dataclass
class Source:
    """A source opened: its text as given, the format's name and an instance of it, the location
    that follows the format."""

    text: str
    name: str
    format: ShardFormat = field(repr=False)
    location: str

    @property
    def own(self) -> bool:
        """Whether the format is the user's (its code may raise anything), not a built-in one."""
        return self.name not in FORMATS

    def where(self, shard: Shard) -> str:
        """The shard as a message names it."""
        return self.format.where(shard.id)


# Hash buckets of the validation split: a row is validation when its key's bucket is below the fraction's share.
SPLIT_BUCKETS = 1_000_000


def split_of(key: str, val_fraction: float) -> str:
    """``val`` or ``train`` for a row's key: the same whatever the number of workers or the order."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "val" if digest % SPLIT_BUCKETS < val_fraction * SPLIT_BUCKETS else "train"


def parse_source(
    text: str,
    options: Mapping[str, str] | None = None,
    *,
    files_per_shard: int = FILES_PER_SHARD,
    max_record_bytes: int = DEFAULT_RECORD_MB << 20,
) -> Source:
    """The source ``text`` opened: its format found (a format of one's own imported) and told the
    ingest's settings."""
    cls, name, location = format_class(text)
    if files_per_shard < 1:
        raise UserError(f"files_per_shard {files_per_shard}: give 1 or more")
    try:
        instance = cls()
    except Exception as error:  # the user's class: its constructor may raise anything
        raise UserError(
            f"source {text!r}: {name}() raised {type(error).__name__}: {error}\n"
            "  fix: a format is built with no arguments; read its settings from self.settings"
        ) from None
    instance.settings = ReadSettings(dict(options or {}), files_per_shard, max_record_bytes)
    return Source(text, name, instance, location)


def list_shards(source: Source) -> list[Shard]:
    """The source's shards in its format's order; a format of one's own that raises, or lists
    something else than names, is one error naming the source."""
    try:
        names = source.format.shards(source.location)
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"shards() returned {type(names).__name__}, not a list of strings")
        if len(set(names)) != len(names):
            raise ValueError("shards() named a shard twice")
        shards = [Shard(name, int(source.format.shard_bytes(name))) for name in names]
    except UserError:
        raise
    except Exception as error:
        if not source.own:
            raise
        raise UserError(
            f"source {source.text!r}: {source.name} failed to list its shards: {type(error).__name__}: {error}\n"
            "  fix: mend the format's shards() (and shard_bytes()), or the location it is given"
        ) from None
    if not shards:
        raise UserError(f"source {source.text!r}: {source.name} lists no shard\n  fix: check the location after the format")
    return shards
