"""``job: map``: your function over batches of data.uri's columns, its results written back as new
columns: the same fragments, records, resume, refresh and one commit as ``job: infer``
(:mod:`lance_hpc.writeback.steps`), and no model, no task and no GPU.

The function (``infer.function``) takes a ``pyarrow.RecordBatch`` of ``infer.columns`` (every column
when empty), ``data.batch_size`` rows of one fragment in row order, and returns ``{column: values}``
for each of ``infer.outputs``: a numpy array (one row per row; a 2-D array is a vector per row), a
list, or a pyarrow array (its nulls stay null). An image's size, a perceptual hash, a text's length,
a tokenizer's count, or a call to an embedding model of your own: whatever a batch gives. Each rank
reads its fragments straight from Lance (no DataLoader workers) and writes each fragment's new
columns as one data file.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.writeback import new_columns, steps
from lance_hpc.writeback.new_columns import ColumnPlan, Records
from lance_hpc.writeback.row_errors import RowErrors, row_name

if TYPE_CHECKING:
    import pyarrow as pa

    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Preemption, Requeue
    from lance_hpc.spec import JobSpec

Function = Callable[["pa.RecordBatch"], Mapping[str, Any]]


def check_map(spec: JobSpec, world_size: int | None = None) -> str:
    """Before any rank starts: the dataset, the columns it reads and writes, and the function's
    import checked; the work in a few lines (:func:`lance_hpc.writeback.steps.check`)."""
    assert spec.infer is not None and spec.infer.function is not None  # the spec's rules for job: map
    function = spec.infer.function

    def inputs() -> None:
        schema = open_dataset(spec.data.uri, None, storage_options(spec.data.uri, spec.data.storage_options)).schema
        absent = [name for name in read_columns(spec, schema.names) if name not in schema.names]
        if absent:
            raise UserError(
                f"infer.columns: {spec.data.uri} has no column {', '.join(absent)} (it has {', '.join(schema.names)})\n"
                "  fix: name columns the dataset has"
            )
        load_callable(function, "infer.function")  # an import error here, not on every rank

    return steps.check(spec, world_size, inputs, runs_a_model=False)


def read_columns(spec: JobSpec, names: list[str]) -> list[str]:
    """The columns the function gets: infer.columns, or every column but the outputs."""
    assert spec.infer is not None
    return list(spec.infer.columns) or [name for name in names if name not in spec.infer.outputs]


def run_map(spec: JobSpec, env: DistEnv, preemption: Preemption, requeue: Requeue) -> Summary:
    """This rank's fragments through the function; on rank 0 also the wait and the commit."""
    from lance_hpc.runtime.context import Summary  # the runtime only on a rank: checks stay free of torch

    assert spec.infer is not None and spec.infer.function is not None
    run = steps.begin(spec, env, preemption)
    if run is None:
        return Summary("completed", 0, 0, None)
    function: Function = load_callable(spec.infer.function, "infer.function")
    plan = steps.pin(spec, env, run, preemption)
    if not plan.compute:
        return Summary("completed", 0, 0, None)
    mine = plan.assignment(env.world_size)[env.rank]
    done, already = _work(spec, env, plan, run.records, mine, function, preemption)
    return steps.finish(spec, env, plan, run, mine, done, already, preemption, requeue)


