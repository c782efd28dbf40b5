"""Tasks by name: ``task.name`` in a spec is a registered name (:data:`TASKS`) or an import path to
a :class:`~lance_hpc.tasks.base.Task` subclass (``my_pkg.tasks:MyTask``, ``path/to/file.py:MyTask``).
Registered tasks are imported only when used, so naming one costs nothing.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.tasks.base import DatasetInfo, Task, TaskOptions

TASKS: dict[str, str] = {
    "image_classification": "lance_hpc.tasks.image:ImageClassification",
    "language_model": "lance_hpc.tasks.language:LanguageModel",
}


def task_class(name: str) -> type[Task]:
    """The Task class a spec's ``task.name`` names; a UserError that lists the choices otherwise."""
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


def validate_options(cls: type[Task], options: Mapping[str, Any]) -> tuple[TaskOptions | None, list[ValidationError]]:
    """The task's options, or the pydantic error to report under ``task.options``."""
    try:
        return cls.Options.model_validate(dict(options)), []
    except ValidationError as error:
        return None, [error]


def build_task(name: str, options: Mapping[str, Any], train: DatasetInfo, val: DatasetInfo | None) -> Task:
    """The rank half of a task, checked against its datasets (raises TaskError listing problems)."""
    cls = task_class(name)
    validated, errors = validate_options(cls, options)
    if errors:
        raise UserError(f"task.options: {errors[0]}")
    return cls(validated, train, val)
