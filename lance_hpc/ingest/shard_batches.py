"""A shard read as Arrow record batches whose columns follow the spec's column mapping: ``image``
(encoded bytes), ``label`` (int64), ``text`` (string), ``key`` (the sample's key, the file's path
under the source's directory, or the file and row it came from), and every other field of the
source under its own name and Arrow type. Each format is read as it comes (Parquet row groups, JSON
Lines blocks, Arrow record batches, WebDataset samples, runs of files), within bounds (a record size,
the fields of a sample): see :mod:`lance_hpc.ingest.reading` and :mod:`lance_hpc.ingest.webdataset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from lance_hpc.errors import UserError, listing
from lance_hpc.ingest.reading import BATCH_BYTES, BATCH_ROWS, TOO_BIG_FIX, Reading
from lance_hpc.ingest.shards import IMAGE_EXTENSIONS, Shard, Source, file_key
from lance_hpc.ingest.webdataset import webdataset_batches
from lance_hpc.spec.choices import INGEST_COLUMNS, check_registry

# JSON Lines are parsed in blocks this big; a line must fit in one (base64 images make long lines).
JSON_BLOCK_BYTES = 16 << 20


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


def _jsonl_stream(source: Source, path: str) -> Any:
    """The file's text: ``.gz`` and ``.zst`` are decompressed on the way (pyarrow detects them by
    extension)."""
    return source.filesystem.open_input_stream(path, compression="detect")


def _raw_batches(source: Source, shard: Shard, reading: Reading) -> Iterator[pa.RecordBatch]:
    """The shard's records as they are in the source, with a ``__key__`` field where the source has
    no key of its own (file and row)."""
    row = 0
    if shard.format == "parquet":
        with source.filesystem.open_input_file(shard.path) as handle:
            parquet = pq.ParquetFile(handle)
            groups = [shard.row_group] if shard.row_group is not None else None
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=groups):
                yield _with_row_keys(batch, shard.id, row)
                row += batch.num_rows
    elif shard.format == "jsonl":
        with _jsonl_stream(source, shard.path) as stream:
            try:
                reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=JSON_BLOCK_BYTES))
            except pa.ArrowInvalid as error:
                if "Empty JSON stream" in str(error):
                    return  # an empty file (or one of blank lines) holds no record
                raise
            for batch in reader:
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    part = batch.slice(start, BATCH_ROWS)
                    yield _with_row_keys(part, shard.id, row)
                    row += part.num_rows
    elif shard.format == "hf":
        with source.filesystem.open_input_stream(shard.path) as stream:
            for batch in pa.ipc.open_stream(stream):
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    part = batch.slice(start, BATCH_ROWS)
                    yield _with_row_keys(part, shard.id, row)
                    row += part.num_rows
    elif shard.format == "imagefolder":
        yield from _file_batches(source, shard, reading, "image", _image_record)
    elif shard.format == "text":
        yield from _file_batches(source, shard, reading, "text", _document_record)
    else:
        with source.filesystem.open_input_stream(shard.path, compression="detect") as stream:
            yield from webdataset_batches(stream, source.uri(shard.path), source.max_record_bytes, reading)


def _image_record(source: Source, key: str, data: bytes) -> dict[str, Any]:
    return {"image": data, "label": source.classes.index(key.split("/", 1)[0]), "__key__": key}


def _document_record(source: Source, key: str, data: bytes) -> dict[str, Any]:
    return {"text": data.decode("utf-8", errors="replace"), "__key__": key}


def _file_batches(
    source: Source,
    shard: Shard,
    reading: Reading,
    field_name: str,
    record: Callable[[Source, str, bytes], dict[str, Any]],
) -> Iterator[pa.RecordBatch]:
    """A run of files, each one record, in batches bounded in rows and bytes; a file over the record
    limit is never read whole, and one whose contents the read does not need is not opened."""
    records: list[dict[str, Any]] = []
    size = 0
    for path in shard.files:
        data = b""
        if reading.wants(field_name):
            with source.filesystem.open_input_stream(path) as handle:
                data = _read_bounded(handle, source.max_record_bytes)
            if len(data) > source.max_record_bytes:
                limit_mb = source.max_record_bytes >> 20
                reading.skip("too big", f"{source.uri(path)} is larger than max_record_mb ({limit_mb} MiB)", TOO_BIG_FIX)
                continue
        records.append(record(source, file_key(source, path), data))
        size += len(data)
        if len(records) >= BATCH_ROWS or size >= BATCH_BYTES:
            yield pa.RecordBatch.from_pylist(records)
            records, size = [], 0
    if records:
        yield pa.RecordBatch.from_pylist(records)


# The first read of a file; each next one doubles, up to READ_CHUNK. A read of the whole record limit
# at once would allocate it for every small file.
FIRST_READ = 64 << 10


READ_CHUNK = 8 << 20


def _read_bounded(handle: Any, limit: int) -> bytes:
    """A file's bytes, or its first ``limit + 1`` when it is larger than ``limit``."""
    parts: list[bytes] = []
    total, chunk = 0, FIRST_READ
    while total <= limit:
        part = handle.read(min(chunk, limit + 1 - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
        chunk = min(chunk * 2, READ_CHUNK)
    return b"".join(parts)


def _with_row_keys(batch: pa.RecordBatch, shard_id: str, first: int) -> pa.RecordBatch:
    """The batch with a ``__key__`` of file and row, unless the source has a ``__key__`` of its own."""
    if "__key__" in batch.schema.names:
        return batch
    keys = pa.array([f"{shard_id}:{first + index}" for index in range(batch.num_rows)], pa.string())
    return batch.append_column("__key__", keys)


def format_defaults(format: str, fields: list[str]) -> dict[str, str]:
    """Where a format keeps each column unless the spec says otherwise."""
    if format == "webdataset":
        image = next((extension for extension in IMAGE_EXTENSIONS if extension in fields), "jpg")
        return {"image": image, "label": "cls", "text": "txt", "key": "__key__"}
    return {"image": "image", "label": "label", "text": "text", "key": "__key__"}


def _readable(source: Source, shard: Shard, reading: Reading) -> Iterator[pa.RecordBatch]:
    """The shard's raw batches; a file that cannot be read as its format is one clear error naming it."""
    where = source.uri(shard.path)
    try:
        for batch in _raw_batches(source, shard, reading):
            if shard.format == "jsonl":
                batch.validate(full=True)  # pyarrow's JSON reader lets invalid UTF-8 through; Lance would not read it
            yield batch
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError, ValueError) as error:
        raise UserError(
            f"{where}: cannot read it as {shard.format}: {error}\n"
            "  fix: mend or remove the file, or point the source's glob past it"
        ) from None


def mapped_batches(source: Source, shard: Shard, columns: ColumnMap, reading: Reading | None = None) -> Iterator[pa.RecordBatch]:
    """The shard's records with the mapped columns renamed (``image``, ``label``, ``text``, ``key``)
    and every other field kept; ``label`` as int64, ``image`` as binary, ``text`` and ``key`` as
    strings. ``reading`` says what becomes of a record past a bound (by default: an error) and
    gathers what was skipped."""
    for batch in _readable(source, shard, reading or Reading()):
        fields = batch.schema.names
        chosen = columns.resolve(fields, format_defaults(shard.format, fields))
        arrays: dict[str, pa.Array] = {}
        for column, name in chosen.items():
            arrays[column] = _as_column(column, batch.column(name), source.uri(shard.path), name)
        used = set(chosen.values()) | {"__key__"}
        if shard.format == "webdataset":  # the other image files of a sample are not columns
            used |= set(IMAGE_EXTENSIONS)
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
                f"{source.uri(shard.path)}: no text field to tokenise; its fields:{listing(batch.schema.names, '    ')}\n"
                "  fix: map columns.text to the field that holds the documents' text"
            )
        yield batch
