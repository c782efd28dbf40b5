"""Tasks by name: ``task.name`` in a spec is a registered name (:data:`TASKS`) or an import path to
a :class:`~lance_hpc.tasks.base.Task` subclass (``my_pkg.tasks:MyTask``, ``path/to/file.py:MyTask``).
Registered tasks are imported only when used, so naming one costs nothing, and a registered task's
options are checked against their model in :mod:`lance_hpc.tasks.options` without importing the task
(nor torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.tasks.options import TaskOptions

if TYPE_CHECKING:
    from lance_hpc.tasks.base import DatasetInfo, Task

TASKS: dict[str, str] = {
    "image_classification": "lance_hpc.tasks.image:ImageClassification",
    "language_model": "lance_hpc.tasks.language:LanguageModel",
    "columns": "lance_hpc.tasks.columns:Columns",  # decodes the named columns for an entry's own model
}
# Each registered task's Options (the same class as its ``Options``, which a test checks).
OPTIONS: dict[str, str] = {
    "image_classification": "lance_hpc.tasks.options:ImageOptions",
    "language_model": "lance_hpc.tasks.options:LanguageModelOptions",
    "columns": "lance_hpc.tasks.options:ColumnsOptions",
}

# What each registered task's infer() gives (the same as its class's ``outputs``, which a test
# checks): infer.outputs is checked against them before anything runs, without importing torch.
OUTPUTS: dict[str, tuple[str, ...]] = {
    "image_classification": ("embedding", "logits", "predicted", "score", "loss"),
    "language_model": (),
    "columns": (),
}


def task_outputs(name: str) -> tuple[str, ...]:
    """The outputs the task ``task.name`` names gives: a registered task's without importing it, a
    user's from its class (importing its module, which runs its code; no model is built)."""
    return OUTPUTS[name] if name in OUTPUTS else task_class(name).outputs


def task_class(name: str) -> type[Task]:
    """The Task class a spec's ``task.name`` names; a UserError that lists the choices otherwise."""
    from lance_hpc.tasks.base import Task  # torch: only where a task is built, or a user's checked

    if name in TASKS:
        found = load_callable(TASKS[name], "task.name")
    elif is_import_path(name):
        found = load_callable(name, "task.name")
    else:
        raise UserError(
            f"task.name: unknown task {name!r}\n  fix: use one of: {', '.join(TASKS)}, "
            "or an import path to your Task class (my_pkg.tasks:MyTask or path/to/file.py:MyTask)"
        )
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise UserError(
            f"task.name: {name!r} is not a subclass of lance_hpc.tasks.Task\n"
            "  fix: subclass lance_hpc.tasks.Task (see docs/tasks.md)"
        )
    return found


def options_class(name: str) -> type[TaskOptions]:
    """The options model of the task ``task.name`` names: a registered task's without importing it,
    a user's task from its class (importing its module, which runs its code)."""
    if name in OPTIONS:
        found = load_callable(OPTIONS[name], "task.name")
        assert isinstance(found, type) and issubclass(found, TaskOptions)
        return found
    return task_class(name).Options


def validate_options(
    options_model: type[TaskOptions], options: Mapping[str, Any]
) -> tuple[TaskOptions | None, list[ValidationError]]:
    """The task's options, or the pydantic error to report under ``task.options``."""
    try:
        return options_model.model_validate(dict(options)), []
    except ValidationError as error:
        return None, [error]


def build_task(name: str, options: Mapping[str, Any], train: DatasetInfo, val: DatasetInfo | None) -> Task:
    """The rank half of a task, checked against its datasets (raises TaskError listing problems)."""
    cls = task_class(name)
    if hasattr(cls, "load_weights"):  # the hook weights_file() replaced: lance_hpc would never call it
        raise UserError(
            f"task.name: {name} defines load_weights(model), which lance_hpc no longer calls\n"
            "  fix: return the weights file's path from weights_file() instead; lance_hpc loads it "
            "(a state dict saved with torch.save, or a lance_hpc checkpoint)"
        )
    validated, errors = validate_options(cls.Options, options)
    if errors:
        raise UserError(f"task.options: {errors[0]}")
    return cls(validated, train, val)
