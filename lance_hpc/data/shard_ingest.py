"""Ingest as a job of many workers: each writes Lance fragments for its shards, one commit at the end.

The plan: the source's shards (:mod:`lance_hpc.data.shards`) in a stable order, split between the
workers by size (the biggest shard first, to the worker with the least so far), and a run id that
names this ingest (source, shards, columns, split, targets). Each worker writes its shards' rows
straight into the target's data directory (``lance.fragment.write_fragments``: files no reader
sees) and records each finished shard beside the target, in ``.<name>.ingest/<run id>/``: the
fragments it wrote, its rows, what it skipped and why. A rerun redoes only the shards without a
record. The commit takes every shard's fragments once, in the plan's order, as one Lance commit per
dataset (a new dataset; a new version with ``overwrite``; more rows with ``append``): the dataset
appears whole or not at all, and its rows are in the same order whatever the number of workers or
interruptions. Each split's commit carries the run id and is recorded as it lands
(:mod:`lance_hpc.data.ingest_commits`): a rerun after a crash between the commits commits only what
is missing, and records that name what the datasets no longer hold make the run start over.

The validation split is by a hash of each row's key (the sample key, the file's path, or the file
and row), so a row lands in the same split whatever the worker count. Images are checked as they
are read (:mod:`lance_hpc.data.image_check`): ``width`` and ``height`` are stored, and an unreadable,
truncated or oversized image is skipped and counted, or fails the ingest with ``on_corrupt: fail``.
Text is tokenised and packed into sequences as it is read (:mod:`lance_hpc.data.packing`) when the
plan has ``tokens``: the split is then by document, and the figures of the split (documents, bytes
per token) are combined from the shard records at the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.fs as pafs

from lance_hpc.data.image_check import ENCODED_BYTES, MAX_PIXELS, image_size
from lance_hpc.data.ingest_commits import (
    COMMITTED_FILE,
    landed_splits,
    properties,
    read_version_of,
    record_intent,
    record_landed,
    stale_records,
    start_over,
)
from lance_hpc.data.packing import (
    Packer,
    Tokens,
    rows_batch,
    token_schema,
    too_short,
    with_split_figures,
)
from lance_hpc.data.reading import Reading
from lance_hpc.data.shards import (
    FILES_PER_SHARD,
    ColumnMap,
    Shard,
    Source,
    class_names,
    document_texts,
    format_defaults,
    list_shards,
    mapped_batches,
    parse_source,
    plan_reading,
    row_keys,
    split_of,
    text_batches,
)
from lance_hpc.data.target import (
    CLASS_NAMES_KEY,
    COMMAND_LINE_NAMES,
    SPEC_NAMES,
    Target,
    existing_dataset,
    filesystem,
    targets,
)
from lance_hpc.data.text import BYTES_PER_TOKEN_KEY, DOCUMENTS_KEY, KIND_KEY, Tokenizer, load_tokenizer
from lance_hpc.data.units import UnitRecords, balanced
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.imports import child_environment, python_command
from lance_hpc.lineage.provenance import derived_columns
from lance_hpc.spec.limits import DEFAULT_RECORD_MB
from lance_hpc.storage.datasets import dataset_exists, open_dataset
from lance_hpc.storage.options import storage_options

MODES = ("create", "append", "overwrite")
# Seconds between progress lines of a local run with several workers.
PROGRESS_S = 2.0
# Bytes of the first shard read to estimate an ingest's rows before it runs.
SAMPLE_BYTES = 1 << 20


@dataclass
class ShardRecord:
    """What one worker wrote for one shard: the fragments of each split (Lance's JSON), rows, skips."""

    shard: str
    fragments: dict[str, list[str]]
    rows: dict[str, int]
    skipped: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    # token sequences: per split, the documents, their UTF-8 bytes and their tokens (EOD included)
    documents: dict[str, int] = field(default_factory=dict)
    utf8_bytes: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    source_text: str
    source: Source
    shards: list[Shard]
    columns: ColumnMap
    train: Target
    val: Target | None
    val_fraction: float
    rows_per_fragment: int
    mode: str
    on_corrupt: str
    max_pixels: int
    schema: pa.Schema
    run_id: str
    read_versions: dict[str, int | None]
    tokens: Tokens | None = None
    _tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    # splits whose commit by this run (an earlier process of it) the datasets hold: split -> version
    landed: dict[str, int] = field(default_factory=dict)
    # append: per split, the columns lance_hpc derived (inference write-back) the new rows lack: null
    unfilled: dict[str, list[str]] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of a token plan, loaded once per process."""
        assert self.tokens is not None
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokens.tokenizer)
        return self._tokenizer

    def targets(self) -> dict[str, Target]:
        return {"train": self.train, **({"val": self.val} if self.val is not None else {})}

    @property
    def complete(self) -> bool:
        """Whether every split's commit has landed: nothing is left to write."""
        return set(self.landed) == set(self.targets())

    def assignment(self, world_size: int) -> list[list[int]]:
        """Shard indices per worker, balanced by bytes (:func:`~lance_hpc.data.units.balanced`)."""
        return balanced([shard.bytes for shard in self.shards], world_size)

    @property
    def records(self) -> str:
        """Where finished shards are recorded: a hidden folder beside the training dataset."""
        return f"{records_root(self.train.uri)}/{self.run_id}"


def make_plan(
    source_text: str,
    train: Target,
    val: Target | None,
    *,
    columns: ColumnMap | None = None,
    val_fraction: float = 0.0,
    rows_per_fragment: int = 1024,
    mode: str = "create",
    on_corrupt: str = "skip",
    max_pixels: int = MAX_PIXELS,
    check_targets: bool = True,
    source_options: Mapping[str, str] | None = None,
    tokens: Tokens | None = None,
    files_per_shard: int = FILES_PER_SHARD,
    max_record_mb: int = DEFAULT_RECORD_MB,
) -> Plan:
    """The same plan on every worker: shards listed, the schema read from the first shard (or made
    by the tokenizer), targets checked (nothing that is not a Lance dataset is ever written into)."""
    if mode not in MODES:
        raise UserError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    if val is None and val_fraction > 0:
        raise UserError(f"a validation fraction of {val_fraction} needs a validation dataset (--val-uri / data.val_uri)")
    columns = columns or ColumnMap()
    if val is not None and columns.key == "":
        raise UserError("a validation split is drawn by each row's key: with a validation dataset, do not map key to ''")
    train, val = _absolute(train), _absolute(val) if val is not None else None
    source = parse_source(source_text, source_options, files_per_shard=files_per_shard, max_record_bytes=max_record_mb << 20)
    shards = list_shards(source)
    identity = json.dumps(
        {
            "source": source_text,
            "shards": [[shard.id, shard.bytes] for shard in shards],
            "columns": asdict(columns),
            "target": train.uri,
            "val": [val.uri if val else None, val_fraction],
            "mode": mode,
            "rows_per_fragment": rows_per_fragment,
            **({"tokens": asdict(tokens)} if tokens is not None else {}),
        },
        sort_keys=True,
    )
    # Not the datasets' versions: the commit changes them, and a rerun must find its own records.
    run_id = hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
    splits = {"train": train, **({"val": val} if val else {})}
    # Read from the datasets, not the records alone: a record of a deleted dataset does not count.
    ours = landed_splits(Records(f"{records_root(train.uri)}/{run_id}", train.options), splits, run_id)
    tokenizer = load_tokenizer(tokens.tokenizer) if tokens is not None else None
    if tokens is not None and tokenizer is not None:
        # a source without text fails here, not in the workers
        next(text_batches(source, shards[0], columns, plan_reading(columns, "skip")), None)
        schema = token_schema(tokenizer, tokens.sequence_length, source_text)
    else:
        schema = _schema(source, shards[0], columns)
    read_versions: dict[str, int | None] = {}
    unfilled: dict[str, list[str]] = {}
    for split, target in splits.items():
        # A UserError for anything but a Lance dataset; a worker trusts the check of the command
        # that started it (other workers' fragments may be landing in the folder meanwhile).
        found = existing_dataset(target) if check_targets else _dataset_or_none(target)
        if split in ours:  # this ingest's own commit, made by an earlier run of it
            read_versions[split] = int(found.version) if found is not None else None
            continue
        if found is not None and mode == "create" and not check_targets:
            # a worker: the command that started it checked the target; a dataset there now is this
            # ingest's own commit landing (rank 0 finished first), and the records say what is left
            found = None
        if found is not None and mode == "create":
            raise UserError(
                f"{target.name} {target.uri} already holds a Lance dataset\n"
                f"  fix: --append to add these rows as a new version, --overwrite to make them the new version "
                "(the earlier versions stay), or point it at a new path"
            )
        read_versions[split] = int(found.version) if found is not None else None
        if found is not None and mode == "append":
            unfilled[split] = _check_append_schema(found, schema, target)
    return Plan(
        source_text,
        source,
        shards,
        columns,
        train,
        val,
        val_fraction,
        rows_per_fragment,
        mode,
        on_corrupt,
        max_pixels,
        schema,
        run_id,
        read_versions,
        tokens,
        tokenizer,
        ours,
        {split: names for split, names in unfilled.items() if names},
    )


def tokens_of(source_text: str, tokenize: bool | None, tokenizer: str, sequence_length: int) -> Tokens | None:
    """A text corpus (``text:``, ``python-stdlib``) is tokenised unless ``tokenize`` is false (then
    its documents are rows); any other source only when ``tokenize`` is true."""
    is_corpus = source_text.startswith("text:") or source_text.partition(":")[0] == "python-stdlib"
    if tokenize or (tokenize is None and is_corpus):
        if sequence_length < 1:
            raise UserError(f"sequence_length {sequence_length}: give 1 or more tokens per sequence")
        return Tokens(tokenizer, sequence_length)
    return None


def plan_for_data(data: Any, *, check_targets: bool = True, overwrite: bool = False) -> Plan:
    """The plan of a spec's ``data`` section: its ``ingest`` source into ``uri`` / ``val_uri``."""
    ingest = data.ingest
    if ingest is None:
        raise UserError("data.ingest is not set: there is no source to ingest")
    train, val = targets(
        data.uri,
        data.val_uri,
        storage_options(data.uri, data.storage_options),
        storage_options(data.val_uri, data.storage_options) if data.val_uri else None,
        SPEC_NAMES,
    )
    return make_plan(
        ingest.source,
        train,
        val,
        columns=ColumnMap(**ingest.columns),
        val_fraction=ingest.val_fraction if val is not None else 0.0,
        rows_per_fragment=ingest.rows_per_fragment,
        mode="append" if ingest.append else "overwrite" if ingest.overwrite or overwrite else "create",
        on_corrupt=ingest.on_corrupt,
        max_pixels=ingest.max_pixels,
        check_targets=check_targets,
        source_options=source_options(ingest.source, data.storage_options),
        tokens=tokens_of(ingest.source, ingest.tokenize, ingest.tokenizer, ingest.sequence_length),
        files_per_shard=ingest.files_per_shard,
        max_record_mb=ingest.max_record_mb,
    )


def source_options(source_text: str, spec_options: Mapping[str, str] | None) -> dict[str, str]:
    """Storage options for an object-store source, from its own URI (region, endpoint and
    credentials from the spec and the AWS_* variables), not from the target's."""
    pattern = source_text.partition(":")[2]
    return storage_options(pattern, spec_options) if "://" in pattern else {}


def ingest_here(data: Any, *, overwrite: bool = False) -> tuple[int, int]:
    """A spec's shard source ingested by this process alone (a training job's start); (train, val) rows."""
    plan = plan_for_data(data, overwrite=overwrite)
    for line in resume_lines(plan):
        print(line, flush=True)
    if not plan.complete:
        run_worker(plan, 0, 1)
    done = commit(plan)
    return done.rows.get("train", 0), done.rows.get("val", 0)


def _absolute(target: Target) -> Target:
    """A local target as an absolute path: records and file systems need one."""
    if "://" in target.uri:
        return target
    return Target(os.path.abspath(target.uri), target.options, target.name)


def _check_append_schema(found: Any, ours: pa.Schema, target: Target) -> list[str]:
    """Rows appended must have the dataset's columns and types (and token sequences, its tokenizer):
    one clear error before any shard. The columns lance_hpc derived from the rows (an inference's
    write-back) are not the source's: rows without them are appended with nulls there, which a job
    with ``infer.refresh: missing`` fills. Returns those columns."""
    derived = [name for name in derived_columns(found.schema) if name not in ours.names]
    theirs = {item.name: item.type for item in found.schema if item.name not in derived}
    mine = {item.name: item.type for item in ours}
    if KIND_KEY in (ours.metadata or {}):
        shared = [key for key in (ours.metadata or {}) if key != b"source"]
        differ = [key.decode() for key in shared if (found.schema.metadata or {}).get(key) != ours.metadata[key]]
        if differ:
            raise UserError(
                f"{target.name} {target.uri}: its token sequences differ from these in {', '.join(differ)}, so these "
                "cannot be appended\n  fix: ingest with the dataset's tokenizer and sequence_length, or --overwrite"
            )
    if mine != theirs:
        differ = sorted(name for name in set(mine) | set(theirs) if mine.get(name) != theirs.get(name))
        raise UserError(
            f"{target.name} {target.uri}: these rows do not have the dataset's columns ({', '.join(differ)} differ), "
            "so they cannot be appended\n  fix: map the source's fields to the dataset's columns (--column / "
            "data.ingest.columns)"
        )
    return derived


def unfilled_lines(plan: Plan) -> list[str]:
    """What an append leaves null: the columns lance_hpc derived that the new rows lack, per dataset."""
    return [
        f"{plan.targets()[split].uri}: the new rows have no values in {', '.join(names)} (columns an inference job "
        "wrote) until a job with infer.refresh: missing computes them for those rows only"
        for split, names in plan.unfilled.items()
    ]


def _dataset_or_none(target: Target) -> Any | None:
    return open_dataset(target.uri, None, target.options) if dataset_exists(target.uri, target.options) else None


def _schema(source: Source, shard: Shard, columns: ColumnMap) -> pa.Schema:
    """The columns of the first batch of the first shard, read without its images (their column is
    binary whatever they hold): with ``width`` and ``height`` as :func:`_checked` measures them."""
    for batch in mapped_batches(source, shard, columns, plan_reading(columns, "skip")):
        measured = [pa.field("width", pa.int32()), pa.field("height", pa.int32())] if "image" in batch.schema.names else []
        fields = [
            pa.field(item.name, pa.string() if pa.types.is_null(item.type) else item.type, metadata=ENCODED_BYTES)
            if item.name == "image"
            else pa.field(item.name, pa.string() if pa.types.is_null(item.type) else item.type)
            for item in batch.schema
            if not (measured and item.name in ("width", "height"))
        ] + measured
        metadata = {b"source": source.format.encode()}
        label_field = columns.label if columns.label is not None else format_defaults(shard.format, [])["label"]
        names = class_names(source, label_field) if label_field else None
        if names:  # what image_classification reads its class names from
            metadata[CLASS_NAMES_KEY] = json.dumps(names).encode()
        return pa.schema(fields, metadata=metadata)
    raise UserError(f"{source.uri(shard.path)} holds no record: the schema is read from the first shard")


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
                    f"{source.uri(shard.path)}: image {keys[index] or index} is {found}\n"
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


# ---- records ------------------------------------------------------------------------------------


class Records(UnitRecords[ShardRecord]):
    """The finished shards of one plan, one small JSON file each, beside the training dataset."""

    def __init__(self, uri: str, options: Mapping[str, str]) -> None:
        super().__init__(uri, options, "shard", ShardRecord)

    @classmethod
    def of(cls, plan: Plan) -> Records:
        return cls(plan.records, plan.train.options)

    def committed(self) -> dict[str, int] | None:
        """The versions recorded once every split was committed, as recorded (not checked against
        the datasets: :func:`resume_lines` does that before a run writes anything)."""
        found = self.read_json(COMMITTED_FILE)
        return dict(found) if found is not None else None

    def mark_committed(self, versions: dict[str, int]) -> None:
        self.write_json(COMMITTED_FILE, versions)


def stale_parts(plan: Plan) -> list[str]:
    """What this run's records name that the datasets no longer hold (none: every record counts)."""
    records = Records.of(plan)
    finished = records.finished()  # before the files are listed: a record is written after its files
    fragments = {
        split: [text for record in finished.values() for text in record.fragments.get(split, [])] for split in plan.targets()
    }
    return stale_records(records, plan.targets(), plan.run_id, fragments)


def resume_lines(plan: Plan) -> list[str]:
    """Before a run writes anything, in the one process that starts it: records naming what the
    datasets no longer hold are discarded (the run starts over, the splits still committed kept),
    and a line says so, or says which commits of an earlier run of this ingest were found."""
    records = Records.of(plan)
    stale = stale_parts(plan)
    if stale:
        dropped = start_over(records, keep=plan.landed)
        return [
            f"starting over: an earlier run of this ingest recorded {'; '.join(stale)} (deleted or rewritten since); "
            f"its {dropped} shard record(s) are discarded and every shard is written again"
        ]
    if not plan.landed or records.committed() == plan.landed:
        return []
    order = sorted(plan.targets(), key=lambda name: name != "val")  # the order of the commits
    found = ", ".join(
        f"{split} ({plan.targets()[split].uri} version {plan.landed[split]})" for split in order if split in plan.landed
    )
    left = [split for split in order if split not in plan.landed]
    rest = f"committing {', '.join(left)}" if left else "recording the ingest as committed"
    return [f"found the commits of an earlier run of this ingest that stopped before the rest: {found}; {rest}"]


# ---- one worker ---------------------------------------------------------------------------------


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
    where = plan.source.uri(shard.path)
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
                f"{plan.source.uri(shard.path)}: tokenizer {plan.tokens.tokenizer!r} failed on document {key!r}: "
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
    records = Records.of(plan)
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


# ---- the commit ---------------------------------------------------------------------------------


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
    records = Records.of(plan)
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
    record_intent(Records.of(plan), split, read_version)
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


def estimate_rows(plan: Plan) -> dict[str, int]:
    """Rows per split an ingest will write, before it runs (the dry run's plan): the first shard read
    up to :data:`SAMPLE_BYTES` (its rows split by key, token plans' text tokenised), scaled by the
    bytes of the whole source. Never a pass over the source."""
    shard, total = plan.shards[0], sum(item.bytes for item in plan.shards)
    sample: list[pa.RecordBatch] = []
    consumed, whole = 0, True
    reading = plan_reading(plan.columns, plan.on_corrupt)  # images passed over: counted, not held
    for batch in mapped_batches(plan.source, shard, plan.columns, reading):
        sample.append(batch)
        consumed += batch.nbytes
        if consumed + reading.unread >= SAMPLE_BYTES:
            whole = False
            break
    consumed += reading.unread
    if whole and shard.bytes:
        consumed = shard.bytes  # the whole shard was read: its size on the store is exact
    scale = total / max(consumed, 1)
    counts = dict.fromkeys(plan.targets(), 0)
    for key, text in document_texts(sample) if plan.tokens is not None else _sample_keys(sample):
        split = split_of(key, plan.val_fraction) if plan.val is not None else "train"
        counts[split] += len(plan.tokenizer.encode(text)) + 1 if plan.tokens is not None and text else 1
    per_row = plan.tokens.sequence_length if plan.tokens is not None else 1
    return {split: int(count * scale / per_row) for split, count in counts.items()}


def estimate_line(plan: Plan) -> str:
    rows = estimate_rows(plan)
    return "rows, estimated from the first shard: " + ", ".join(f"{split} about {count:,}" for split, count in rows.items())


def _sample_keys(batches: list[pa.RecordBatch]) -> Iterable[tuple[str, str]]:
    for batch in batches:
        yield from ((key, "") for key in row_keys(batch))


def shard_summary(plan: Plan, world_size: int) -> list[str]:
    """The dry run's view: shards, bytes, and each worker's share."""
    lines = [f"{len(plan.shards)} shards of {plan.source_text}, {sum(s.bytes for s in plan.shards) / 2**20:,.1f} MiB"]
    for rank, indices in enumerate(plan.assignment(world_size)):
        size = sum(plan.shards[index].bytes for index in indices) / 2**20
        lines.append(f"  worker {rank}: {len(indices)} shards, {size:,.1f} MiB")
    return lines


def committed_line(plan: Plan, done: Committed) -> str:
    """``committed: URI version N, ...; rows train N, val N; skipped ...`` (or ``already committed``),
    and what an append left null."""
    where = ", ".join(f"{plan.targets()[split].uri} version {version}" for split, version in done.versions.items())
    rows = ", ".join(f"{split} {count:,}" for split, count in done.rows.items())
    state = "already committed" if done.already else "committed"
    return "\n".join([f"{state}: {where}; rows {rows}; skipped {describe_skips(done.skipped)}", *unfilled_lines(plan)])


def describe_skips(skipped: dict[str, int]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())) or "none"


