"""The end of an ingest: every shard's fragments once, in the plan's order, as one Lance commit per
dataset (a new dataset; a new version with ``overwrite``; more rows with ``append``), so the dataset
appears whole or not at all, and its rows are in the same order whatever the number of workers or
interruptions. Each split's commit carries the run id and is recorded as it lands
(:mod:`lance_hpc.ingest.rerun`): a rerun after a crash between the commits commits only what is
missing. A token split's figures (documents, bytes per token) are summed over its shards' records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.packing import too_short, with_split_figures
from lance_hpc.ingest.plan import Plan
from lance_hpc.ingest.records import ShardRecord
from lance_hpc.ingest.rerun import (
    landed_splits,
    properties,
    read_version_of,
    record_intent,
    record_landed,
)
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.tasks.formats import BYTES_PER_TOKEN_KEY, DOCUMENTS_KEY


@dataclass
class Committed:
    versions: dict[str, int]
    rows: dict[str, int]
    skipped: dict[str, int]
    already: bool = False  # committed by an earlier run of the same plan
    found: dict[str, int] = field(default_factory=dict)  # splits an earlier run committed, not recorded


def totals(records: Iterable[ShardRecord], splits: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Rows per split (each of ``splits`` present) and skipped images by reason, over ``records``."""
    rows = dict.fromkeys(splits, 0)
    skipped: dict[str, int] = {}
    for record in records:
        for split, count in record.rows.items():
            rows[split] = rows.get(split, 0) + count
        for reason, count in record.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return rows, skipped


def commit(plan: Plan) -> Committed:
    """Every shard's fragments, once each and in plan order, as one commit per dataset; a split
    whose commit by an earlier run of this ingest the dataset holds is not committed again."""
    records = plan.shard_records()
    finished = records.finished()
    rows, skipped = totals(finished.values(), plan.targets())
    found = landed_splits(records, plan.targets(), plan.run_id)
    if len(found) == len(plan.targets()) and records.committed() == found:
        return Committed(found, rows, skipped, already=True)
    missing = [plan.shards[index].id for index in range(len(plan.shards)) if index not in finished]
    if missing and len(found) < len(plan.targets()):
        raise UserError(
            f"{len(missing)} of {len(plan.shards)} shards are not written yet (first: {missing[0]}); nothing was committed\n"
            "  fix: run the ingest again: it writes only the missing shards, then commits"
        )
    schemas = _split_schemas(plan, finished.values()) if not missing else {}
    versions: dict[str, int] = {}
    # Validation first: the training set appearing is what marks the ingest as done.
    for split in sorted(plan.targets(), key=lambda name: name != "val"):
        # the version the commit was made on: an earlier run's, for a split it committed
        read_version = read_version_of(records, split) if split in found else plan.read_versions[split]
        versions[split] = found[split] if split in found else _commit_split(plan, split, schemas[split], finished)
        if plan.mode == "append" and plan.tokens is not None and read_version is not None and split in schemas:
            # the split's figures over all its rows, old and new: one more version, metadata only (the
            # same values if an earlier run got this far, so a rerun may do it again)
            dataset: Any = open_dataset(plan.targets()[split].uri, None, plan.targets()[split].options)
            dataset.update_schema_metadata(_appended_figures(dataset, schemas[split], read_version), replace=True)
        record_landed(records, split, read_version, versions[split])
    records.mark_committed(versions)
    return Committed(versions, rows, skipped, found=found)


def _commit_split(plan: Plan, split: str, schema: pa.Schema, finished: Mapping[int, ShardRecord]) -> int:
    """One split's fragments as one Lance commit carrying the run's id; the version it made."""
    import lance

    target = plan.targets()[split]
    fragments = [
        lance.FragmentMetadata.from_json(text)
        for index in range(len(plan.shards))
        for text in finished[index].fragments.get(split, [])
    ]
    read_version = plan.read_versions[split]
    if plan.mode == "append" and read_version is not None:
        operation: Any = lance.LanceOperation.Append(fragments)
    else:
        operation = lance.LanceOperation.Overwrite(schema, fragments)
    # Recorded first, so that a rerun after a crash at any point from here knows where to look.
    record_intent(plan.shard_records(), split, read_version)
    transaction = lance.Transaction(read_version or 0, operation, transaction_properties=properties(plan.run_id, split))
    dataset = lance.LanceDataset.commit(target.uri, transaction, storage_options=target.options or None, max_retries=0)
    return int(dataset.version)


