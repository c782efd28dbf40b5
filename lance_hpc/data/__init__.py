"""Lance data layer: ingest, planning, map-style and iterable loading strategies, decode, storage.

The trainer uses :func:`ensure_dataset`, :func:`build_train_loader`, :func:`build_eval_loader` and
:func:`dataset_info`, and :func:`worker_context` to start the worker server early; the command line
:func:`plan_data` and :func:`preflight`.
"""

from lance_hpc.data.ingest import ensure_dataset
from lance_hpc.data.loader import (
    EvalLoader,
    TrainLoader,
    build_eval_loader,
    build_train_loader,
    dataset_info,
    load_task,
)
from lance_hpc.data.plan import plan_data, preflight
from lance_hpc.data.sampling import DataPlan
from lance_hpc.data.workers import worker_context

__all__ = [
    "DataPlan",
    "EvalLoader",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "dataset_info",
    "load_task",
    "ensure_dataset",
    "plan_data",
    "preflight",
    "worker_context",
]
