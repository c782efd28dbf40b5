"""The inference and evaluation jobs (``job: infer``, ``job: evaluate``): a model over every row of
data.uri, its outputs written as new columns, or its metrics reported.

The model is the latest checkpoint in ``infer.checkpoint`` (a training job's checkpoint.dir), built
by the spec's task and read with the task's evaluation decoder, so rows are prepared as they were
for validation; or ``infer.function`` (given the model, or None). Each rank takes its share of the
pinned version's fragments (:mod:`lance_hpc.writeback.new_columns`), reads each fragment's rows in
order through the data layer's workers, runs the model under ``torch.inference_mode`` (bf16
autocast on GPU when train.precision says so; pinned memory, non-blocking copies, channels-last as
the task prepares it) and writes the fragment's new column file. Around that loop the run is the
one ``job: map`` shares (:mod:`lance_hpc.writeback.steps`): the pin, rank 0's wait for every fragment's
record, one commit. A stop signal is honoured at a fragment boundary (USR2 requeues).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from lance_hpc import loading
from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.export import model_state
from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.lineage.provenance import weights_digest
from lance_hpc.loading.loader import RowsLoader
from lance_hpc.runtime.context import Summary, precision_context
from lance_hpc.runtime.environment import DistEnv, configure_process, select_device
from lance_hpc.runtime.metrics import build_logger
from lance_hpc.runtime.preemption import Preemption, Requeue
from lance_hpc.spec import JobSpec
from lance_hpc.storage.files import write_file
from lance_hpc.tasks import ROW_ID, Task
from lance_hpc.tasks.base import Batch
from lance_hpc.writeback import column_swap, new_columns, steps
from lance_hpc.writeback.new_columns import ColumnPlan, FragmentRecord, Records
from lance_hpc.writeback.row_errors import RowErrors, row_name

Infer = Callable[[nn.Module | None, Batch], dict[str, torch.Tensor]]


def load_model(spec: JobSpec, task: Task, device: torch.device, *, digest: bool = False) -> tuple[nn.Module | None, str | None]:
    """The latest checkpoint's model in evaluation mode on ``device`` (or None without infer.checkpoint),
    and with ``digest`` a digest of its weights as saved (the provenance of the columns it writes)."""
    assert spec.infer is not None
    if spec.infer.checkpoint is None:
        return None, None
    saved = resuming.load_latest(spec.infer.checkpoint)
    if saved is None or ("model" not in saved.objects and saved.shards is None):
        raise UserError(
            f"infer.checkpoint {spec.infer.checkpoint} holds no checkpoint with a model\n"
            "  fix: name the checkpoint.dir of a training job that has saved one (lance-hpc status shows it)"
        )
    resuming.check_same_model(saved, spec, task.options)
    model = task.build_model()
    state = model_state(saved)  # whole, from shards too
    weights = weights_digest(state) if digest else None
    resuming.restore_object(model, state, saved, spec, "model")
    return task.prepare_model(model, device).eval(), weights


def infer_function(spec: JobSpec, task: Task) -> Infer:
    """``infer.function``, or the task's own outputs."""
    assert spec.infer is not None
    if spec.infer.function:
        return load_callable(spec.infer.function, "infer.function")
    return lambda model, batch: task.infer(model, batch)  # type: ignore[arg-type]


def run_infer(spec: JobSpec, env: DistEnv, preemption: Preemption, requeue: Requeue) -> Summary:
    """This rank's fragments; on rank 0 also the wait for the others, the commit or the report
    (:mod:`lance_hpc.writeback.steps`)."""
    assert spec.infer is not None
    device = select_device(env)
    configure_process(spec.train.seed, False, env, device)
    run = steps.begin(spec, env, preemption)
    if run is None:
        return Summary("completed", 0, 0, None)
    if spec.data.num_workers > 0:  # there is work: the workers' server imports torch while the model and plan load
        loading.worker_context()
    task = loading.load_task(spec)
    check_task_inputs(spec, task)
    model, weights = load_model(spec, task, device, digest=env.is_main)
    run = run.with_weights(weights)
    plan = steps.pin(spec, env, run, preemption)
    if not plan.compute:
        return Summary("completed", 0, 0, None)
    mine = plan.assignment(env.world_size)[env.rank]
    done, already = _work(spec, env, plan, run.records, mine, task, model, infer_function(spec, task), preemption, device)
    report = (lambda finished: _report(spec, task, plan, finished)) if spec.job == "evaluate" else None
    return steps.finish(spec, env, plan, run, mine, done, already, preemption, requeue, report)