def _split_schemas(plan: Plan, records: Iterable[ShardRecord]) -> dict[str, pa.Schema]:
    """Each split's schema: the plan's, with a token split's figures (documents, bytes per token)
    summed over its shards; a token split that fills no sequence is an error before any commit."""
    if plan.tokens is None:
        return dict.fromkeys(plan.targets(), plan.schema)
    records = list(records)
    schemas = {}
    for split in plan.targets():
        rows = sum(record.rows.get(split, 0) for record in records)
        documents = sum(record.documents.get(split, 0) for record in records)
        tokens = sum(record.tokens.get(split, 0) for record in records)
        if not rows:
            raise too_short(split, tokens, documents, plan.tokens.sequence_length, plan.source_text)
        utf8_bytes = sum(record.utf8_bytes.get(split, 0) for record in records)
        schemas[split] = with_split_figures(plan.schema, documents, utf8_bytes, tokens)
    return schemas


def _appended_figures(dataset: Any, added: pa.Schema, read_version: int | None) -> dict[str, str | None]:
    """Metadata of a token dataset after an append: documents summed, bytes per token weighted by rows."""
    before = dataset.checkout_version(read_version).schema.metadata or {}
    after = {key.decode(): value.decode() for key, value in (added.metadata or {}).items()}
    old_rows = dataset.checkout_version(read_version).count_rows()
    new_rows = dataset.count_rows() - old_rows
    key_docs, key_bpt = DOCUMENTS_KEY.decode(), BYTES_PER_TOKEN_KEY.decode()
    after[key_docs] = str(int(before.get(DOCUMENTS_KEY, b"0")) + int(after[key_docs]))
    weighted = float(before.get(BYTES_PER_TOKEN_KEY, b"0")) * old_rows + float(after[key_bpt]) * new_rows
    after[key_bpt] = repr(weighted / max(old_rows + new_rows, 1))
    values: dict[str, str | None] = dict(after)
    return values


def committed_line(plan: Plan, done: Committed) -> str:
    """``committed: URI version N, ...; rows train N, val N; skipped ...`` (or ``already committed``;
    an append says which set grew by how many rows), and what an append left null."""
    where = ", ".join(f"{plan.targets()[split].uri} version {version}" for split, version in done.versions.items())
    state = "already committed" if done.already else "committed"
    return "\n".join([f"{state}: {where}; {_rows(plan, done)}; skipped {describe_skips(done.skipped)}", *unfilled_lines(plan)])


def _rows(plan: Plan, done: Committed) -> str:
    """The rows per split; of an append, the rows each set grew by (a dataset appended to alone may
    be either set, so it is not named)."""
    if plan.mode != "append":
        return "rows " + ", ".join(f"{split} {count:,}" for split, count in done.rows.items())
    if plan.val is None:
        return f"{done.rows.get('train', 0):,} rows appended"
    return f"{done.rows.get('train', 0):,} rows appended to the training set, {done.rows.get('val', 0):,} to the validation set"


def unfilled_lines(plan: Plan) -> list[str]:
    """What an append leaves null: the columns lance_hpc derived that the new rows lack, per dataset,
    grouped by what wrote them."""
    lines = []
    for split, columns in plan.unfilled.items():
        writers: dict[str, list[str]] = {}
        for name, writer in columns.items():
            writers.setdefault(writer, []).append(name)
        which = "; ".join(f"{', '.join(names)} ({writer})" for writer, names in writers.items())
        lines.append(
            f"{plan.targets()[split].uri}: the new rows have no values in {which} until a job with infer.refresh: "
            "missing computes them for those rows only"
        )
    return lines


def describe_skips(skipped: dict[str, int]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())) or "none"
