"""The rows a column lacks: which fragments a refresh computes, and whether it may add to the column.

A Lance fragment stores its columns in data files, each naming the field ids it holds. Rows
appended after a column was written (``lance-hpc ingest --append``, LanceDB's ``add``, Lance's own
append) come in fragments with no data file for that field: they read as null. Appended with
explicit nulls instead, the fragment has a file of the rows, that field among its others, whose
every value is null. Either fragment is a *gap*; a fragment with some values and some nulls (rows
the model could not read, rows outside the job's filter) is not: its values stay as they are.

Which fragments are gaps is read from the manifest, not from the values, wherever it can be: a
fragment whose columns a write-back wrote holds them in a data file of those columns alone
(``merge_columns``), and holds what that job computed, nulls included, so it is never read. Only
a fragment that holds the columns in a file of its rows is read, to see whether they are all null:
the rows appended since, not the table the columns were written for.

The ranks compute a gap's values as a new data file (``LanceFragment.merge_columns``, under a
temporary name, as for a column an overwrite replaces). The commit is one ``Merge`` of every
fragment of the version the job read: a gap gets the new file with its fields renumbered to the
column's own field ids (an all-null file it had is left out, or, holding other columns too, keeps
them with the column's field marked dropped), every other fragment is passed on exactly as it was,
and the schema is the dataset's own with the columns' provenance extended. No existing data file is
rewritten, no field id changes (indices on the column stay valid for the fragments they cover), and
readers see the new values all at once or not at all (:mod:`lance_hpc.writeback.fill`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.lineage.provenance import InvalidProvenance, Producer, differs, provenance_of
from lance_hpc.output import printable

# A field id that a data file keeps for a column it no longer provides (Lance's tombstone).
DROPPED_FIELD = -2


def field_ids(schema: Any) -> dict[str, int]:
    """Each top-level column's Lance field id, by name (of a ``lance_schema``)."""
    return {field.name(): field.id() for field in schema.fields()}


def gaps(dataset: Any, outputs: Iterable[str], *, all_null: bool = True) -> list[int]:
    """The positions (in ``dataset.get_fragments()``) of the fragments without values of
    ``outputs``: no data file for them, or, with ``all_null``, only nulls in every one of them where
    a file of the fragment's rows holds them (a file of the columns alone is a write-back's: not read)."""
    ids = field_ids(dataset.lance_schema)
    wanted = {ids[name] for name in outputs}
    found = []
    for position, fragment in enumerate(dataset.get_fragments()):
        holding = [set(data_file.fields) for data_file in fragment.metadata.files if wanted & set(data_file.fields)]
        if not holding:
            found.append(position)
        elif all_null and any(fields - wanted - {DROPPED_FIELD} for fields in holding) and _all_null(fragment, list(outputs)):
            found.append(position)
    return found


def _all_null(fragment: Any, outputs: list[str]) -> bool:
    """Whether every value of ``outputs`` in the fragment is null, read from its files (an index on
    a column, which may be stale, is not asked)."""
    table = fragment.to_table(columns=outputs)
    return all(table.column(name).null_count == table.num_rows for name in outputs)


def fills(dataset: Any, uri: str, outputs: Mapping[str, str], made_by: Producer, overwrite: bool) -> bool:
    """Whether a refresh adds to the columns ``dataset`` has (True) or writes them whole (False: none
    of them is there yet, or ``overwrite`` replaces columns another model or function made). A
    UserError, with the reason, for columns it may not add to."""
    there = [name for name in outputs if name in dataset.schema.names]
    if not there:
        return False
    absent = [name for name in outputs if name not in there]
    if absent:
        raise UserError(
            f"infer.refresh: {uri} has {', '.join(there)} but not {', '.join(absent)}, so the rows missing them cannot be "
            "told apart\n  fix: refresh the columns the dataset has in one job, and write the others in another"
        )
    reasons = {name: provenance_differs(dataset.schema, name, made_by) for name in outputs}
    refused = {name: reason for name, reason in reasons.items() if reason}
    if refused and overwrite:
        return False
    if refused:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in refused.items())
        raise UserError(
            f"infer.refresh: {uri} already has {', '.join(refused)} from another model or function, and a column holds the "
            f"values of one only ({made_by.describe()} here):\n{lines}\n"
            "  fix: name the checkpoint and function that wrote them, or set infer.overwrite: true to compute the columns "
            "again for every row"
        )
    for name, kind in outputs.items():
        check_type(dataset.schema.field(name).type, kind, name, uri)
    return True


def provenance_differs(schema: pa.Schema, name: str, made_by: Producer) -> str | None:
    """Why ``made_by``'s values may not join column ``name`` (None when they may), a provenance
    document that is not lance_hpc's among the reasons: anyone may have set its field metadata, so
    what it records is shown with its control characters escaped."""
    try:
        reason = differs(provenance_of(schema, name), made_by)
    except InvalidProvenance as error:
        return f"its provenance is not one lance_hpc wrote ({error.problem})"
    return None if reason is None else printable(reason)


def check_type(existing: pa.DataType, kind: str, name: str, uri: str) -> None:
    """The column's values (or a vector's elements) are of the type infer.outputs gives it."""
    values = existing.value_type if pa.types.is_fixed_size_list(existing) else existing
    if values != pa.from_numpy_dtype(np.dtype(kind)):
        raise UserError(
            f"infer.outputs.{name}: {kind}, but the column {name} of {uri} holds {existing}\n"
            f"  fix: give {name} the column's own type in infer.outputs"
        )


def describe(dataset: Any, positions: list[int], outputs: Iterable[str]) -> str:
    """``N rows in K of F fragments lack a, b``."""
    fragments = dataset.get_fragments()
    rows = sum(fragments[position].count_rows() for position in positions)
    return f"{rows:,} rows in {len(positions)} of {len(fragments)} fragments lack {', '.join(outputs)}"


def lacking_note(dataset: Any, outputs: Iterable[str]) -> str | None:
    """For a job whose columns are all there: a line on the rows that lack their values (appended
    since), and how to fill them; None when no row does."""
    names = list(outputs)
    if any(name not in dataset.schema.names for name in names):
        return None
    positions = gaps(dataset, names)
    if not positions:
        return None
    fragments = dataset.get_fragments()
    rows = sum(fragments[position].count_rows() for position in positions)
    return (
        f"  note: {rows:,} rows have no {', '.join(names)} (in {len(positions)} fragment(s), appended since?): "
        "set infer.refresh: missing to compute the columns for those rows only"
    )


__all__ = ["DROPPED_FIELD", "check_type", "describe", "field_ids", "fills", "gaps", "lacking_note"]
