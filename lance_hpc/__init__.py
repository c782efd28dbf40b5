"""lance_hpc: DDP training of PyTorch models on Lance datasets across SLURM clusters.

The public API (docs/tasks.md, "Public API") is importable from here. Each name is loaded
from its module when first used, so ``import lance_hpc`` (and every command that only reads a spec
or the queue) does not pay for torch and Lance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports
from lance_hpc.quiet import quiet_dependencies

__version__ = "0.1.0"
quiet_dependencies()

_PUBLIC: dict[str, tuple[str, ...]] = {
    "lance_hpc.runtime.context": ("Context", "Summary"),
    "lance_hpc.runtime.step_loop": ("Preempted",),
    "lance_hpc.runtime.entry": ("run_entry",),
    "lance_hpc.runtime.environment": ("DistEnv", "process_group"),
    "lance_hpc.kinds": ("JobKind",),
    "lance_hpc.tasks": (
        "ROW_ID",
        "TASKS",
        "Batch",
        "DatasetInfo",
        "Decoder",
        "FieldSpec",
        "Task",
        "TaskError",
        "TaskOptions",
        "column_problems",
        "task_class",
    ),
    "lance_hpc.loading": (
        "EvalLoader",
        "TrainLoader",
        "build_eval_loader",
        "build_train_loader",
        "dataset_info",
        "load_task",
        "plan_data",
        "preflight",
    ),
    "lance_hpc.ingest": ("ensure_dataset",),
    "lance_hpc.spec": ("JobSpec", "SpecError", "load_spec", "validate_spec"),
    "lance_hpc.errors": ("ExitCode", "UserError"),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = [
    "Batch",
    "Context",
    "DatasetInfo",
    "Decoder",
    "DistEnv",
    "EvalLoader",
    "ExitCode",
    "FieldSpec",
    "JobKind",
    "JobSpec",
    "Preempted",
    "ROW_ID",
    "SpecError",
    "Summary",
    "TASKS",
    "Task",
    "TaskError",
    "TaskOptions",
    "TrainLoader",
    "UserError",
    "build_eval_loader",
    "build_train_loader",
    "column_problems",
    "dataset_info",
    "ensure_dataset",
    "load_spec",
    "load_task",
    "plan_data",
    "preflight",
    "process_group",
    "run_entry",
    "task_class",
    "validate_spec",
]

if TYPE_CHECKING:
    from lance_hpc.errors import ExitCode, UserError
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.kinds import JobKind
    from lance_hpc.loading import (
        EvalLoader,
        TrainLoader,
        build_eval_loader,
        build_train_loader,
        dataset_info,
        load_task,
        plan_data,
        preflight,
    )
    from lance_hpc.runtime.context import Context, Summary
    from lance_hpc.runtime.entry import run_entry
    from lance_hpc.runtime.environment import DistEnv, process_group
    from lance_hpc.runtime.step_loop import Preempted
    from lance_hpc.spec import JobSpec, SpecError, load_spec, validate_spec
    from lance_hpc.tasks import (
        ROW_ID,
        TASKS,
        Batch,
        DatasetInfo,
        Decoder,
        FieldSpec,
        Task,
        TaskError,
        TaskOptions,
        column_problems,
        task_class,
    )


__getattr__ = lazy_exports(__name__, _MODULE_OF)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
