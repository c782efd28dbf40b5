"""Which columns a write-back may replace, and replacing them in the commit that adds their new
values (``infer.overwrite``).

A job that replaces a column must never make a version without it visible: a failing job would
leave the dataset without the user's column, and a rerun could not read what it needs. So the
ranks write a replaced column's new values under a temporary name (``LanceFragment.merge_columns``
refuses a name the dataset has), and the one ``Merge`` that adds them carries a schema in which the
old column is gone and the new one has the user's name. Readers of a version see the old column
or the new one, never neither.

A Lance schema cannot be renamed through Arrow without losing its field ids (they are dense from
an Arrow schema, while a dataset that ever dropped a column has gaps), so the schema is edited in
the form Lance serialises it in: one protobuf ``Field`` message per field, whose name is field 2,
its id field 3, its parent's id field 4 and its metadata field 10 (a map: one entry message per
key, whose key is field 1 and value field 2). A dropped field's files stay in the fragments, as
``drop_columns`` leaves them: Lance reads only the fields its schema names. The commit also sets
the field metadata of the columns it writes (their provenance), so that the values and the record
of where they came from appear in one version.
"""

from __future__ import annotations

import base64
from typing import Any, Mapping, Sequence

import pyarrow as pa

from lance_hpc.errors import UserError

# What a replaced column's new values are written under until the commit names them: never
# visible, since no committed schema holds it, and never beginning with "_" (Lance's own names).
TEMPORARY_PREFIX = "lance_hpc_new_"

# Protobuf wire format: (field number << 3) | wire type; type 0 a varint, 1 8 bytes, 2 a length
# and that many bytes, 5 4 bytes.
_NAME, _ID, _PARENT, _METADATA = 2, 3, 4, 10
_KEY, _VALUE = 1, 2
_LENGTH_DELIMITED = 2


def existing_columns(schema: pa.Schema, outputs: Mapping[str, str]) -> list[str]:
    return [name for name in outputs if name in schema.names]


def check_columns(dataset: Any, uri: str, outputs: Mapping[str, str], overwrite: bool) -> None:
    """A column the dataset has is replaced only when asked; a fragment with deleted rows is refused."""
    there = existing_columns(dataset.schema, outputs)
    if there and not overwrite:
        raise UserError(
            f"{uri} already has the column(s) {', '.join(there)}\n"
            "  fix: name other columns in infer.outputs, or set infer.overwrite: true to replace them in a new version "
            "(the earlier versions keep them)"
        )
    if any(fragment.metadata.deletion_file is not None for fragment in dataset.get_fragments()):
        raise UserError(
            f"{uri} has deleted rows: new columns are written per fragment for every row it stores\n"
            "  fix: compact the dataset first (lance: dataset.optimize.compact_files(materialize_deletions=True))"
        )


def check_inputs(outputs: Mapping[str, str], inputs: Sequence[str], task: str) -> None:
    """An output may not replace a column the task reads its rows from: the job would replace the
    values it reads while it reads them, and every rerun would read its own outputs."""
    clash = [name for name in outputs if name in inputs]
    if clash:
        raise UserError(
            f"infer.outputs: {', '.join(clash)} is a column task {task} reads (it reads {', '.join(inputs)}): the job would "
            "replace its own input\n  fix: write the output under another name, e.g. "
            f"{clash[0]}_predicted"
        )


def stored_names(names: list[str], outputs: Mapping[str, str]) -> dict[str, str]:
    """Each output's name in the data files the ranks write: its own, or a temporary one for a
    column the dataset has (``names``), unique among them; the same on every rank."""
    taken, stored = set(names) | set(outputs), {}
    for output in outputs:
        if output not in names:
            stored[output] = output
            continue
        candidate, counter = f"{TEMPORARY_PREFIX}{output}", 1
        while candidate in taken:
            candidate, counter = f"{TEMPORARY_PREFIX}{output}_{counter}", counter + 1
        taken.add(candidate)
        stored[output] = candidate
    return stored