def _work(
    spec: JobSpec,
    env: DistEnv,
    plan: ColumnPlan,
    records: Records,
    mine: list[int],
    task: Task,
    model: nn.Module | None,
    infer: Infer,
    preemption: Preemption,
    device: torch.device,
) -> tuple[list[int], list[int]]:
    """Write (or evaluate) this rank's fragments that have no record, in order, until a stop signal."""
    finished = records.finished()
    already = [index for index in mine if index in finished]
    todo = [index for index in mine if index not in finished]
    if not todo:
        return [], already
    loader = RowsLoader(
        spec.data,
        task.decoder(train=False),
        env.rank,
        plan.uri,
        plan.version,
        plan.batches(todo, spec.data.batch_size),
        pin_memory=device.type == "cuda",
    )
    batches = iter(loader)
    assert spec.infer is not None
    what = "infer.function" if spec.infer.function else "the model"
    errors = RowErrors(spec.infer.on_error, env.rank, what, list(spec.infer.outputs))
    done = []
    for index in todo:
        if preemption.received is not None:
            break
        fragment = plan.fragments[index]
        expected = iter(plan.batches([index], spec.data.batch_size))
        compute = _Compute(task, model, infer, spec, device, errors, partial(row_name, plan.dataset, fragment.id, fragment.start))
        rows = _fragment_batches(batches, expected, fragment.start, index in plan.probes, compute)
        if spec.job == "evaluate":
            record = _evaluate_fragment(index, plan, rows)
        else:
            try:
                record = new_columns.write_fragment(plan, index, new_columns.expand(rows, fragment.rows, spec.infer.outputs))
            except Exception as error:
                errors.reraise(error)
            record.unreadable, record.skipped = rows.unreadable, errors.fragment_done()
        record.rows = plan.rows_selected(index)
        records.write(index, record)
        done.append(index)
        rows_text = (
            f"{record.rows:,} of {fragment.rows:,} rows (infer.filter)" if plan.selected is not None else f"{record.rows:,} rows"
        )
        print(f"rank {env.rank}: fragment {fragment.id}: {rows_text} in {record.seconds:.1f} s", flush=True)
    return done, already


class _Rows:
    """A fragment's batches through the model: per batch, the outputs (numpy) and which rows have
    them: rows that were readable (a row the decoder could not read was replaced by another: its
    outputs are null) and were computed (infer.on_error: skip leaves a row that raised null)."""

    def __init__(self, source: Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]], probe: bool) -> None:
        self.source, self.unreadable, self.probe = source, 0, probe

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
        for outputs, readable, computed, offsets in self.source:
            if self.probe:  # read for the outputs' shapes only: every value null
                readable = np.zeros_like(readable)
            else:
                self.unreadable += int((~readable).sum())
            yield outputs, readable & computed, offsets


