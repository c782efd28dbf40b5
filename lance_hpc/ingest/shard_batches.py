"""A shard read as Arrow record batches whose columns follow the spec's column mapping: ``image``
(encoded bytes), ``label`` (int64), ``text`` (string), ``key`` (the sample's key, the file's path
under the source's directory, or the file and row it came from), and every other field of the
source under its own name and Arrow type. Each format reads its shards as they come, within bounds
(a record size, the fields of a sample): see :mod:`lance_hpc.ingest.formats` and
:mod:`lance_hpc.ingest.reading`; which field is which column, unless the spec says, is the format's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import pyarrow as pa

from lance_hpc.errors import UserError, listing
from lance_hpc.ingest.reading import Reading
from lance_hpc.ingest.shards import Shard, Source
from lance_hpc.spec.choices import INGEST_COLUMNS, check_registry


@dataclass(frozen=True)
class ColumnMap:
    """Which source field becomes which column. ``None`` picks the format's default (WebDataset: the
    image extension found, ``cls``, ``txt``, the sample key; Parquet and JSON Lines: a field named
    ``image``, ``label``, ``text``); ``""`` means the source has none."""

    image: str | None = None
    label: str | None = None
    text: str | None = None
    key: str | None = None

    def resolve(self, fields: list[str], defaults: Mapping[str, str]) -> dict[str, str]:
        """Column name -> source field, for the fields this source has."""
        chosen: dict[str, str] = {}
        for column in ("image", "label", "text", "key"):
            wanted = getattr(self, column)
            if wanted == "":
                continue
            if wanted is None:
                wanted = defaults.get(column, column)
                if wanted not in fields:
                    continue
            elif wanted not in fields:
                raise UserError(
                    f"columns.{column} names {wanted!r}, which the source does not have; its fields:{listing(fields, '    ')}\n"
                    f"  fix: set columns.{column} to one of them, or to '' if the source has no {column}"
                )
            chosen[column] = wanted
        return chosen


def _readable(source: Source, shard: Shard, reading: Reading) -> Iterator[pa.RecordBatch]:
    """The shard's raw batches; a file that cannot be read as its format, or a format of one's own
    that raises, is one clear error naming the shard."""
    where = source.where(shard)
    try:
        row = 0
        for batch in source.format.read(shard.id, reading):
            if not isinstance(batch, pa.RecordBatch):
                raise TypeError(f"it yielded a {type(batch).__name__}, not a pyarrow.RecordBatch")
            yield _with_row_keys(batch, shard.id, row)
            row += batch.num_rows
    except UserError:
        raise
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError, ValueError) as error:
        raise UserError(
            f"{where}: cannot read it as {source.name}: {error}\n"
            "  fix: mend or remove the file, or point the source's glob past it"
        ) from None
    except Exception as error:
        if not source.own:
            raise
        raise UserError(
            f"{where}: {source.name} raised {type(error).__name__} reading it: {error}\n"
            "  fix: mend the format's batches(), or the shard"
        ) from None


def _with_row_keys(batch: pa.RecordBatch, shard: str, first: int) -> pa.RecordBatch:
    """The batch with a ``__key__`` of shard and row, unless the source has a ``__key__`` of its own."""
    if "__key__" in batch.schema.names:
        return batch
    keys = pa.array([f"{shard}:{first + index}" for index in range(batch.num_rows)], pa.string())
    return batch.append_column("__key__", keys)


def mapped_batches(source: Source, shard: Shard, columns: ColumnMap, reading: Reading | None = None) -> Iterator[pa.RecordBatch]:
    """The shard's records with the mapped columns renamed (``image``, ``label``, ``text``, ``key``)
    and every other field kept; ``label`` as int64, ``image`` as binary, ``text`` and ``key`` as
    strings. ``reading`` says what becomes of a record past a bound (by default: an error) and
    gathers what was skipped."""
    for batch in _readable(source, shard, reading or Reading()):
        fields = batch.schema.names
        chosen = columns.resolve(fields, source.format.column_fields(fields))
        arrays: dict[str, pa.Array] = {}
        for column, name in chosen.items():
            arrays[column] = _as_column(column, batch.column(name), source.where(shard), name)
        used = set(chosen.values()) | {"__key__"} | source.format.not_columns(fields)
        for name in fields:
            if name not in used and name not in arrays:
                arrays[name] = batch.column(name)
        yield pa.RecordBatch.from_pydict(arrays)


def plan_reading(columns: ColumnMap, on_corrupt: str) -> Reading:
    """A read of a shard for a plan (its schema, its rows estimated): the contents of the fields
    that shape the columns (JSON fields, the label, the text, the key) and of documents, not of
    images or other files, whose types do not depend on them."""
    mapped = (columns.label, columns.text, columns.key)
    return Reading(on_corrupt, frozenset(name for name in mapped if name) | {"text"})


COLUMN_TYPES = {"image": pa.binary(), "label": pa.int64(), "text": pa.string(), "key": pa.string()}
check_registry(COLUMN_TYPES, INGEST_COLUMNS, "data.ingest.columns")


def _as_column(column: str, values: pa.Array, where: str, name: str) -> pa.Array:
    wanted = COLUMN_TYPES[column]
    if values.type == wanted:
        return values
    if column == "image" and pa.types.is_struct(values.type) and "bytes" in [f.name for f in values.type]:
        values = values.field("bytes")  # Hugging Face's Image feature: {"bytes": ..., "path": ...}
    try:
        return values.cast(wanted)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        if column == "label" and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            raise UserError(_class_names_message(values, where, name)) from None
        raise UserError(
            f"{where}: field {name!r} ({values.type}) cannot become the {column} column ({wanted}): {error}\n"
            f"  fix: map columns.{column} to the right field"
        ) from None


def _class_names_message(values: pa.Array, where: str, name: str) -> str:
    """A label field of class names: what the ingest can do instead (it numbers no names itself)."""
    found = next((value for value in values.to_pylist() if value is not None and not value.strip().lstrip("-").isdigit()), "")
    return (
        f"{where}: field {name!r} holds {found[:40]!r}, a class name, but the label column holds class numbers (0, 1, ...)\n"
        "  fix: map the label to a field of class numbers: --column label=FIELD (data.ingest.columns: {label: FIELD}),\n"
        "       a JSON field of each sample, say;\n"
        f"       or ingest without a label: --column label='' (columns: {{label: ''}}) keeps {name!r} as a text column;\n"
        "       or lay the images out as <dir>/<class>/<file> for an imagefolder: source, which numbers its class\n"
        "       directories itself and keeps their names"
    )


def row_keys(batch: pa.RecordBatch) -> list[str]:
    """Each row's key, ``""`` where the source gives none."""
    if "key" not in batch.schema.names:
        return [""] * batch.num_rows
    return [key or "" for key in batch.column("key").to_pylist()]


def document_texts(batches: Iterable[pa.RecordBatch]) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of each row with text, over mapped batches."""
    for batch in batches:
        for key, text in zip(row_keys(batch), batch.column("text").to_pylist()):
            if text is not None:
                yield key, text


def text_batches(source: Source, shard: Shard, columns: ColumnMap, reading: Reading | None = None) -> Iterator[pa.RecordBatch]:
    """The shard's mapped batches, each checked to have a ``text`` column."""
    for batch in mapped_batches(source, shard, columns, reading):
        if "text" not in batch.schema.names:
            raise UserError(
                f"{source.where(shard)}: no text field to tokenise; its fields:{listing(batch.schema.names, '    ')}\n"
                "  fix: map columns.text to the field that holds the documents' text"
            )
        yield batch
