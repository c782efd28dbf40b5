"""lance_hpc: DDP training of PyTorch models on Lance datasets across SLURM clusters.

The public face: the names your own code needs, importable from here (``from lance_hpc import
Context``) and listed on the docs page "Tasks and script mode", section "Public API".

- A task (``task.name: my_pkg.tasks:MyTask``): :class:`Task` and its :class:`TaskOptions`, the
  worker half :class:`Decoder` with the :class:`FieldSpec` of each field it fills in a
  :data:`Batch`, the :class:`DatasetInfo` it checks its options against, and
  :class:`TaskError` / :func:`column_problems` to report what does not match.
- A training loop of your own (``entry: my_pkg.train:main``): :class:`Context`.
- A training script of your own, launched by anything (torchrun, Lightning, Accelerate):
  :class:`Loader`, the trainer's data loader with a resumable state.
- A job kind of your own (``job: my_pkg.kinds:MyKind``): :class:`JobKind`, which gets the
  :class:`JobSpec` and this rank's :class:`DistEnv`, joins the ranks with
  :func:`process_group`, may create the dataset with :func:`ensure_dataset`, and returns a
  :class:`Summary`; the :class:`Problem` entries it finds in a spec are reported at validation.
- An ingest format of your own (``lance-hpc ingest 'my_formats.py:CsvRows:/data/*.csv' out.lance``):
  :class:`ShardFormat`, which lists a source's shards and reads each as Arrow record batches.
- :class:`UserError`: raise it with the fix in its message, and lance_hpc prints that message
  instead of a traceback.

Everything else stays importable from its own module (``lance_hpc.spec.load_spec``,
``lance_hpc.loading.plan_data``, ...), without the promise that it keeps its name. Each name here is
loaded from its module when first used, so ``import lance_hpc`` (and every command that only
reads a spec or the queue) does not pay for torch and Lance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports
from lance_hpc.quiet import quiet_dependencies

__version__ = "0.1.0"
quiet_dependencies()

_PUBLIC: dict[str, tuple[str, ...]] = {
    "lance_hpc.tasks": (
        "Batch",
        "DatasetInfo",
        "Decoder",
        "FieldSpec",
        "Task",
        "TaskError",
        "TaskOptions",
        "column_problems",
    ),
    "lance_hpc.loading.library": ("Loader",),
    "lance_hpc.runtime.context": ("Context", "Summary"),
    "lance_hpc.runtime.environment": ("DistEnv", "process_group"),
    "lance_hpc.kinds": ("JobKind",),
    "lance_hpc.spec": ("JobSpec", "Problem"),
    "lance_hpc.ingest": ("ensure_dataset",),
    "lance_hpc.ingest.formats": ("ShardFormat",),
    "lance_hpc.errors": ("UserError",),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = [
    "Batch",
    "Context",
    "DatasetInfo",
    "Decoder",
    "DistEnv",
    "FieldSpec",
    "JobKind",
    "JobSpec",
    "Loader",
    "Problem",
    "ShardFormat",
    "Summary",
    "Task",
    "TaskError",
    "TaskOptions",
    "UserError",
    "column_problems",
    "ensure_dataset",
    "process_group",
]

if TYPE_CHECKING:
    from lance_hpc.errors import UserError
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.ingest.formats import ShardFormat
    from lance_hpc.kinds import JobKind
    from lance_hpc.loading.library import Loader
    from lance_hpc.runtime.context import Context, Summary
    from lance_hpc.runtime.environment import DistEnv, process_group
    from lance_hpc.spec import JobSpec, Problem
    from lance_hpc.tasks import (
        Batch,
        DatasetInfo,
        Decoder,
        FieldSpec,
        Task,
        TaskError,
        TaskOptions,
        column_problems,
    )


__getattr__ = lazy_exports(__name__, _MODULE_OF)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
