"""Where a dataset's columns and a checkpoint came from (``lance-hpc lineage DATASET|CHECKPOINT_DIR``).

For a dataset, each column lance_hpc wrote, as a chain: the data its checkpoint was trained on ->
the checkpoint (directory, step, weights) or function -> the column (the version it read, the rows,
each refresh since). A column whose checkpoint was trained on rows of the dataset it scored is
flagged: its values on those rows are not a held-out estimate (validation leakage). For a checkpoint
directory, each checkpoint in it with the data it was trained and validated on and its spec.
Everything is read from the dataset's schema and the checkpoints' manifests: nothing is loaded.
Both may have been written by anyone with access to them: a column whose provenance is not a
document lance_hpc wrote is shown as invalid, and every line is printed with its control
characters escaped (:func:`lance_hpc.output.printable`).
"""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.checkpoint.manifests import checkpoint_steps, latest, read_manifest
from lance_hpc.checkpoint.stores import Store, open_store
from lance_hpc.errors import UserError
from lance_hpc.lineage.checkpoints import source_text
from lance_hpc.lineage.provenance import InvalidProvenance, absolute, derived_columns, producer_of, provenance_of
from lance_hpc.output import printable
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import storage_options


def column_lines(name: str, kind: Any, document: Mapping[str, Any]) -> list[str]:
    """One column's chain, its refreshes, and a leakage warning when its checkpoint saw its rows."""
    made_by = producer_of(document)
    read = document.get("dataset") or {}
    lines = [f"  {name} ({kind}): {made_by.describe()}"]
    checkpoint = document.get("checkpoint") or {}
    trained = checkpoint.get("lineage") or {}
    sources = trained.get("trained_on") or []
    if checkpoint:
        weights = f", weights {checkpoint['weights']}" if checkpoint.get("weights") else ""
        where = "; ".join(source_text(source) for source in sources) or "data not recorded (saved before lineage was)"
        lines.append(f"    {where} -> checkpoint {checkpoint.get('dir')} step {checkpoint.get('step')}{weights}")
    rows = f"{document.get('rows', 0):,} rows in {document.get('fragments', 0)} fragment(s)"
    where = f", rows where {document['filter']}" if document.get("filter") else ""
    lines.append(
        f"    -> {name}: read version {read.get('version')}{where}, {rows}, spec {document.get('spec')}, "
        f"at {document.get('written_at')}"
    )
    for entry in document.get("refreshes", []):
        lines.append(
            f"       refreshed: read version {entry.get('dataset_version')}, {entry.get('rows', 0):,} rows in "
            f"{entry.get('fragments', 0)} fragment(s), spec {entry.get('spec')}, at {entry.get('written_at')}"
        )
    scored = read.get("uri")
    seen = [source for source in sources if source.get("uri") and source.get("uri") == scored]
    if seen:
        lines.append(
            f"    warning: {name} was computed by a checkpoint trained on {'; '.join(source_text(s) for s in seen)}, "
            "the dataset it scored: on those rows its values are not held-out predictions (validation leakage); "
            "score a dataset the checkpoint did not train on (its data.val_uri, or rows outside its data.filter)"
        )
    return lines


def dataset_lines(uri: str, dataset: Any) -> list[str]:
    schema = dataset.schema
    derived = derived_columns(schema)
    lines = [f"dataset {absolute(uri)}, version {dataset.version}"]
    if not derived:
        return lines + ["  no column written by lance_hpc (none carries provenance)"]
    for name in derived:
        try:
            document = provenance_of(schema, name)
        except InvalidProvenance as error:
            lines.append(f"  {name} ({schema.field(name).type}): provenance invalid, not shown: {error.problem}")
            continue
        assert document is not None  # derived_columns lists the columns that have one
        lines += column_lines(name, schema.field(name).type, document)
    others = [name for name in schema.names if name not in derived]
    if others:
        lines.append(f"  other columns (no provenance): {', '.join(others)}")
    return lines


def checkpoint_lines(store: Store, directory: str) -> list[str]:
    steps = checkpoint_steps(store.names())
    lines = [f"checkpoints in {absolute(directory)}: {len(steps)}"]
    for step in steps:
        manifest = read_manifest(store, step)
        lineage = manifest.get("lineage") or {}
        lines.append(f"  step {step}, saved at {manifest.get('saved_at', 'unknown')}")
        if not lineage:
            lines.append("    lineage not recorded (saved before lance_hpc kept it in the manifest)")
            continue
        for source in lineage.get("trained_on") or []:
            lines.append(f"    trained on {source_text(source)}")
        if lineage.get("validated_on"):
            lines.append(f"    validated on {lineage['validated_on']}")
        trained_by = f"entry {lineage['entry']}, " if lineage.get("entry") else ""
        lines.append(f"    job {lineage.get('job')}, {trained_by}task {lineage.get('task')}, spec {lineage.get('spec')}")
    return lines


def lineage_lines(target: str, options: Mapping[str, str]) -> list[str]:
    """The chain for a checkpoint directory or a dataset at ``target``."""
    store = open_store(target)
    if latest(store) is not None:
        return checkpoint_lines(store, target)
    try:
        dataset = open_dataset(target, None, dict(options))
    except UserError as error:
        raise UserError(
            f"{target} is neither a checkpoint directory nor a Lance dataset ({str(error).splitlines()[0]})\n"
            "  fix: give a dataset's URI (data.uri) or a training job's checkpoint.dir"
        ) from None
    return dataset_lines(target, dataset)


def print_lineage(target: str, given: Mapping[str, str]) -> int:
    """``lance-hpc lineage TARGET``: the chain printed; ``given``: object-store options (endpoint, region)."""
    print("\n".join(printable(line) for line in lineage_lines(target, storage_options(target, dict(given)))))
    return 0
