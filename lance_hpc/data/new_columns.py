"""New columns for every row of a dataset, written by many ranks, one commit at the end.

The unit of work is a fragment of the dataset version the job pinned at its first start. Each rank
computes the new columns of its fragments in row order and writes them as one new data file per
fragment beside the existing ones (``LanceFragment.merge_columns``: the images are not rewritten),
records the fragment beside the dataset (``.<name>.infer/<run>/``), and rank 0, once every
fragment is recorded, commits one ``Merge`` of all of them: readers see all of the new columns or
none. A rerun (a requeued job, the same command again) writes only the fragments without a record.
An evaluation job records each fragment's metric sums the same way and writes no column.

The version is pinned in ``started.json`` by rank 0 at the first start (after dropping the columns
an ``overwrite`` replaces, itself a new version); the other ranks wait for it. If the dataset moves
on before the commit, the commit is refused with what changed: the new columns were computed for
the pinned version's rows, and are never mixed into another's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from lance_hpc.data.target import filesystem
from lance_hpc.errors import UserError
from lance_hpc.spec import JobSpec
from lance_hpc.storage.checkpoint_index import latest
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import storage_options

# How often a rank waits for rank 0's pinned version, and for how long at most.
WAIT_S, WAIT_LIMIT_S = 0.5, 600.0


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

    def assignment(self, world_size: int) -> list[list[int]]:
        """Fragment indices per rank: the biggest first, each to the rank with the fewest rows so
        far (ties to the lowest rank); each rank's list in dataset order."""
        loads = [0] * world_size
        mine: list[list[int]] = [[] for _ in range(world_size)]
        for index in sorted(range(len(self.fragments)), key=lambda i: (-self.fragments[i].rows, i)):
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            loads[rank] += max(self.fragments[index].rows, 1)
            mine[rank].append(index)
        return [sorted(indices) for indices in mine]

    def batches(self, indices: Iterable[int], batch_size: int) -> list[np.ndarray]:
        """The row offsets of these fragments in batches that never cross a fragment's end."""
        found = []
        for index in indices:
            fragment = self.fragments[index]
            for start in range(0, fragment.rows, batch_size):
                found.append(np.arange(fragment.start + start, fragment.start + min(start + batch_size, fragment.rows)))
        return found

    def dataset(self) -> Any:
        return open_dataset(self.uri, self.version, self.options)


def records_root(uri: str) -> str:
    parent, _, name = uri.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.infer" if parent else f".{name}.infer"


def run_key(uri: str, outputs: Mapping[str, str], model: str, job: str) -> str:
    """Names the run: the dataset, the columns and the model (a newer checkpoint is a new run)."""
    identity = json.dumps({"uri": uri, "outputs": dict(outputs), "model": model, "job": job}, sort_keys=True)
    return hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()


class Records:
    """The finished fragments of one run, a small JSON file each, and its pin and commit."""

    def __init__(self, run: str, options: Mapping[str, str]) -> None:
        self.store, self.path = filesystem(run, options)

    def _write(self, name: str, payload: dict[str, Any]) -> None:
        """One PUT on an object store; locally a temporary file renamed into place."""
        self.store.create_dir(self.path, recursive=True)
        final = f"{self.path}/{name}"
        partial = f"{final}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial"
        with self.store.open_output_stream(partial) as handle:
            handle.write(json.dumps(payload).encode())
        self.store.move(partial, final)

    def _read(self, name: str) -> Any:
        try:
            with self.store.open_input_stream(f"{self.path}/{name}") as handle:
                return json.loads(handle.read())
        except (FileNotFoundError, OSError):
            return None

    def finished(self, known: dict[int, FragmentRecord] | None = None) -> dict[int, FragmentRecord]:
        """Every recorded fragment by its index in the plan; those in ``known`` are not read again."""
        try:
            infos = self.store.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError:
            return dict(known or {})
        found = {}
        for info in infos:
            name = info.base_name
            if info.type == pafs.FileType.File and name.startswith("fragment-") and name.endswith(".json"):
                index = int(name[len("fragment-") : -len(".json")])
                found[index] = known[index] if known and index in known else FragmentRecord(**self._read(name))
        return found

    def write(self, index: int, record: FragmentRecord) -> None:
        self._write(f"fragment-{index:06d}.json", asdict(record))

    def pinned(self) -> int | None:
        found = self._read("started.json")
        return int(found["version"]) if found else None

    def pin(self, version: int) -> None:
        self._write("started.json", {"version": version})

    def committed(self) -> int | None:
        found = self._read("committed.json")
        return int(found["version"]) if found else None

    def mark_committed(self, version: int) -> None:
        self._write("committed.json", {"version": version})


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


