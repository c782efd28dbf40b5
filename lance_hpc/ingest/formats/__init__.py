"""The ingest formats: each a :class:`ShardFormat`, named as a source's prefix.

A built-in format is one module of this package and its name in :data:`FORMATS`, the registry the
spec's list of names (:data:`lance_hpc.spec.choices.SHARD_FORMATS`) is checked against. A format of
one's own is named by import path instead, the rest of the source after it:
``my_formats.py:CsvRows:/data/*.csv`` or ``my_pkg.formats:CsvRows:s3://bucket/*.csv``, loaded as
tasks and kinds are (:mod:`lance_hpc.imports`). Only ``torchvision:<Name>:<root>``, a source that
:mod:`lance_hpc.ingest.dataset` writes, has that form and is not a format. Which sources are which
is the spec's to say (:func:`lance_hpc.spec.choices.source_format`), from their form alone;
``lance-hpc validate`` imports a format of one's own to check it, as it does ``job`` and ``task.name``.
"""

from __future__ import annotations

from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.ingest.formats.base import FILES_PER_SHARD, ReadSettings, ShardFormat
from lance_hpc.ingest.formats.hf import HuggingFace
from lance_hpc.ingest.formats.imagefolder import ImageFolder
from lance_hpc.ingest.formats.jsonl import JsonLines
from lance_hpc.ingest.formats.parquet import Parquet
from lance_hpc.ingest.formats.stdlib import STDLIB, PythonStdlib
from lance_hpc.ingest.formats.text import Text
from lance_hpc.ingest.formats.webdataset import WebDataset
from lance_hpc.spec.choices import BARE_FORMATS, SHARD_FORMATS, check_registry, source_format

__all__ = ["FILES_PER_SHARD", "FORMATS", "ReadSettings", "ShardFormat", "format_class", "is_builtin_source", "is_shard_source"]

FORMATS: dict[str, type[ShardFormat]] = {
    "parquet": Parquet,
    "jsonl": JsonLines,
    "webdataset": WebDataset,
    "hf": HuggingFace,
    "imagefolder": ImageFolder,
    "text": Text,
    STDLIB: PythonStdlib,
}
check_registry(FORMATS, SHARD_FORMATS, "data.ingest.source formats")
SOURCE_ADVICE = " | ".join(f"{name}:<glob>" for name in FORMATS if name not in BARE_FORMATS)


def is_shard_source(text: str) -> bool:
    """Whether ``text`` is a source of a format: split into shards, written by one or many workers."""
    return source_format(text) is not None


def is_builtin_source(text: str) -> bool:
    """Whether ``text`` is a source of a built-in format (reading it imports no code of the user's)."""
    parts = source_format(text)
    return parts is not None and parts[0] in FORMATS


def format_class(text: str, where: str = "") -> tuple[type[ShardFormat], str, str]:
    """The format class of the source ``text``, its name (as the source gives it) and the location
    that follows; one error naming the source (after ``where``: the spec file and key that gave it)
    and the fix when it has none."""
    parts = source_format(text)
    if parts is None or not (parts[1] or parts[0] in BARE_FORMATS):
        raise UserError(
            f"{where}source {text!r}: give {SOURCE_ADVICE} | {STDLIB}[:max_mb=N] | "
            "path/to/formats.py:MyFormat:<location> (a lance_hpc.ShardFormat of your own)"
        )
    name, location = parts
    if name in FORMATS:
        return FORMATS[name], name, location
    found = load_callable(name, f"{where}source {text!r}")
    if not (isinstance(found, type) and issubclass(found, ShardFormat)):
        raise UserError(
            f"{where}source {text!r}: {name} is not a lance_hpc.ShardFormat\n"
            "  fix: subclass lance_hpc.ShardFormat and define shards() and batches() (docs/ingest.md, Formats of your own)"
        )
    missing = [
        method
        for method, defined in (("shards", found.shards is not ShardFormat.shards), ("batches", _reads(found)))
        if not defined
    ]
    if missing:
        raise UserError(f"{where}source {text!r}: {name} defines no {' and no '.join(missing)}()\n  fix: define them")
    return found, name, location


def _reads(found: type[ShardFormat]) -> bool:
    return found.batches is not ShardFormat.batches or found.read is not ShardFormat.read
