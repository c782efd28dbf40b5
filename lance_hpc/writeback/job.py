"""The inference and evaluation jobs (``job: infer``, ``job: evaluate``): a model over every row of
data.uri, its outputs written as new columns (:class:`WriteColumns`), or its metrics reported
(:class:`~lance_hpc.writeback.evaluation.Evaluation`): the kind gives the run its :class:`ModelPass`.

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

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from lance_hpc import loading
from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.export import model_state
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.lineage.provenance import weights_digest
from lance_hpc.loading.loader import RowsLoader
from lance_hpc.runtime.context import Summary
from lance_hpc.runtime.environment import DistEnv, configure_process, select_device
from lance_hpc.runtime.model_setup import precision_context
from lance_hpc.runtime.preemption import Preemption, Requeue
from lance_hpc.spec import JobSpec
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
    saved = resuming.load_latest(open_store(spec.infer.checkpoint))
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


class ModelPass:
    """What a run of the model makes of the fragments, which the kind chooses: the check of the
    task's inputs, each batch's outputs, each fragment's record, and what rank 0 does once every
    fragment has one besides the commit."""

    def check_inputs(self, spec: JobSpec, task: Task) -> None:
        """Before the model loads: refuse what the task reads that the run would change (a UserError)."""

    def check_before(self, spec: JobSpec) -> None:
        """Before any rank starts, on the launching machine: :meth:`check_inputs`, if it needs the task loaded."""

    def compute(self, compute: Compute, on_device: Batch, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch's outputs and which of its rows have them."""
        raise NotImplementedError(f"{type(self).__name__}.compute")

    def record(self, spec: JobSpec, plan: ColumnPlan, index: int, rows: FragmentRows, errors: RowErrors) -> FragmentRecord:
        """The fragment's record, from its batches' outputs."""
        raise NotImplementedError(f"{type(self).__name__}.record")

    def report(
        self, spec: JobSpec, task: Task, plan: ColumnPlan
    ) -> Callable[[dict[int, FragmentRecord]], dict[str, float]] | None:
        """What rank 0 reports from every fragment's record (:func:`lance_hpc.writeback.steps.finish`); None: nothing."""
        return None


class WriteColumns(ModelPass):
    """``job: infer``: the outputs of the model or infer.function, written as the fragment's new columns."""

    def check_inputs(self, spec: JobSpec, task: Task) -> None:
        """No output is a column the task reads its rows from (a UserError naming it)."""
        assert spec.infer is not None
        column_swap.check_inputs(spec.infer.outputs, task.decoder(train=False).columns, spec.task.name)

    def check_before(self, spec: JobSpec) -> None:
        """The task's inputs against the outputs: one error here, not one per rank."""
        self.check_inputs(spec, loading.load_task(spec))

    def compute(self, compute: Compute, on_device: Batch, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The outputs, with infer.on_error for a batch that raises (then row by row)."""
        rows = len(offsets)
        return compute.errors.run(
            rows,
            lambda: (compute.outputs(on_device), np.ones(rows, bool)),
            lambda row: (compute.outputs({name: value[row : row + 1] for name, value in on_device.items()}), np.ones(1, bool)),
            lambda row: compute.name_row(int(offsets[row])),
        )

    def record(self, spec: JobSpec, plan: ColumnPlan, index: int, rows: FragmentRows, errors: RowErrors) -> FragmentRecord:
        """The fragment's new column file written, and how many rows were unreadable or skipped."""
        assert spec.infer is not None
        try:
            record = new_columns.write_fragment(
                plan, index, new_columns.expand(rows, plan.fragments[index].rows, spec.infer.outputs)
            )
        except Exception as error:
            errors.reraise(error)
        record.unreadable, record.skipped = rows.unreadable, errors.fragment_done()
        return record


def run_infer(spec: JobSpec, env: DistEnv, preemption: Preemption, requeue: Requeue, work: ModelPass) -> Summary:
    """This rank's fragments through ``work``; on rank 0 also the wait for the others, the commit
    or the report (:mod:`lance_hpc.writeback.steps`)."""
    assert spec.infer is not None
    device = select_device(env)
    configure_process(spec.train.seed, False, env, device)
    run = steps.begin(spec, env, preemption)
    if run is None:
        return Summary("completed", 0, 0, None)
    if spec.data.num_workers > 0:  # there is work: the workers' server imports torch while the model and plan load
        loading.worker_context()
    task = loading.load_task(spec)
    work.check_inputs(spec, task)
    model, weights = load_model(spec, task, device, digest=env.is_main)
    run = run.with_weights(weights)
    plan = steps.pin(spec, env, run, preemption)
    if not plan.compute:
        return Summary("completed", 0, 0, None)
    mine = plan.assignment(env.world_size)[env.rank]
    done, already = _work(spec, env, plan, run.records, mine, task, model, infer_function(spec, task), preemption, device, work)
    return steps.finish(spec, env, plan, run, mine, done, already, preemption, requeue, work.report(spec, task, plan))


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
    work: ModelPass,
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
        name_row = partial(row_name, plan.dataset, fragment.id, fragment.start)
        compute = Compute(task, model, infer, spec, device, errors, name_row, work)
        record = work.record(
            spec, plan, index, _fragment_batches(batches, expected, fragment.start, index in plan.probes, compute), errors
        )
        record.rows = plan.rows_selected(index)
        records.write(index, record)
        done.append(index)
        rows_text = (
            f"{record.rows:,} of {fragment.rows:,} rows (infer.filter)" if plan.selected is not None else f"{record.rows:,} rows"
        )
        print(f"rank {env.rank}: fragment {fragment.id}: {rows_text} in {record.seconds:.1f} s", flush=True)
    return done, already


class FragmentRows:
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
class Compute:
    """What a batch on the device goes through: ``work``'s computation with the model or
    infer.function, the task and infer.on_error (name_row: a row of the fragment by its offset there)."""

    task: Task
    model: nn.Module | None
    infer: Infer
    spec: JobSpec
    device: torch.device
    errors: RowErrors
    name_row: Callable[[int], str]
    work: ModelPass

    def __call__(self, on_device: Batch, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch's outputs and which of its rows have them (not those that raised, with skip)."""
        return self.work.compute(self, on_device, offsets)

    def outputs(self, on_device: Batch) -> dict[str, np.ndarray]:
        """What the model or infer.function gives for the batch, as numpy arrays."""
        return as_numpy(self.infer(self.model, on_device))


def as_numpy(outputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        name: value.float().cpu().numpy() if value.is_floating_point() else value.cpu().numpy() for name, value in outputs.items()
    }


def _fragment_batches(
    batches: Iterator[Batch], expected: Iterator[np.ndarray], start: int, probe: bool, compute: Compute
) -> FragmentRows:
    def produce() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]]:
        for rows in expected:
            batch = next(batches)
            readable = batch[ROW_ID].numpy() == rows
            with torch.inference_mode(), precision_context(compute.spec.train, compute.device):
                outputs, computed = compute(compute.task.to_device(batch, compute.device), rows - start)
            yield outputs, readable, computed, rows - start

    return FragmentRows(produce(), probe)


def check_infer(spec: JobSpec, work: ModelPass, world_size: int | None = None) -> str:
    """Before any rank starts: the dataset, the columns and the checkpoint checked (and ``work``'s
    own check); the work in a few lines, no model loaded (:func:`lance_hpc.writeback.steps.check`)."""
    return steps.check(spec, world_size, lambda: work.check_before(spec))
