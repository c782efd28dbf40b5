"""Sources as shards: the unit of work of an ingest job.

A source names files: ``parquet:<glob>``, ``jsonl:<glob>`` (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``),
``webdataset:<glob of .tar>`` (LAION/DataComp style: the files of one sample share a key, e.g.
``0001.jpg``, ``0001.cls``, ``0001.json``) or ``hf:<dir>`` (one split of a Hugging Face dataset saved
with ``save_to_disk``), each local or on an object store (``s3://...``). A shard is one file (an
Arrow file of a Hugging Face dataset), or one row group of a Parquet file with several, listed in a stable order. Reading a
shard yields Arrow record batches whose columns follow the spec's column mapping: ``image``
(encoded bytes), ``label`` (int64), ``text`` (string), ``key`` (the sample's key or the file and
row it came from), and every other field of the source under its own name and Arrow type.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

from lance_hpc.errors import UserError
from lance_hpc.spec.choices import INGEST_COLUMNS, SHARD_FORMATS, check_registry
from lance_hpc.storage.checkpoint_store import filesystem_arguments

FORMATS = ("parquet", "jsonl", "webdataset", "hf")
check_registry(FORMATS, SHARD_FORMATS, "data.ingest.source formats")
# Extensions of a WebDataset sample's image file, in the order one is picked when a sample has several.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
# JSON Lines are parsed in blocks this big; a line must fit in one (base64 images make long lines).
JSON_BLOCK_BYTES = 16 << 20
# Rows per record batch a shard is read in: bounded memory whatever the shard's size.
BATCH_ROWS = 256


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
                    f"columns.{column} names {wanted!r}, which the source does not have; its fields: {', '.join(fields)}\n"
                    f"  fix: set columns.{column} to one of them, or to '' if the source has no {column}"
                )
            chosen[column] = wanted
        return chosen


@dataclass(frozen=True)
class Shard:
    """One unit of ingest work: a file, or one row group of a Parquet file."""

    id: str  # stable and unique within the source: the path, with #row-group for a part of a Parquet file
    path: str  # as the file system reads it (no scheme)
    format: str
    bytes: int
    row_group: int | None = None


@dataclass
class Source:
    """A parsed source: its format, the file system, and the files its glob matches."""

    format: str
    pattern: str
    filesystem: pafs.FileSystem = field(repr=False)
    scheme: str = ""  # "s3://" for an object store, "" locally

    def uri(self, path: str) -> str:
        return f"{self.scheme}{path}"


def is_shard_source(text: str) -> bool:
    return text.split(":", 1)[0] in FORMATS and ":" in text


def parse_source(text: str, options: Mapping[str, str] | None = None) -> Source:
    kind, _, pattern = text.partition(":")
    if kind not in FORMATS or not pattern:
        raise UserError(f"source {text!r}: give {' | '.join(f'{name}:<glob>' for name in FORMATS)}")
    if pattern.startswith("s3://"):
        filesystem = pafs.S3FileSystem(**filesystem_arguments(options or {}))
        return Source(kind, pattern[len("s3://") :], filesystem, "s3://")
    return Source(kind, pattern, pafs.LocalFileSystem())


def glob_pattern(pattern: str) -> re.Pattern[str]:
    """A glob as a regular expression over ``/``-separated paths: ``*`` and ``?`` stay within one
    path component, ``**`` spans any number of them, ``[...]`` is a character class."""
    out, index = [], 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in pattern[index + 1 :]:
            end = pattern.index("]", index + 1)
            body = pattern[index + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            index = end
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out) + r"\Z")


def _matches(source: Source) -> list[pafs.FileInfo]:
    pattern = source.pattern
    static = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    base = static.rsplit("/", 1)[0] if "/" in static else "."
    if static == pattern:  # a single file
        info = source.filesystem.get_file_info(pattern)
        return [info] if info.type == pafs.FileType.File else []
    relative = pattern[len(base) + 1 :] if base != "." else pattern
    # only as deep as the pattern reaches: a glob of one directory does not walk a whole bucket
    recursive = "**" in relative or "/" in relative
    try:
        infos = source.filesystem.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    except OSError as error:
        raise UserError(f"cannot list {source.uri(base)}: {error}") from None
    matcher = glob_pattern(relative)
    found = []
    for info in infos:
        name = info.path[len(base) + 1 :] if base != "." else info.path
        if info.type == pafs.FileType.File and matcher.match(name) and not _hidden(name):
            found.append(info)
    return found


def _hidden(name: str) -> bool:
    """Files under a hidden directory or named with a leading dot (an ingest's own records, say)."""
    return any(part.startswith(".") for part in name.split("/"))


def _read_json(source: Source, path: str) -> Any:
    try:
        with source.filesystem.open_input_stream(path) as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        return None


def _hf_shards(source: Source) -> list[Shard]:
    """The Arrow files of a Hugging Face dataset saved with ``save_to_disk``, in its own order."""
    directory = source.pattern.rstrip("/")
    splits = _read_json(source, f"{directory}/dataset_dict.json")
    if splits is not None:
        names = ", ".join(splits.get("splits", []))
        raise UserError(
            f"hf:{source.uri(directory)} holds several splits ({names}): name one, e.g. hf:{source.uri(directory)}/"
            f"{(splits.get('splits') or ['train'])[0]}"
        )
    state = _read_json(source, f"{directory}/state.json")
    if state is None or not state.get("_data_files"):
        raise UserError(
            f"hf:{source.uri(directory)} is not a Hugging Face dataset saved with save_to_disk (no state.json listing "
            "its data files)\n  fix: point hf: at the directory save_to_disk wrote (one split)"
        )
    shards = []
    for entry in state["_data_files"]:
        path = f"{directory}/{entry['filename']}"
        size = source.filesystem.get_file_info(path).size or 0
        shards.append(Shard(path, path, "hf", size))
    return shards


def hf_class_names(source: Source, field_name: str) -> list[str] | None:
    """The names of a ``ClassLabel`` field of a saved Hugging Face dataset, if it is one."""
    if source.format != "hf":
        return None
    info = _read_json(source, f"{source.pattern.rstrip('/')}/dataset_info.json") or {}
    feature = (info.get("features") or {}).get(field_name) or {}
    names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    return [str(name) for name in names] if names else None


def list_shards(source: Source) -> list[Shard]:
    """The source's shards in a stable order (sorted paths; a Parquet file's row groups in order)."""
    if source.format == "hf":
        return _hf_shards(source)
    infos = sorted(_matches(source), key=lambda info: info.path)
    if not infos:
        raise UserError(
            f"{source.format}:{source.uri(source.pattern)} matches no file\n"
            "  fix: check the path and the glob (quote it in a shell so the shell does not expand it)"
        )
    shards: list[Shard] = []
    for info in infos:
        if source.format == "parquet":
            try:
                with source.filesystem.open_input_file(info.path) as handle:
                    groups = pq.ParquetFile(handle).metadata.num_row_groups
            except (pa.ArrowInvalid, OSError) as error:
                raise UserError(f"{source.uri(info.path)} is not a Parquet file, or is damaged: {error}") from None
            if groups > 1:
                share = info.size // groups
                shards += [Shard(f"{info.path}#{group}", info.path, "parquet", share, group) for group in range(groups)]
                continue
        shards.append(Shard(info.path, info.path, source.format, info.size))
    return shards


# ---- reading a shard --------------------------------------------------------------------------


def _jsonl_stream(source: Source, path: str) -> Any:
    """The file's text: ``.gz`` and ``.zst`` are decompressed on the way (pyarrow detects them by
    extension)."""
    return source.filesystem.open_input_stream(path, compression="detect")


def _raw_batches(source: Source, shard: Shard) -> Iterator[pa.RecordBatch]:
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
            reader = pajson.open_json(stream, read_options=pajson.ReadOptions(block_size=JSON_BLOCK_BYTES))
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
    else:
        yield from _webdataset_batches(source, shard)


def _with_row_keys(batch: pa.RecordBatch, shard_id: str, first: int) -> pa.RecordBatch:
    """The batch with a ``__key__`` of file and row, unless the source has a ``__key__`` of its own."""
    if "__key__" in batch.schema.names:
        return batch
    keys = pa.array([f"{shard_id}:{first + index}" for index in range(batch.num_rows)], pa.string())
    return batch.append_column("__key__", keys)


def _webdataset_batches(source: Source, shard: Shard) -> Iterator[pa.RecordBatch]:
    """Samples of a WebDataset tar: consecutive members sharing a key (the name up to its first dot
    after the last slash) make one record; ``.json`` members add their fields, ``.cls`` an integer,
    ``.txt`` a string, other extensions their bytes."""
    records: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    where = source.uri(shard.path)
    with source.filesystem.open_input_stream(shard.path, compression="detect") as raw:
        for member_name, data in tar_members(raw, where):
            directory, _, name = member_name.rpartition("/")
            stem, dot, extension = name.partition(".")
            if not dot or stem.startswith("."):
                continue
            key = f"{directory}/{stem}" if directory else stem
            if current is None or current["__key__"] != key:
                if current is not None:
                    records.append(current)
                current = {"__key__": key}
            extension = extension.lower()
            if extension == "json":
                try:
                    fields = json.loads(data)
                except ValueError as error:
                    raise UserError(f"{where}: {member_name} is not JSON ({error})") from None
                if isinstance(fields, dict):
                    current.update({name: value for name, value in fields.items() if name not in current})
            elif extension == "cls":
                try:
                    current["cls"] = int(data.decode().strip())
                except ValueError:
                    raise UserError(f"{where}: {member_name} holds {data[:40]!r}, not a class number") from None
            elif extension == "txt":
                current["txt"] = data.decode("utf-8", errors="replace")
            else:
                current[extension] = data
            if len(records) >= BATCH_ROWS:
                yield _samples_batch(records, where)
                records = []
    if current is not None:
        records.append(current)
    if records:
        yield _samples_batch(records, where)


def _samples_batch(records: list[dict[str, Any]], where: str) -> pa.RecordBatch:
    """Samples as columns: every field any of them has (missing ones null), not only the first's."""
    names = dict.fromkeys(name for record in records for name in record)
    try:
        return pa.RecordBatch.from_pydict({name: [record.get(name) for record in records] for name in names})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise UserError(f"{where}: the samples' fields do not fit one type each: {error}") from None


TAR_BLOCK = 512


class _Chunks:
    """``read(n)`` over a stream read 8 MiB at a time: a tar's many small header reads cost a
    Python slice each, not a call into the stream."""

    CHUNK = 8 << 20

    def __init__(self, stream: Any) -> None:
        self.stream, self.buffer, self.offset = stream, b"", 0

    def read(self, size: int) -> bytes:
        if self.offset + size <= len(self.buffer):
            part = self.buffer[self.offset : self.offset + size]
            self.offset += size
            return part
        parts, left = [self.buffer[self.offset :]], size - (len(self.buffer) - self.offset)
        self.buffer, self.offset = b"", 0
        while left > 0:
            chunk = self.stream.read(max(self.CHUNK, left))
            if not chunk:
                break
            chunk = bytes(chunk)
            if len(chunk) > left:
                parts.append(chunk[:left])
                self.buffer, self.offset = chunk, left
                left = 0
            else:
                parts.append(chunk)
                left -= len(chunk)
        return b"".join(parts)


def _read_exact(stream: _Chunks, size: int) -> bytes:
    return stream.read(size) if size else b""


def tar_members(stream: Any, where: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file of a tar stream, in order: ustar, GNU long names and pax
    paths. Read block by block with the header checksums checked, much cheaper than ``tarfile``."""
    long_name: str | None = None
    stream = _Chunks(stream)
    while True:
        header = _read_exact(stream, TAR_BLOCK)
        if len(header) < TAR_BLOCK or header == bytes(TAR_BLOCK):
            if header.strip(b"\0"):
                raise UserError(f"{where} is not a tar file, or is cut short (a header of {len(header)} bytes)")
            return
        try:
            stored = int(header[148:156].strip(b"\0 ") or b"0", 8)
            size_field = header[124:136]
            size = int.from_bytes(size_field[1:], "big") if size_field[0] & 0x80 else int(size_field.strip(b"\0 ") or b"0", 8)
        except ValueError:
            raise UserError(f"{where} is not a tar file (a header that does not parse)") from None
        if stored != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise UserError(f"{where} is not a tar file, or is damaged (a header checksum does not match)")
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if header[257:262] == b"ustar":
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            name = f"{prefix}/{name}" if prefix else name
        data = _read_exact(stream, size)
        if len(data) < size:
            raise UserError(f"{where} is cut short: {name} should have {size} bytes, the file ends after {len(data)}")
        _read_exact(stream, -size % TAR_BLOCK)
        kind = header[156:157]
        if kind == b"L":  # GNU: the next member's long name
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":  # pax: the next member's attributes, "LENGTH KEY=VALUE\n" each
            for record in data.decode("utf-8", "surrogateescape").splitlines():
                key, _, value = record.partition(" ")[2].partition("=")
                if key == "path":
                    long_name = value
        elif kind in (b"0", b"\0", b"7"):
            yield long_name or name, data
            long_name = None
        else:  # directories, links, global pax headers
            long_name = None


def format_defaults(format: str, fields: list[str]) -> dict[str, str]:
    """Where a format keeps each column unless the spec says otherwise."""
    if format == "webdataset":
        image = next((extension for extension in IMAGE_EXTENSIONS if extension in fields), "jpg")
        return {"image": image, "label": "cls", "text": "txt", "key": "__key__"}
    return {"image": "image", "label": "label", "text": "text", "key": "__key__"}


def _readable(source: Source, shard: Shard) -> Iterator[pa.RecordBatch]:
    """The shard's raw batches; a file that cannot be read as its format is one clear error naming it."""
    where = source.uri(shard.path)
    try:
        for batch in _raw_batches(source, shard):
            if shard.format == "jsonl":
                batch.validate(full=True)  # pyarrow's JSON reader lets invalid UTF-8 through; Lance would not read it
            yield batch
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError, ValueError) as error:
        raise UserError(
            f"{where}: cannot read it as {shard.format}: {error}\n"
            "  fix: mend or remove the file, or point the source's glob past it"
        ) from None


def mapped_batches(source: Source, shard: Shard, columns: ColumnMap) -> Iterator[pa.RecordBatch]:
    """The shard's records with the mapped columns renamed (``image``, ``label``, ``text``, ``key``)
    and every other field kept; ``label`` as int64, ``image`` as binary, ``text`` and ``key`` as
    strings."""
    for batch in _readable(source, shard):
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
        raise UserError(
            f"{where}: field {name!r} ({values.type}) cannot become the {column} column ({wanted}): {error}\n"
            f"  fix: map columns.{column} to the right field"
        ) from None
