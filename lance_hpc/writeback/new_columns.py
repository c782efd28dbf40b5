"""New columns for every row of a dataset, written by many ranks, one commit at the end.

The unit of work is a fragment of the dataset version the job pinned at its first start. Each rank
computes the new columns of its fragments in row order and writes them as one new data file per
fragment beside the existing ones (``LanceFragment.merge_columns``: the images are not rewritten),
records the fragment beside the dataset (``.<name>.infer/<run>/``), and rank 0, once every
fragment is recorded, commits one ``Merge`` of all of them: readers see all of the new columns or
none. A rerun (a requeued job, the same command again) writes only the fragments without a record.
An evaluation job records each fragment's metric sums the same way and writes no column.

The version is pinned in ``started.json`` by rank 0 at the first start; the other ranks wait for
it. A column an ``overwrite`` replaces stays in the dataset until the commit: its new values are
written under a temporary name, and the commit both removes the old column and names the new one
(:mod:`lance_hpc.writeback.column_swap`), so a failed job leaves the latest version as it was. If the
dataset moves on before the commit, the commit is refused with what changed: the new columns were
computed for the pinned version's rows, and are never mixed into another's. A record of a commit
counts only while the dataset still has what it names; otherwise the run starts over
(:mod:`lance_hpc.writeback.rerun`).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from lance_hpc.backfill import missing
from lance_hpc.checkpoint.manifests import latest
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.ingest.units import UnitRecords, balanced
from lance_hpc.lineage.provenance import Producer
from lance_hpc.spec import JobSpec
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.writeback import column_swap, fill, identity, waits


@dataclass
class FragmentRecord:
    """One fragment done: its metadata with the new data file (Lance's JSON) and the schema with the
    new columns (the parts Lance serialises it as, base64), or, for an evaluation, metric sums."""

    fragment: int
    rows: int
    metadata: str = ""
    schema: list[str] = field(default_factory=list)
    sums: dict[str, float] = field(default_factory=dict)
    unreadable: int = 0  # rows the decoder could not read: their outputs are null
    skipped: list[str] = field(default_factory=list)  # rows that raised, named (infer.on_error: skip): null
    seconds: float = 0.0


@dataclass(frozen=True)
class Fragment:
    id: int
    start: int  # the offset of its first row in the dataset version
    rows: int


@dataclass
class ColumnPlan:
    """What every rank agrees on: the dataset version, its fragments, the outputs and the run."""

    uri: str
    options: dict[str, str]
    version: int
    fragments: list[Fragment]
    outputs: dict[str, str]
    run: str  # the run's folder: records and the pin
    # each output's name in the files the ranks write: a temporary one for a column it replaces
    stored: dict[str, str] = field(default_factory=dict)
    # with a filter: the offsets within each fragment of the rows it selects; a fragment that selects
    # none reads its first row as a probe (its outputs' shapes), all of whose outputs are null
    selected: dict[int, np.ndarray] | None = None
    probes: frozenset[int] = frozenset()
    # the fragments (indices) the job computes: every one, or for a refresh those the columns lack
    compute: list[int] = field(default_factory=list)
    # a refresh that adds the new values to the columns the dataset has (lance_hpc.writeback.fill)
    fill: bool = False

    def assignment(self, world_size: int) -> list[list[int]]:
        """Indices of the fragments to compute per rank, balanced by rows (:func:`~lance_hpc.ingest.units.balanced`)."""
        shares = balanced([self.fragments[index].rows for index in self.compute], world_size)
        return [[self.compute[position] for position in share] for share in shares]

    def batches(self, indices: Iterable[int], batch_size: int) -> list[np.ndarray]:
        """The row offsets of these fragments in batches that never cross a fragment's end."""
        found = []
        for index in indices:
            fragment = self.fragments[index]
            offsets = self.offsets(index) + fragment.start
            found += [offsets[start : start + batch_size] for start in range(0, len(offsets), batch_size)]
        return found

    def offsets(self, index: int) -> np.ndarray:
        """The offsets within fragment ``index`` of the rows read: every row, or the filter's (or its probe)."""
        if self.selected is None:
            return np.arange(self.fragments[index].rows)
        return self.selected[index]

    def rows_selected(self, index: int) -> int:
        return 0 if index in self.probes else len(self.offsets(index))

    def dataset(self) -> Any:
        return open_dataset(self.uri, self.version, self.options)


def records_root(uri: str) -> str:
    parent, _, name = uri.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.infer" if parent else f".{name}.infer"


def run_key(uri: str, outputs: Mapping[str, str], model: str, job: str) -> str:
    """Names the run: the dataset, the columns and the model (a newer checkpoint is a new run)."""
    identity = json.dumps({"uri": uri, "outputs": dict(outputs), "model": model, "job": job}, sort_keys=True)
    return hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()


def run_name(run: str) -> str:
    """The run's key, the last part of its folder."""
    return run.rstrip("/").rpartition("/")[2]


class Records(UnitRecords[FragmentRecord]):
    """The finished fragments of one run, a small JSON file each, and its pin and commit."""

    def __init__(self, run: str, options: Mapping[str, str]) -> None:
        super().__init__(run, options, "fragment", FragmentRecord)

    def pinned(self) -> int | None:
        found = self.read_json("started.json")
        return int(found["version"]) if found else None

    def pin(self, version: int) -> None:
        self.write_json("started.json", {"version": version})

    def committed(self) -> int | None:
        found = self.commit_record()
        return int(found["version"]) if found else None

    def commit_record(self) -> dict[str, Any] | None:
        """The record of the run's commit as written: each commit's is unique (its ``id``), so a
        rank that saw one can tell a later commit from it even at the same version."""
        found = self.read_json("committed.json")
        return found if isinstance(found, dict) and "version" in found else None

    def mark_committed(self, version: int) -> None:
        self.write_json("committed.json", {"version": version, "id": uuid.uuid4().hex})

    def clear(self) -> None:
        """Forget the run (it starts over): the pin and the fragments first, the commit's record
        last, which the other ranks wait to see gone before they wait for a new pin."""
        infos = self.store.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        names = sorted(
            (info.path for info in infos if info.type == pafs.FileType.File), key=lambda path: path.endswith("/committed.json")
        )
        for name in names:
            self.store.delete_file(name)


def start(
    uri: str,
    options: dict[str, str],
    outputs: dict[str, str],
    run: str,
    *,
    main: bool,
    overwrite: bool,
    filter: str | None = None,
    refresh: Producer | None = None,
    stopped: Callable[[], bool],
) -> ColumnPlan:
    """The run's plan. Rank 0 pins the latest version at the first start (the columns an overwrite
    replaces still in it); the other ranks wait for the pin, or for ``stopped()``
    (:mod:`lance_hpc.writeback.waits`). ``refresh``: what computes the columns of a refresh, which
    fills the rows that lack columns the dataset has (their maker's)."""
    records = Records(run, options)
    version = records.pinned()
    if version is None and main:
        dataset = open_dataset(uri, None, options)
        filling = refresh is not None and missing.fills(dataset, uri, outputs, refresh, overwrite)
        column_swap.check_columns(dataset, uri, outputs, overwrite or filling)
        version = int(dataset.version)
        records.pin(version)
    if version is None:
        version = waits.wait_for(records.pinned, stopped, f"pin the dataset version of {uri}")
    return plan_at(uri, options, version, outputs, run, filter, refresh=refresh, overwrite=overwrite)


def plan_at(
    uri: str,
    options: dict[str, str],
    version: int,
    outputs: dict[str, str],
    run: str,
    filter: str | None = None,
    *,
    refresh: Producer | None = None,
    overwrite: bool = False,
) -> ColumnPlan:
    """The plan over ``version``'s fragments (and the rows ``filter`` selects in each); a refresh
    that fills the columns computes only the fragments they lack (a fragment whose values are all
    null counts as lacking them, unless a filter, which leaves rows null, is set)."""
    dataset = open_dataset(uri, version, options)
    fragments, start_row = [], 0
    for fragment in dataset.get_fragments():
        rows = fragment.count_rows()
        fragments.append(Fragment(fragment.fragment_id, start_row, rows))
        start_row += rows
    plan = ColumnPlan(uri, options, version, fragments, outputs, run, column_swap.stored_names(dataset.schema.names, outputs))
    plan.fill = refresh is not None and missing.fills(dataset, uri, outputs, refresh, overwrite)
    plan.compute = missing.gaps(dataset, outputs, all_null=not filter) if plan.fill else list(range(len(fragments)))
    if filter:
        plan.selected, plan.probes = select(dataset, fragments, filter, uri)
    return plan


def select(dataset: Any, fragments: list[Fragment], filter: str, uri: str) -> tuple[dict[int, np.ndarray], frozenset[int]]:
    """Each fragment's offsets of the rows ``filter`` selects (by their row addresses: fragment id
    and offset); a fragment selecting none gets its first row as a probe."""
    try:
        addresses = dataset.to_table(columns=[], filter=filter, with_row_address=True).column("_rowaddr").to_numpy()
    except (ValueError, OSError) as error:
        reason = str(error).split(",")[0]
        raise UserError(
            f"infer.filter {filter!r} does not run on {uri}: {reason}\n  fix: a Lance SQL predicate over its columns"
        ) from None
    if not len(addresses):
        raise UserError(f"infer.filter {filter!r} selects no row of {uri}\n  fix: loosen the predicate, or leave it out")
    ids, offsets = (addresses >> 32).astype(np.int64), (addresses & 0xFFFFFFFF).astype(np.int64)
    selected, probes = {}, set()
    for index, fragment in enumerate(fragments):
        mine = np.sort(offsets[ids == fragment.id])
        if not len(mine):
            mine = np.zeros(1, np.int64)
            probes.add(index)
        selected[index] = mine
    return selected, frozenset(probes)


def expand(
    batches: Iterable[tuple[Mapping[str, np.ndarray], np.ndarray, np.ndarray]], rows: int, kinds: Mapping[str, str]
) -> Iterator[pa.RecordBatch]:
    """Output batches of the rows read (outputs, valid, offsets in the fragment) as batches over
    every row of the fragment, in order: a row not read (outside the filter) is null."""
    cursor, shapes = 0, {}
    for outputs, valid, offsets in batches:
        shapes = {name: (value.shape[1:], value.dtype) for name, value in outputs.items()}
        end = int(offsets[-1]) + 1
        if end - cursor == len(offsets):  # contiguous: the rows as they came
            yield output_batch(outputs, kinds, valid)
        else:
            spread = {name: np.zeros((end - cursor, *value.shape[1:]), value.dtype) for name, value in outputs.items()}
            known = np.zeros(end - cursor, bool)
            for name, value in outputs.items():
                spread[name][offsets - cursor] = value
            known[offsets - cursor] = valid
            yield output_batch(spread, kinds, known)
        cursor = end
    if cursor < rows:
        empty = {name: np.zeros((rows - cursor, *shape), dtype) for name, (shape, dtype) in shapes.items()}
        yield output_batch(empty, kinds, np.zeros(rows - cursor, bool))


def model_name(spec: JobSpec) -> str:
    """What names the model in the run: the checkpoint directory and its latest step (a newer
    checkpoint is a new run), or the function; read from names only, nothing loaded."""
    assert spec.infer is not None
    if spec.infer.checkpoint is None:
        return f"function {spec.infer.function}"
    saved = latest(open_store(spec.infer.checkpoint))
    if saved is None:
        raise UserError(
            f"infer.checkpoint {spec.infer.checkpoint} holds no checkpoint\n"
            "  fix: name the checkpoint.dir of a training job that has saved one (lance-hpc status shows it)"
        )
    return f"{spec.infer.checkpoint} step {saved.step}" + (f" with {spec.infer.function}" if spec.infer.function else "")


def job_key(spec: JobSpec, model: str) -> str:
    """Names the job: the dataset, the columns, the model's name, the settings and the job kind."""
    assert spec.infer is not None
    refresh = f" refresh={spec.infer.refresh}" if spec.infer.refresh else ""
    return run_key(
        spec.data.uri,
        spec.infer.outputs,
        f"{model} overwrite={spec.infer.overwrite} filter={spec.infer.filter}{refresh}",
        spec.job,
    )


def run_records(spec: JobSpec, model: str) -> tuple[str, Records]:
    """The run's folder beside the dataset, named by the job and what produces the values (the
    function's source, the checkpoint: :mod:`lance_hpc.writeback.identity`)."""
    options = storage_options(spec.data.uri, spec.data.storage_options)
    run = f"{records_root(spec.data.uri)}/{identity.with_code(job_key(spec, model), identity.code(spec))}"
    return run, Records(run, options)


def progress_lines(spec: JobSpec) -> list[str]:
    """How far an inference or evaluation job got, from its records (for lance-hpc status)."""
    try:
        _, records = run_records(spec, model_name(spec))
    except UserError as error:
        return [str(error).splitlines()[0]]
    found = records.finished()
    pinned, committed = records.pinned(), records.committed()
    if pinned is None:
        return ["not started: no version pinned yet"]
    rows = sum(record.rows for record in found.values())
    lines = [f"{len(found)} fragment(s) written ({rows:,} rows) of version {pinned}"]
    if committed is not None:
        lines.append(f"committed: version {committed}")
    return lines


# ---- one fragment's columns ---------------------------------------------------------------------


def arrow_column(values: np.ndarray, kind: str, valid: np.ndarray | None) -> pa.Array:
    """One output as an Arrow column of ``kind`` values: a fixed-size list per row for a vector."""
    values = np.ascontiguousarray(values.astype(kind, copy=False))
    mask = None if valid is None or valid.all() else ~valid
    if values.ndim == 1:
        return pa.array(values, mask=mask)
    flat = values.reshape(len(values), -1)
    lists = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return lists if mask is None else pa.FixedSizeListArray.from_arrays(lists.values, flat.shape[1], mask=pa.array(mask))


def output_batch(outputs: Mapping[str, np.ndarray], kinds: Mapping[str, str], valid: np.ndarray | None) -> pa.RecordBatch:
    missing = sorted(set(kinds) - set(outputs))
    if missing:
        raise UserError(
            f"the model gave no {', '.join(missing)} (it gave {', '.join(sorted(outputs)) or 'nothing'})\n"
            "  fix: name outputs it gives in infer.outputs"
        )
    names = list(kinds)
    return pa.record_batch([arrow_column(outputs[name], kinds[name], valid) for name in names], names=names)


def write_fragment(plan: ColumnPlan, index: int, batches: Iterator[pa.RecordBatch]) -> FragmentRecord:
    """The fragment's new columns from ``batches`` (its rows in order) as one new data file."""
    started = time.monotonic()
    fragment = plan.dataset().get_fragment(plan.fragments[index].id)
    names = [plan.stored[name] for name in plan.outputs]  # a replaced column's values under a temporary name

    def stored(batch: pa.RecordBatch) -> pa.RecordBatch:
        return pa.record_batch(batch.columns, names=names)

    first = stored(next(batches))  # the schema of the new columns: a vector's length is known once one is made

    def all_batches() -> Iterator[pa.RecordBatch]:
        yield first
        yield from map(stored, batches)

    reader = pa.RecordBatchReader.from_batches(first.schema, all_batches())
    metadata, schema = fragment.merge_columns(reader)
    return FragmentRecord(
        plan.fragments[index].id,
        plan.fragments[index].rows,
        json.dumps(metadata.to_json()),
        column_swap.encode(schema),  # rebuilt at the commit, with Lance's own field ids
        seconds=time.monotonic() - started,
    )


def commit(plan: ColumnPlan, records: dict[int, FragmentRecord], metadata: Mapping[str, Mapping[str, str]]) -> int:
    """One Merge of every fragment's new columns on the pinned version, which also removes the
    columns they replace, gives the new ones their names and sets their field ``metadata`` (their
    provenance); its new version."""
    import lance

    latest = open_dataset(plan.uri, None, plan.options)
    if int(latest.version) != plan.version:
        raise UserError(
            f"{plan.uri} changed since this job began: it read version {plan.version}, the dataset is at version "
            f"{latest.version} now, so the new columns (computed for version {plan.version}'s rows) were not committed\n"
            "  fix: run the job again on a fresh run (a new checkpoint, other columns) or restore the version it read"
        )
    if plan.fill:
        written = {index: (record.metadata, record.schema) for index, record in records.items()}
        return fill.commit_fill(plan.uri, plan.options, plan.version, written, plan.stored, metadata)
    fragments = [lance.FragmentMetadata.from_json(records[index].metadata) for index in range(len(plan.fragments))]
    operation = lance.LanceOperation.Merge(fragments, column_swap.committed_schema(records[0].schema, plan.stored, metadata))
    dataset = lance.LanceDataset.commit(
        plan.uri, operation, read_version=plan.version, storage_options=plan.options or None, max_retries=0
    )
    return int(dataset.version)
