"""One worker's part of an ingest: each of its shards without a record read once, then recorded.

A shard's rows are split by a hash of each row's key (the sample key, the file's path, or the file
and row), so a row lands in the same split whatever the worker count. Images are checked as they
are read (:mod:`lance_hpc.ingest.image_check`): ``width`` and ``height`` are stored, and an
unreadable, truncated or oversized image is skipped and counted, or fails the ingest with
``on_corrupt: fail``. Text is tokenised and packed into sequences as it is read
(:mod:`lance_hpc.ingest.packing`) when the plan has ``tokens``: the split is then by document. Rows
go straight into the target's data directory (``lance.fragment.write_fragments``: files no reader
sees) a fragment's worth at a time, so memory holds at most one fragment per split.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.image_check import image_size
from lance_hpc.ingest.packing import Packer, rows_batch
from lance_hpc.ingest.plan import Plan
from lance_hpc.ingest.reading import Reading
from lance_hpc.ingest.records import ShardRecord
from lance_hpc.ingest.shard_batches import document_texts, mapped_batches, text_batches
from lance_hpc.ingest.shards import Shard, Source, split_of


def _checked(
    batch: pa.RecordBatch, on_corrupt: str, max_pixels: int, shard: Shard, source: Source
) -> tuple[pa.RecordBatch, dict[str, int]]:
    """Image rows checked: width and height added, unusable images dropped (counted by reason)."""
    if "image" not in batch.schema.names:
        return batch, {}
    keep: list[int] = []
    widths: list[int] = []
    heights: list[int] = []
    skipped: dict[str, int] = {}
    keys = batch.column("key").to_pylist() if "key" in batch.schema.names else [None] * batch.num_rows
    for index, data in enumerate(batch.column("image").to_pylist()):
        found = image_size(data, max_pixels)
        if isinstance(found, str):
            if on_corrupt == "fail":
                raise UserError(
                    f"{source.where(shard)}: image {keys[index] or index} is {found}\n"
                    "  fix: remove it from the source, or ingest with on_corrupt: skip to leave such images out"
                )
            skipped[found] = skipped.get(found, 0) + 1
            continue
        keep.append(index)
        widths.append(found[0])
        heights.append(found[1])
    kept = batch.take(pa.array(keep, pa.int64())) if len(keep) < batch.num_rows else batch
    # measured from the image itself: these replace a source's own width and height fields
    kept = kept.drop_columns([name for name in ("width", "height") if name in kept.schema.names])
    kept = kept.append_column("width", pa.array(widths, pa.int32())).append_column("height", pa.array(heights, pa.int32()))
    return kept, skipped


@dataclass
class WorkerReport:
    done: list[int] = field(default_factory=list)  # shards written by this run of the worker
    already: list[int] = field(default_factory=list)  # shards a previous run had recorded
    stopped: bool = False


def write_shard(plan: Plan, index: int) -> ShardRecord:
    """The shard's rows as new fragments of each split (not yet part of any dataset version).

    One pass over the shard: each split's rows gather until a fragment's worth
    (``rows_per_fragment``), which is written at once, so memory holds at most one fragment per
    split whatever the shard's size."""
    if plan.tokens is not None:
        return _write_token_shard(plan, index)
    shard = plan.shards[index]
    started = time.monotonic()
    skipped: dict[str, int] = {}
    rows = {split: 0 for split in plan.targets()}
    pending: dict[str, list[pa.RecordBatch]] = {split: [] for split in plan.targets()}
    fragments: dict[str, list[str]] = {split: [] for split in plan.targets()}
    where = plan.source.where(shard)
    reading = Reading(plan.on_corrupt)
    for batch in mapped_batches(plan.source, shard, plan.columns, reading):
        checked, dropped = _checked(batch, plan.on_corrupt, plan.max_pixels, shard, plan.source)
        for reason, count in dropped.items():
            skipped[reason] = skipped.get(reason, 0) + count
        keys = checked.column("key").to_pylist() if plan.val is not None else []
        if None in keys:
            raise UserError(
                f"{where}: a row has no key, which the validation split is drawn from\n"
                "  fix: map columns.key to a field every row has, or leave it out to key rows by file and row"
            )
        for split in plan.targets():
            part = checked
            if plan.val is not None:
                part = checked.filter(pa.array([split_of(key, plan.val_fraction) == split for key in keys]))
            if not part.num_rows:
                continue
            rows[split] += part.num_rows
            pending[split].append(_conformed(part, plan.schema, where))
            if sum(item.num_rows for item in pending[split]) >= plan.rows_per_fragment:
                pending[split] = _write_full(plan, split, pending[split], fragments[split])
    for split, left in pending.items():
        if left:
            _write_fragment(plan, split, pa.Table.from_batches(left, plan.schema), fragments[split])
    for reason, count in reading.skipped.items():
        skipped[reason] = skipped.get(reason, 0) + count
    return ShardRecord(shard.id, fragments, rows, skipped, shard.bytes, time.monotonic() - started)


