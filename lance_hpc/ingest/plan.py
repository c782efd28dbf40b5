"""The plan of an ingest of a sharded source, the same on every worker that makes it: the source's
shards (:mod:`lance_hpc.ingest.shards`) in a stable order, split between the workers by size (the
biggest shard first, to the worker with the least so far), the schema read from the first shard (or
made by the tokenizer), the targets checked (nothing that is not a Lance dataset is ever written
into), and a run id that names this ingest (source, shards, columns, split, targets), under which
its records live (:mod:`lance_hpc.ingest.records`). Before a run of the plan writes anything, its
records are held against the datasets (:func:`resume_lines`). Also the rows a plan will write,
estimated before it runs from a sample of its first shard.

The rest of the ingest: each worker writes its shards (:mod:`lance_hpc.ingest.write`), one commit
takes them all (:mod:`lance_hpc.ingest.commit`), run here (:mod:`lance_hpc.ingest.local`) or as a
job of many ranks (:mod:`lance_hpc.ingest.job`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats import FILES_PER_SHARD, format_class
from lance_hpc.ingest.image_check import ENCODED_BYTES, MAX_PIXELS
from lance_hpc.ingest.packing import Tokens, token_schema
from lance_hpc.ingest.records import Records, records_root
from lance_hpc.ingest.rerun import landed_splits, stale_records, start_over
from lance_hpc.ingest.shard_batches import ColumnMap, document_texts, mapped_batches, plan_reading, row_keys, text_batches
from lance_hpc.ingest.shards import Shard, Source, list_shards, parse_source, split_of
from lance_hpc.ingest.target import SPEC_NAMES, Target, existing_dataset, targets
from lance_hpc.ingest.tokenizer import Tokenizer, load_tokenizer
from lance_hpc.ingest.units import balanced
from lance_hpc.limits import DEFAULT_RECORD_MB
from lance_hpc.lineage.provenance import derived_columns, provenance_of
from lance_hpc.storage.datasets import dataset_exists, open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks.formats import CLASS_NAMES_KEY, KIND_KEY

MODES = ("create", "append", "overwrite")
# Bytes of the first shard read to estimate an ingest's rows before it runs.
SAMPLE_BYTES = 1 << 20


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
    # append: per split, the columns lance_hpc derived (a job's write-back) the new rows lack (null
    # there), each with what wrote it
    unfilled: dict[str, dict[str, str]] = field(default_factory=dict)

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
        """Shard indices per worker, balanced by bytes (:func:`~lance_hpc.ingest.units.balanced`)."""
        return balanced([shard.bytes for shard in self.shards], world_size)

    @property
    def records(self) -> str:
        """Where finished shards are recorded: a hidden folder beside the training dataset."""
        return f"{records_root(self.train.uri)}/{self.run_id}"

    def shard_records(self) -> Records:
        """The records of this plan's finished shards."""
        return Records(self.records, self.train.options)


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
    unfilled: dict[str, dict[str, str]] = {}
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
            derived = _check_append_schema(found, schema, target)
            unfilled[split] = {name: written_by(found.schema, name) for name in derived}
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
    """A text corpus (``text:``, ``python-stdlib``: a format whose ``corpus`` is true) is tokenised
    unless ``tokenize`` is false (then its documents are rows); any other source only when
    ``tokenize`` is true."""
    if tokenize or (tokenize is None and format_class(source_text)[0].corpus):
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


# The kinds of job that write columns back, as the line about an append names them.
WRITERS = {"infer": "an infer job", "map": "a map job"}


def written_by(schema: pa.Schema, name: str) -> str:
    """What wrote column ``name`` back, from its provenance: the kind of job, and whether a model (a
    checkpoint) or a function computed it; only "a job" when the provenance names no such kind."""
    try:
        document = provenance_of(schema, name) or {}
    except UserError:  # provenance that is not lance_hpc's: nothing to say of who wrote it
        document = {}
    writer = WRITERS.get(str(document.get("job")))
    if writer is None:
        return "written back by a job"
    return f"written by {writer}, from {'a model' if document.get('checkpoint') else 'a function'}"


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
        metadata = {b"source": source.name.encode()}
        label_field = columns.label if columns.label is not None else source.format.column_fields([])["label"]
        names = source.format.class_names(label_field) if label_field else None
        if names:  # what image_classification reads its class names from
            metadata[CLASS_NAMES_KEY] = json.dumps(names).encode()
        return pa.schema(fields, metadata=metadata)
    raise UserError(f"{source.where(shard)} holds no record: the schema is read from the first shard")


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


def _sample_keys(batches: list[pa.RecordBatch]) -> Iterable[tuple[str, str]]:
    for batch in batches:
        yield from ((key, "") for key in row_keys(batch))


def stale_parts(plan: Plan) -> list[str]:
    """What this run's records name that the datasets no longer hold (none: every record counts)."""
    records = plan.shard_records()
    finished = records.finished()  # before the files are listed: a record is written after its files
    fragments = {
        split: [text for record in finished.values() for text in record.fragments.get(split, [])] for split in plan.targets()
    }
    return stale_records(records, plan.targets(), plan.run_id, fragments)


def resume_lines(plan: Plan) -> list[str]:
    """Before a run writes anything, in the one process that starts it: records naming what the
    datasets no longer hold are discarded (the run starts over, the splits still committed kept),
    and a line says so, or says which commits of an earlier run of this ingest were found."""
    records = plan.shard_records()
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
