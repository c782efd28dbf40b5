"""The commit of a refresh: the values computed for the rows a column lacks joined to the column.

A gap's new data file (``LanceFragment.merge_columns``, its columns under temporary names) gets its
fields renumbered to the columns' own field ids; an all-null file the gap had is left out, or,
holding other columns too, keeps them with the column's field marked dropped. Every other fragment
of the pinned version is passed on as it was, in one ``Merge`` whose schema is the dataset's own
with the columns' provenance extended: no data file is rewritten, no field id changes (indices on
the columns stay valid for the fragments they cover). Which fragments lack the columns is
:mod:`lance_hpc.backfill.missing`.
"""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.backfill.missing import DROPPED_FIELD, field_ids
from lance_hpc.errors import UserError
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.writeback import column_swap


def filled_fragments(pinned: Any, written: Mapping[int, tuple[str, list[str]]], stored: Mapping[str, str]) -> list[Any]:
    """Every fragment of the ``pinned`` version for the commit: those in ``written`` (position ->
    the record's fragment JSON and encoded schema) with their new file's fields renumbered to the
    columns' ids and the all-null files they replace left out or marked; the others as they were."""
    import lance

    ids = field_ids(pinned.lance_schema)
    targets = {ids[output] for output in stored}
    fragments = []
    for position, fragment in enumerate(pinned.get_fragments()):
        if position not in written:
            fragments.append(fragment.metadata)
            continue
        text, schema = written[position]
        computed = column_swap.committed_schema(schema, {})  # the pinned fields and the new ones, as written
        check_new_types(pinned, computed, stored)
        new_ids = field_ids(computed)
        renumbered = {new_ids[temporary]: ids[output] for output, temporary in stored.items()}
        metadata = lance.FragmentMetadata.from_json(text)
        files = []
        for data_file in metadata.files:
            if any(field in renumbered for field in data_file.fields):
                data_file.fields = [renumbered.get(field, field) for field in data_file.fields]
            elif any(field in targets for field in data_file.fields):
                data_file.fields = [DROPPED_FIELD if field in targets else field for field in data_file.fields]
                if all(field == DROPPED_FIELD for field in data_file.fields):
                    continue  # it held nothing but the nulls it is replaced by
            files.append(data_file)
        metadata.files = files
        fragments.append(metadata)
    return fragments


def check_new_types(pinned: Any, written: Any, stored: Mapping[str, str]) -> None:
    """The values computed have the column's exact type (a vector, its length), before they join it."""
    existing = {field.name(): field.to_arrow().type for field in pinned.lance_schema.fields()}
    new = {field.name(): field.to_arrow().type for field in written.fields()}
    for output, temporary in stored.items():
        if new[temporary] != existing[output]:
            raise UserError(
                f"infer.outputs.{output}: the job computed {new[temporary]}, but the column holds {existing[output]}; "
                "nothing was committed\n  fix: give the model or function the output shape the column has"
            )


def commit_fill(
    uri: str,
    options: Mapping[str, str],
    version: int,
    written: Mapping[int, tuple[str, list[str]]],
    stored: Mapping[str, str],
    metadata: Mapping[str, Mapping[str, str]],
) -> int:
    """One Merge on ``version``: the gaps' new files joined to the columns, their provenance
    extended (``metadata``); its new version."""
    import lance

    pinned: Any = open_dataset(uri, version, dict(options))
    fragments = filled_fragments(pinned, written, stored)
    schema = column_swap.with_field_metadata(pinned.lance_schema, metadata)
    operation = lance.LanceOperation.Merge(fragments, schema)
    dataset = lance.LanceDataset.commit(
        uri, operation, read_version=version, storage_options=dict(options) or None, max_retries=0
    )
    return int(dataset.version)