def _write_token_shard(plan: Plan, index: int) -> ShardRecord:
    """The shard's documents tokenised, split by document key and packed into rows; a fragment is
    written whenever a split has a fragment's worth, so memory holds at most one per split."""
    assert plan.tokens is not None
    shard = plan.shards[index]
    started = time.monotonic()
    packers = {split: Packer(plan.tokenizer, plan.tokens.sequence_length) for split in plan.targets()}
    fragments: dict[str, list[str]] = {split: [] for split in plan.targets()}
    rows = dict.fromkeys(plan.targets(), 0)
    reading = Reading(plan.on_corrupt)
    for key, text in document_texts(text_batches(plan.source, shard, plan.columns, reading)):
        split = split_of(key, plan.val_fraction) if plan.val is not None else "train"
        packer = packers[split]
        try:
            packer.add(text)
        except UserError:
            raise
        except Exception as error:  # the tokenizer may be the user's code
            raise UserError(
                f"{plan.source.where(shard)}: tokenizer {plan.tokens.tokenizer!r} failed on document {key!r}: "
                f"{type(error).__name__}: {error}\n  fix: mend the tokenizer or the document; nothing was committed, and "
                "a rerun goes on from the shards already written"
            ) from None
        while packer.ready() >= plan.rows_per_fragment:
            rows[split] += _write_rows(plan, split, packer.take(plan.rows_per_fragment), fragments[split])
    for split, packer in packers.items():
        if packer.ready():
            rows[split] += _write_rows(plan, split, packer.take(packer.ready()), fragments[split])
    return ShardRecord(
        shard.id,
        fragments,
        rows,
        reading.skipped,
        bytes=shard.bytes,
        seconds=time.monotonic() - started,
        documents={split: packer.documents for split, packer in packers.items()},
        utf8_bytes={split: packer.utf8_bytes for split, packer in packers.items()},
        tokens={split: packer.tokens for split, packer in packers.items()},
    )


def _write_rows(plan: Plan, split: str, rows: Any, into: list[str]) -> int:
    _write_fragment(plan, split, pa.Table.from_batches([rows_batch(rows, plan.schema)]), into)
    return len(rows)


def _write_full(plan: Plan, split: str, batches: list[pa.RecordBatch], into: list[str]) -> list[pa.RecordBatch]:
    """Write every whole fragment's worth of ``batches``; return the rows left over."""
    table = pa.Table.from_batches(batches, plan.schema)
    whole = table.num_rows - table.num_rows % plan.rows_per_fragment
    for start in range(0, whole, plan.rows_per_fragment):
        _write_fragment(plan, split, table.slice(start, plan.rows_per_fragment), into)
    return table.slice(whole).to_batches()


def _write_fragment(plan: Plan, split: str, table: pa.Table, into: list[str]) -> None:
    import lance

    target = plan.targets()[split]
    written = lance.fragment.write_fragments(
        table,
        target.uri,
        schema=plan.schema,
        # Only the fragments' files, checked as the commit will be: a new dataset, new rows, or a new version.
        mode="create" if plan.read_versions[split] is None else "overwrite" if plan.mode == "overwrite" else "append",
        max_rows_per_file=plan.rows_per_fragment,
        storage_options=target.options or None,
    )
    into.extend(json.dumps(metadata.to_json()) for metadata in written if metadata.num_rows)


def _conformed(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """``batch`` with the plan's columns in order (missing ones null), each of the plan's type."""
    arrays = []
    names = set(batch.schema.names)  # once: a sample may have many fields
    for item in schema:
        if item.name in names:
            column = batch.column(item.name)
            if column.type != item.type:
                try:
                    column = column.cast(item.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    raise UserError(
                        f"{where}: field {item.name!r} is {column.type} here but {item.type} in the first shard\n"
                        "  fix: make the field's type the same in every file of the source"
                    ) from None
            arrays.append(column)
        else:
            arrays.append(pa.nulls(batch.num_rows, item.type))
    extra = names - set(schema.names)
    if extra:
        raise UserError(
            f"{where}: fields {', '.join(sorted(extra))} are not in the first shard\n"
            "  fix: give every file of the source the same fields"
        )
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def run_worker(
    plan: Plan,
    rank: int,
    world_size: int,
    *,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[ShardRecord], None] = lambda record: None,
) -> WorkerReport:
    """This worker's shards that have no record yet, one at a time; ``stop()`` is asked between shards."""
    records = plan.shard_records()
    finished = records.finished()
    report = WorkerReport()
    for index in plan.assignment(world_size)[rank]:
        if index in finished:
            report.already.append(index)
            continue
        if stop():
            report.stopped = True
            break
        record = write_shard(plan, index)
        records.write(index, record)
        report.done.append(index)
        progress(record)
    return report