def encode(schema: Any) -> list[str]:
    """A Lance schema as text for a record: its metadata and its fields' protobuf messages (base64)."""
    metadata, *fields = schema.__reduce__()[1]  # how Lance pickles it
    return [metadata, *(base64.b64encode(field).decode() for field in fields)]


def committed_schema(
    encoded: list[str], stored: Mapping[str, str], metadata: Mapping[str, Mapping[str, str]] | None = None
) -> Any:
    """The schema of the commit: the schema ``merge_columns`` made (the dataset's fields, then the
    new ones under their stored names, Lance's own field ids), with each column an output replaces
    removed (and its children), each output under its own name, and ``metadata`` (column -> key ->
    value) set on the top-level columns it names."""
    from lance.schema import LanceSchema

    schema_metadata, *fields = encoded
    messages = [base64.b64decode(field) for field in fields]
    renamed = {temporary: output for output, temporary in stored.items() if temporary != output}
    parsed = [_decode(message) for message in messages]
    replaced = set(renamed.values())
    removed = {values[_ID] for values in parsed if values[_PARENT] == -1 and values[_NAME] in replaced}
    kept = []
    for message, values in zip(messages, parsed):
        if values[_ID] in removed or values[_PARENT] in removed:
            removed.add(values[_ID])  # a child of a removed field (fields come parents first)
            continue
        top_level = values[_PARENT] == -1
        name = renamed.get(values[_NAME], values[_NAME]) if top_level else values[_NAME]
        if name != values[_NAME]:
            message = _with_name(message, name)
        if top_level and metadata and name in metadata:
            message = _with_metadata(message, metadata[name])
        kept.append(message)
    return LanceSchema._from_protos(schema_metadata, *kept)


def with_field_metadata(schema: Any, metadata: Mapping[str, Mapping[str, str]]) -> Any:
    """A Lance schema (a dataset's ``lance_schema``) with ``metadata`` set on the top-level columns
    it names, field ids and everything else as they were."""
    return committed_schema(encode(schema), {}, metadata)


def _decode(message: bytes) -> dict[int, Any]:
    """A field's name, id and parent id (-1 at the top level) from its protobuf message."""
    values: dict[int, Any] = {_NAME: "", _ID: 0, _PARENT: 0}
    for number, value, _ in _entries(message):
        if number == _NAME:
            values[_NAME] = bytes(value).decode()
        elif number in (_ID, _PARENT):
            values[number] = value - (1 << 64) if value >= 1 << 63 else value  # int32, sign-extended
    return values


def _with_name(message: bytes, name: str) -> bytes:
    """The message with its name field replaced (every other field as it was)."""
    name_entry = _length_delimited(_NAME, name.encode())
    return b"".join(name_entry if number == _NAME else raw for number, _, raw in _entries(message))


def _with_metadata(message: bytes, entries: Mapping[str, str]) -> bytes:
    """The message with ``entries`` in its field metadata (an entry of the same key replaced)."""

    def key_of(entry: bytes) -> str:
        return next((bytes(value).decode() for number, value, _ in _entries(entry) if number == _KEY), "")

    kept = [raw for number, value, raw in _entries(message) if number != _METADATA or key_of(bytes(value)) not in entries]
    added = []
    for key, value in entries.items():
        entry = _length_delimited(_KEY, key.encode()) + _length_delimited(_VALUE, value.encode())
        added.append(_length_delimited(_METADATA, entry))
    return b"".join(kept + added)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _entries(message: bytes) -> list[tuple[int, Any, bytes]]:
    """(field number, value, the entry's bytes) of each entry of a protobuf message, in order."""
    position, found = 0, []
    while position < len(message):
        start = position
        key, position = _read_varint(message, position)
        number, wire_type = key >> 3, key & 7
        value: Any
        if wire_type == 0:
            value, position = _read_varint(message, position)
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _read_varint(message, position)
            value, position = message[position : position + length], position + length
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, position = message[position : position + size], position + size
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type} in a Lance schema field")
        found.append((number, value, message[start:position]))
    return found


def _read_varint(message: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = message[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | 0x80 if value else low)
        if not value:
            return bytes(out)