__all__: Sequence[str] = (
    "ColumnMap",
    "Committed",
    "Plan",
    "ShardRecord",
    "commit",
    "make_plan",
    "totals",
    "run_worker",
    "shard_summary",
    "split_of",
)


# ---- the command line ---------------------------------------------------------------------------


def _column_map(pairs: Sequence[str]) -> ColumnMap:
    chosen: dict[str, str] = {}
    for pair in pairs:
        name, sep, source_field = pair.partition("=")
        if not sep or name not in ("image", "label", "text", "key"):
            raise UserError(f"--column {pair!r}: give NAME=FIELD with NAME one of image, label, text, key")
        chosen[name] = source_field
    return ColumnMap(**chosen)


def ingest_shards_command(args: Any, argv: list[str]) -> int:
    """``lance-hpc ingest parquet:... URI [--nproc N]``: plan, the workers (this process for one,
    else N processes), then the commit, with a summary."""

    try:
        spec_options = dict(option.split("=", 1) for option in args.storage_option if "=" in option)
        train, val = targets(
            args.uri,
            args.val_uri,
            storage_options(args.uri, spec_options),
            storage_options(args.val_uri, spec_options) if args.val_uri else None,
            COMMAND_LINE_NAMES,
        )
        if args.append and args.overwrite:
            raise UserError("--append and --overwrite: give one (append adds rows; overwrite replaces them in a new version)")
        if args.nproc < 1:
            raise UserError(f"--nproc {args.nproc}: give 1 or more workers")
        plan = make_plan(
            args.source,
            train,
            val,
            columns=_column_map(args.column),
            val_fraction=args.val_fraction if val is not None else 0.0,
            rows_per_fragment=args.rows_per_fragment,
            mode="append" if args.append else "overwrite" if args.overwrite else "create",
            on_corrupt=args.on_corrupt,
            max_pixels=args.max_pixels,
            check_targets=not args.worker,
            source_options=source_options(args.source, spec_options),
            tokens=tokens_of(args.source, args.tokenize, args.tokenizer, args.sequence_length),
            files_per_shard=args.files_per_shard,
            max_record_mb=args.max_record_mb,
        )
        if args.worker:
            rank, _, world = args.worker.partition("/")
            run_worker(plan, int(rank), int(world))
            return 0
        if args.dry_run:
            print("\n".join(shard_summary(plan, args.nproc)))
            print(f"schema: {', '.join(f'{item.name} ({item.type})' for item in plan.schema)}")
            print("\n".join([estimate_line(plan), *unfilled_lines(plan)]))
            return 0
        for line in resume_lines(plan):
            print(line, flush=True)
        records = Records.of(plan)
        if not plan.complete:
            before = len(records.finished())
            if before:
                print(f"resuming: {before} of {len(plan.shards)} shards were written by an earlier run", flush=True)
            if args.nproc == 1:
                run_worker(plan, 0, 1, progress=_shower(records, plan))
            else:
                quiet = {**os.environ, "LANCE_LOG": os.environ.get("LANCE_LOG", "error")}  # not one warning per new fragment
                workers = [
                    subprocess.Popen(
                        python_command("-m", "lance_hpc.ingest", *argv, "--worker", f"{rank}/{args.nproc}"),
                        env=child_environment(quiet),  # without the working directory on sys.path
                    )
                    for rank in range(args.nproc)
                ]
                _wait_for(workers, records, plan)
        done = commit(plan)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(committed_line(plan, done))
    return 0