def _work(
    spec: JobSpec, env: DistEnv, plan: ColumnPlan, records: Records, mine: list[int], function: Function, preemption: Preemption
) -> tuple[list[int], list[int]]:
    """This rank's fragments that have no record, in order, until a stop signal."""

    assert spec.infer is not None
    finished = records.finished()
    already = [index for index in mine if index in finished]
    dataset = plan.dataset()
    columns = read_columns(spec, dataset.schema.names)
    errors = RowErrors(spec.infer.on_error, env.rank, "infer.function", list(spec.infer.outputs))
    done = []
    for index in (index for index in mine if index not in finished):
        if preemption.received is not None:
            break
        started = time.monotonic()
        fragment = plan.fragments[index]
        batches = _batches(dataset.get_fragment(fragment.id), plan, index, columns, spec.data.batch_size)
        name_row = partial(row_name, lambda: dataset, fragment.id, fragment.start)
        rows = (
            _outputs(function, batch, offsets, index in plan.probes, spec.infer.outputs, errors, name_row)
            for batch, offsets in batches
        )
        try:
            record = new_columns.write_fragment(plan, index, new_columns.expand(rows, fragment.rows, spec.infer.outputs))
        except Exception as error:
            errors.reraise(error)
        record.rows, record.seconds = plan.rows_selected(index), time.monotonic() - started
        record.skipped = errors.fragment_done()
        records.write(index, record)
        done.append(index)
        print(f"rank {env.rank}: fragment {fragment.id}: {fragment.rows:,} rows in {record.seconds:.1f} s", flush=True)
    return done, already


def _batches(
    fragment: Any, plan: ColumnPlan, index: int, columns: list[str], batch_size: int
) -> Iterator[tuple[Any, np.ndarray]]:
    """The fragment's rows the job reads (every one, or the filter's), ``batch_size`` at a time, in
    order, with their offsets in the fragment."""
    if plan.selected is None:
        start = 0
        for batch in fragment.to_batches(batch_size=batch_size, columns=columns):
            yield batch, np.arange(start, start + batch.num_rows)
            start += batch.num_rows
        return
    offsets = plan.offsets(index)
    for start in range(0, len(offsets), batch_size):
        chosen = offsets[start : start + batch_size]
        yield fragment.take(chosen.tolist(), columns=columns).combine_chunks().to_batches()[0], chosen


def _outputs(
    function: Function,
    batch: Any,
    offsets: np.ndarray,
    probe: bool,
    outputs: Mapping[str, str],
    errors: RowErrors,
    name_row: Callable[[int], str],
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The function's values for a batch as numpy, which rows have them, and the rows' offsets; a
    batch it raises on goes through infer.on_error (:mod:`lance_hpc.writeback.row_errors`)."""
    values, valid = errors.run(
        batch.num_rows,
        lambda: _values(function, batch, outputs),
        lambda row: _values(function, batch.slice(row, 1), outputs),
        lambda row: name_row(int(offsets[row])),
    )
    return values, np.zeros_like(valid) if probe else valid, offsets


def _values(function: Function, batch: Any, outputs: Mapping[str, str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The function's values for ``batch`` as numpy, and which rows have them."""
    found = function(batch)
    if not isinstance(found, Mapping):
        raise UserError(
            f"infer.function returned {type(found).__name__}, not a mapping\n"
            f"  fix: return {{column: values}} with a value for each of {', '.join(outputs)}"
        )
    valid = np.ones(batch.num_rows, bool)
    values = {}
    for name in outputs:
        if name not in found:
            continue  # output_batch names every output the function did not give
        values[name], present = _as_numpy(name, found[name], batch.num_rows)
        valid &= present
    return values, valid


def _as_numpy(name: str, value: Any, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A column's values and which rows have one (a pyarrow array's nulls: none)."""
    import pyarrow as pa

    present = np.ones(rows, bool)
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    if isinstance(value, pa.Array):
        present = ~np.asarray(value.is_null(), dtype=bool)
        if pa.types.is_fixed_size_list(value.type):
            array = value.fill_null([0] * value.type.list_size) if value.null_count else value
            value = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), value.type.list_size)
        else:
            value = (value.fill_null(0) if value.null_count else value).to_numpy(zero_copy_only=False)
    array = np.asarray(value)
    if array.ndim == 0 or len(array) != rows:
        raise UserError(
            f"infer.function gave {name} with {array.shape[0] if array.ndim else 'a single value'} row(s) for a batch of {rows}\n"
            "  fix: return one value (or one vector) per row of the batch"
        )
    return array, present