def start(uri: str, options: dict[str, str], outputs: dict[str, str], run: str, *, main: bool, overwrite: bool) -> ColumnPlan:
    """The run's plan. Rank 0 pins the version at the first start (dropping the columns an
    overwrite replaces: a new version); the other ranks wait for the pin."""
    records = Records(run, options)
    version = records.pinned()
    if version is None and main:
        dataset = open_dataset(uri, None, options)
        check_columns(dataset, uri, outputs, overwrite)
        replaced = existing_columns(dataset.schema, outputs)
        if replaced:
            dataset.drop_columns(replaced)
            dataset = open_dataset(uri, None, options)
        version = int(dataset.version)
        records.pin(version)
    deadline = time.monotonic() + WAIT_LIMIT_S
    while version is None:
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not pin the dataset version of {uri} within {WAIT_LIMIT_S:.0f} s: see its log")
        time.sleep(WAIT_S)
        version = records.pinned()
    dataset = open_dataset(uri, version, options)
    fragments, start_row = [], 0
    for fragment in dataset.get_fragments():
        rows = fragment.count_rows()
        fragments.append(Fragment(fragment.fragment_id, start_row, rows))
        start_row += rows
    return ColumnPlan(uri, options, version, fragments, outputs, run)


def model_name(spec: JobSpec) -> str:
    """What names the model in the run: the checkpoint directory and its latest step (a newer
    checkpoint is a new run), or the function; read from names only, nothing loaded."""
    assert spec.infer is not None
    if spec.infer.checkpoint is None:
        return f"function {spec.infer.function}"
    saved = latest(spec.infer.checkpoint)
    if saved is None:
        raise UserError(
            f"infer.checkpoint {spec.infer.checkpoint} holds no checkpoint\n"
            "  fix: name the checkpoint.dir of a training job that has saved one (lance-hpc status shows it)"
        )
    return f"{spec.infer.checkpoint} step {saved.step}" + (f" with {spec.infer.function}" if spec.infer.function else "")


def run_records(spec: JobSpec, model: str) -> tuple[str, Records]:
    """The run's folder beside the dataset, named by the dataset, the columns, the model and the job."""
    assert spec.infer is not None
    options = storage_options(spec.data.uri, spec.data.storage_options)
    key = run_key(spec.data.uri, spec.infer.outputs, f"{model} overwrite={spec.infer.overwrite}", spec.job)
    run = f"{records_root(spec.data.uri)}/{key}"
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
    first = next(batches)  # the schema of the new columns: a vector's length is known once one is made

    def all_batches() -> Iterator[pa.RecordBatch]:
        yield first
        yield from batches

    reader = pa.RecordBatchReader.from_batches(first.schema, all_batches())
    metadata, schema = fragment.merge_columns(reader)
    name, *parts = schema.__reduce__()[1]  # how Lance pickles it: rebuilt at the commit, see merged_schema
    encoded = [name, *(base64.b64encode(part).decode() for part in parts)]
    return FragmentRecord(
        plan.fragments[index].id,
        plan.fragments[index].rows,
        json.dumps(metadata.to_json()),
        encoded,
        seconds=time.monotonic() - started,
    )


def merged_schema(encoded: list[str]) -> Any:
    """The dataset's schema with the new columns and Lance's own field ids, as merge_columns made it
    (field ids cannot round-trip through an Arrow schema once a column was ever dropped)."""
    from lance.schema import LanceSchema

    name, *parts = encoded
    return LanceSchema._from_protos(name, *(base64.b64decode(part) for part in parts))


def commit(plan: ColumnPlan, records: dict[int, FragmentRecord]) -> int:
    """One Merge of every fragment's new columns on the pinned version; its new version."""
    import lance

    latest = open_dataset(plan.uri, None, plan.options)
    if int(latest.version) != plan.version:
        raise UserError(
            f"{plan.uri} changed since this job began: it read version {plan.version}, the dataset is at version "
            f"{latest.version} now, so the new columns (computed for version {plan.version}'s rows) were not committed\n"
            "  fix: run the job again on a fresh run (a new checkpoint, other columns) or restore the version it read"
        )
    fragments = [lance.FragmentMetadata.from_json(records[index].metadata) for index in range(len(plan.fragments))]
    operation = lance.LanceOperation.Merge(fragments, merged_schema(records[0].schema))
    dataset = lance.LanceDataset.commit(
        plan.uri, operation, read_version=plan.version, storage_options=plan.options or None, max_retries=0
    )
    return int(dataset.version)