def _shower(records: Records, plan: Plan) -> Callable[[ShardRecord], None]:
    """A progress line per shard written: shards done (of all), rows so far, rate."""
    finished, rows, started = len(records.finished()), [0], time.monotonic()

    def show(record: ShardRecord) -> None:
        nonlocal finished
        finished += 1
        rows[0] += sum(record.rows.values())
        rate = rows[0] / max(time.monotonic() - started, 1e-9)
        print(f"shard {finished}/{len(plan.shards)}: {record.shard} ({rows[0]:,} rows, {rate:,.0f} rows/s)", flush=True)

    return show


def _wait_for(workers: list[Any], records: Records, plan: Plan) -> None:
    """Wait for the worker processes, showing shards and rows written, the rate and the time left;
    a failed worker fails the ingest (what the others recorded stays for the rerun)."""
    known = records.finished()
    earlier, started, shown, printed_at = set(known), time.monotonic(), -1, 0.0
    total_bytes = sum(shard.bytes for shard in plan.shards)
    while True:
        codes = [worker.poll() for worker in workers]
        known = records.finished(known)
        # a line when shards were written, at most every PROGRESS_S (and the last one)
        if len(known) != shown and (time.monotonic() - printed_at >= PROGRESS_S or len(known) == len(plan.shards)):
            shown, printed_at = len(known), time.monotonic()
            rows = sum(sum(record.rows.values()) for record in known.values())
            line = f"{shown}/{len(plan.shards)} shards written, {rows:,} rows"
            written_now = sum(record.bytes for index, record in known.items() if index not in earlier)
            if written_now:
                rate = written_now / max(time.monotonic() - started, 1e-9)
                left = total_bytes - sum(record.bytes for record in known.values())
                line += f", {rate / 2**20:,.1f} MiB/s, about {left / rate:,.0f} s left"
            print(line, flush=True)
        if all(code is not None for code in codes):
            break
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            for worker in workers:
                if worker.poll() is None:
                    worker.terminate()
            for worker in workers:
                worker.wait()
            break
        time.sleep(0.1)
    failed = [rank for rank, worker in enumerate(workers) if worker.returncode != 0]
    if failed:
        raise UserError(
            f"worker {failed[0]} failed (its error is above); the shards written so far are kept\n"
            "  fix: mend the cause and run the same command again: it writes only the missing shards"
        )


