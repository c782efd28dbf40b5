"""Loading: batches of a Lance dataset for every rank, planned from metadata (map-style and
iterable strategies, filters, tags, mixes), read and decoded in DataLoader workers.

The trainer uses :func:`build_train_loader`, :func:`build_eval_loader` and :func:`dataset_info`,
and :func:`worker_context` to start the worker server early; the command line :func:`plan_data` and
:func:`preflight`. Each name is loaded from its module when first used, so naming the package
costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports

_MODULE_OF = {
    "EvalLoader": "lance_hpc.loading.loader",
    "MixLoader": "lance_hpc.loading.loader",
    "TrainLoader": "lance_hpc.loading.loader",
    "build_eval_loader": "lance_hpc.loading.loader",
    "build_train_loader": "lance_hpc.loading.loader",
    "dataset_info": "lance_hpc.loading.loader",
    "load_task": "lance_hpc.loading.loader",
    "plan_data": "lance_hpc.loading.plan",
    "preflight": "lance_hpc.loading.plan",
    "check_selection": "lance_hpc.loading.plan",
    "DataPlan": "lance_hpc.loading.epoch_plan",
    "worker_context": "lance_hpc.loading.workers",
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
    "load_task",
    "plan_data",
    "preflight",
    "worker_context",
]


__getattr__ = lazy_exports(__name__, _MODULE_OF)


if TYPE_CHECKING:
    from lance_hpc.loading.epoch_plan import DataPlan
    from lance_hpc.loading.loader import (
        EvalLoader,
        MixLoader,
        TrainLoader,
        build_eval_loader,
        build_train_loader,
        dataset_info,
        load_task,
    )
    from lance_hpc.loading.plan import check_selection, plan_data, preflight
    from lance_hpc.loading.workers import worker_context
