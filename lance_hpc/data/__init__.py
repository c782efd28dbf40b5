"""Lance data layer: ingest, planning, map-style and iterable loading strategies, decode, storage.

The trainer uses :func:`ensure_dataset`, :func:`build_train_loader`, :func:`build_eval_loader` and
:func:`dataset_info`, and :func:`worker_context` to start the worker server early; the command line
:func:`plan_data` and :func:`preflight`. Each name is loaded from its module when first used, so an
ingest worker (``lance_hpc.data.shard_ingest``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports

_MODULE_OF = {
    "ensure_dataset": "lance_hpc.data.ingest",
    "EvalLoader": "lance_hpc.data.loader",
    "MixLoader": "lance_hpc.data.loader",
    "TrainLoader": "lance_hpc.data.loader",
    "build_eval_loader": "lance_hpc.data.loader",
    "build_train_loader": "lance_hpc.data.loader",
    "dataset_info": "lance_hpc.data.loader",
    "load_task": "lance_hpc.data.loader",
    "plan_data": "lance_hpc.data.plan",
    "preflight": "lance_hpc.data.plan",
    "check_selection": "lance_hpc.data.plan",
    "DataPlan": "lance_hpc.data.sampling",
    "worker_context": "lance_hpc.data.workers",
}

__all__ = [
    "DataPlan",
    "EvalLoader",
    "MixLoader",
    "TrainLoader",
    "build_eval_loader",
    "build_train_loader",
    "check_selection",
    "dataset_info",
    "ensure_dataset",
    "load_task",
    "plan_data",
    "preflight",
    "worker_context",
]


__getattr__ = lazy_exports(__name__, _MODULE_OF)


if TYPE_CHECKING:
    from lance_hpc.data.ingest import ensure_dataset
    from lance_hpc.data.loader import (
        EvalLoader,
        MixLoader,
        TrainLoader,
        build_eval_loader,
        build_train_loader,
        dataset_info,
        load_task,
    )
    from lance_hpc.data.plan import check_selection, plan_data, preflight
    from lance_hpc.data.sampling import DataPlan
    from lance_hpc.data.workers import worker_context