# ---- progress, for lance-hpc status -------------------------------------------------------------


def records_root(train_uri: str) -> str:
    parent, _, name = train_uri.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.ingest" if parent else f".{name}.ingest"


def progress_lines(source_text: str, train: Target, world_size: int, files_per_shard: int = FILES_PER_SHARD) -> list[str]:
    """How far the latest ingest into ``train`` got, from its shard records (no SLURM, no plan)."""
    store, root = filesystem(records_root(train.uri), train.options)
    try:
        runs = [
            info
            for info in store.get_file_info(pafs.FileSelector(root, allow_not_found=True))
            if info.type == pafs.FileType.Directory
        ]
    except OSError as error:
        return [f"cannot read the shard records under {records_root(train.uri)}: {error}"]
    if not runs:
        return ["no shard written yet"]
    latest = max(runs, key=lambda info: info.mtime_ns or 0)
    records = Records(f"{records_root(train.uri)}/{latest.base_name}", train.options)
    found = list(records.finished().values())
    committed = records.committed()
    try:
        shards = list_shards(parse_source(source_text, source_options(source_text, None), files_per_shard=files_per_shard))
    except UserError:
        shards = []
    total = len(shards) or None
    rows, skipped = totals(found, ("train", "val"))
    written = f"{len(found)} of {total} shards" if total else f"{len(found)} shards"
    rows_text = ", ".join(f"{split} {count:,}" for split, count in rows.items() if count or split == "train")
    lines = [f"{written} written ({rows_text} rows; skipped {describe_skips(skipped)})"]
    if committed is not None:
        lines.append("committed: " + ", ".join(f"{split} version {version}" for split, version in committed.items()))
    elif total and len(found) < total:
        seconds = sum(record.seconds for record in found)
        done_bytes = sum(record.bytes for record in found)
        if seconds > 0 and done_bytes > 0:
            per_rank = done_bytes / seconds
            names = {record.shard for record in found}
            left = sum(shard.bytes for shard in shards if shard.id not in names)
            eta = left / (per_rank * max(world_size, 1))
            lines.append(
                f"about {eta / 60:.0f} min left: {left / 2**20:,.0f} MiB to go at {per_rank / 2**20:,.1f} MiB/s per rank "
                f"over {world_size} rank(s)"
            )
    return lines
