"""``job: evaluate``'s pass over the fragments (:class:`Evaluation`): the task's metric sums per
fragment, recorded instead of a column, and on rank 0 the metrics from every fragment's sums,
printed, to TensorBoard and to a JSON file. The run around it is :func:`lance_hpc.writeback.job.run_infer`'s."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lance_hpc.runtime.metrics import build_logger
from lance_hpc.spec import JobSpec
from lance_hpc.storage.files import write_file
from lance_hpc.tasks import Task
from lance_hpc.tasks.base import Batch
from lance_hpc.writeback.job import Compute, FragmentRows, ModelPass, as_numpy
from lance_hpc.writeback.new_columns import ColumnPlan, FragmentRecord
from lance_hpc.writeback.row_errors import RowErrors


class Evaluation(ModelPass):
    """A checkpoint's metrics on data.uri: each fragment's sums, then one report; no column written."""

    def compute(self, compute: Compute, on_device: Batch, offsets: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The task's metric sums over the batch (every row counts)."""
        assert compute.model is not None  # job: evaluate needs a checkpoint
        sums = compute.task.forward(compute.model, on_device)[1].double()
        return as_numpy({"sums": sums}), np.ones(len(offsets), bool)

    def record(self, spec: JobSpec, plan: ColumnPlan, index: int, rows: FragmentRows, errors: RowErrors) -> FragmentRecord:
        """The fragment's sums, a probe's left out: its rows are outside the filter."""
        started = time.monotonic()
        total: np.ndarray | None = None
        for outputs, _, _ in rows:
            if index not in plan.probes:
                total = outputs["sums"] if total is None else total + outputs["sums"]
        sums = [] if total is None else total.tolist()
        fragment = plan.fragments[index]
        return FragmentRecord(
            fragment.id, fragment.rows, sums={str(i): value for i, value in enumerate(sums)}, seconds=time.monotonic() - started
        )

    def report(
        self, spec: JobSpec, task: Task, plan: ColumnPlan
    ) -> Callable[[dict[int, FragmentRecord]], dict[str, float]] | None:
        """The metrics from every fragment's sums."""
        return lambda finished: report(spec, task, plan, finished)


def report(spec: JobSpec, task: Task, plan: ColumnPlan, finished: dict[int, FragmentRecord]) -> dict[str, float]:
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
