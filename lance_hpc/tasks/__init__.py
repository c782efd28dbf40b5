"""Tasks by name: what is trained, from which columns, with which model, loss and metrics.

``task.name`` in a spec is a registered name (:data:`TASKS`) or an import path to a
:class:`~lance_hpc.tasks.base.Task` subclass (``my_pkg.tasks:MyTask``, ``path/to/file.py:MyTask``).
Each name here is loaded from its module when first used: naming the package costs nothing, and
ingest reads the datasets' formats (:mod:`lance_hpc.tasks.formats`) without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports

_MODULE_OF = {
    **dict.fromkeys(
        ("ROW_ID", "Batch", "DatasetInfo", "Decoder", "FieldSpec", "Task", "TaskError", "column_problems"),
        "lance_hpc.tasks.base",
    ),
    "TaskOptions": "lance_hpc.tasks.options",
    **dict.fromkeys(("TASKS", "build_task", "options_class", "task_class", "validate_options"), "lance_hpc.tasks.registry"),
}

__all__ = [
    "ROW_ID",
    "TASKS",
    "Batch",
    "DatasetInfo",
    "Decoder",
    "FieldSpec",
    "Task",
    "TaskError",
    "TaskOptions",
    "build_task",
    "column_problems",
    "options_class",
    "task_class",
    "validate_options",
]

__getattr__ = lazy_exports(__name__, _MODULE_OF)

if TYPE_CHECKING:
    from lance_hpc.tasks.base import (
        ROW_ID,
        Batch,
        DatasetInfo,
        Decoder,
        FieldSpec,
        Task,
        TaskError,
        column_problems,
    )
    from lance_hpc.tasks.options import TaskOptions
    from lance_hpc.tasks.registry import TASKS, build_task, options_class, task_class, validate_options