@dataclass
class _Compute:
    """What a batch on the device goes through: the model's metric sums (evaluate), or the outputs
    of the model or infer.function, with infer.on_error for a batch that raises (name_row: a row of
    the fragment by its offset there)."""

    task: Task
    model: nn.Module | None
    infer: Infer
    spec: JobSpec
    device: torch.device
    errors: RowErrors
    name_row: Callable[[int], str]

    def __call__(self, on_device: Batch, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch's outputs and which of its rows have them (not those that raised, with skip)."""
        rows = len(offsets)
        if self.spec.job == "evaluate":
            assert self.model is not None
            return _numpy({"sums": self.task.forward(self.model, on_device)[1].double()}), np.ones(rows, bool)
        return self.errors.run(
            rows,
            lambda: (self._outputs(on_device), np.ones(rows, bool)),
            lambda row: (self._outputs({name: value[row : row + 1] for name, value in on_device.items()}), np.ones(1, bool)),
            lambda row: self.name_row(int(offsets[row])),
        )

    def _outputs(self, on_device: Batch) -> dict[str, np.ndarray]:
        return _numpy(self.infer(self.model, on_device))


def _numpy(outputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        name: value.float().cpu().numpy() if value.is_floating_point() else value.cpu().numpy() for name, value in outputs.items()
    }


def _fragment_batches(
    batches: Iterator[Batch], expected: Iterator[np.ndarray], start: int, probe: bool, compute: _Compute
) -> _Rows:
    def produce() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]]:
        for rows in expected:
            batch = next(batches)
            readable = batch[ROW_ID].numpy() == rows
            with torch.inference_mode(), precision_context(compute.spec.train, compute.device):
                outputs, computed = compute(compute.task.to_device(batch, compute.device), rows - start)
            yield outputs, readable, computed, rows - start

    return _Rows(produce(), probe)


def _evaluate_fragment(index: int, plan: ColumnPlan, rows: _Rows) -> FragmentRecord:
    started = time.monotonic()
    total: np.ndarray | None = None
    for outputs, _, _ in rows:
        if index not in plan.probes:  # a probe row is outside the filter: not counted
            total = outputs["sums"] if total is None else total + outputs["sums"]
    sums = [] if total is None else total.tolist()
    fragment = plan.fragments[index]
    return FragmentRecord(
        fragment.id, fragment.rows, sums={str(i): value for i, value in enumerate(sums)}, seconds=time.monotonic() - started
    )


def _report(spec: JobSpec, task: Task, plan: ColumnPlan, finished: dict[int, FragmentRecord]) -> dict[str, float]:
    """An evaluation's metrics from every fragment's sums: printed, to TensorBoard and to a JSON file."""
    assert spec.infer is not None
    totals = np.zeros(len(task.metrics))
    for record in finished.values():
        for position, value in record.sums.items():
            totals[int(position)] += value
    metrics = task.report(dict(zip(task.metrics, totals.tolist())), "eval")
    logger = build_logger(spec, True)
    logger.log(metrics, 0)
    logger.close()
    path = Path(spec.infer.metrics_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "dataset": spec.data.uri,
        "version": plan.version,
        "checkpoint": spec.infer.checkpoint,
        "rows": sum(record.rows for record in finished.values()),
        "metrics": metrics,
    }
    write_file(path, json.dumps(payload, indent=2) + "\n")
    values = ", ".join(f"{tag.split('/', 1)[1]} {value:.4f}" for tag, value in metrics.items())
    print(f"evaluation of {spec.infer.checkpoint} on {spec.data.uri} version {plan.version}: {values}; wrote {path}", flush=True)
    return metrics


def check_task_inputs(spec: JobSpec, task: Task) -> None:
    """job: infer writes no column the task reads its rows from (a UserError naming it)."""
    assert spec.infer is not None
    if spec.job == "infer":
        column_swap.check_inputs(spec.infer.outputs, task.decoder(train=False).columns, spec.task.name)


def check_infer(spec: JobSpec, world_size: int | None = None) -> str:
    """Before any rank starts: the dataset, the columns and the checkpoint checked (and the task's
    inputs against the outputs); the work in a few lines, no model loaded (:func:`lance_hpc.writeback.steps.check`)."""

    def inputs() -> None:
        if spec.job == "infer":  # before any rank starts: one error, not one per rank
            check_task_inputs(spec, loading.load_task(spec))

    return steps.check(spec, world_size, inputs)
