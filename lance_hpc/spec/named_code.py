"""The code a spec names besides its kind (:mod:`~lance_hpc.spec.kinds`): the task (``task.name``,
its options checked against the task's ``Options``) and the entry (``entry``, with its
``entry_options``), each a registered name or an import path; and the entry's options as
``ctx.options`` gives them back."""

from __future__ import annotations

import json
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.spec.problems import Problem, from_pydantic


def task_problems(raw: dict[str, Any], imports: bool = True) -> list[Problem]:
    """Check task.name resolves to a Task class and task.options against its Options; on success
    the options in ``raw`` are replaced by the validated ones, defaults filled in. Without
    ``imports``, only that task.name is a registered name or has the form of an import path:
    importing it would run its code."""
    from lance_hpc.tasks.registry import TASKS, options_class, validate_options

    task = raw.get("task")
    if task is None:
        task = raw["task"] = {}
    if not isinstance(task, dict) or not isinstance(task.get("name", ""), str):
        return []  # the schema reports the wrong type
    if task.get("name") == "columns" and not raw.get("entry"):
        return [
            Problem(
                "task.name",
                "task columns only decodes rows: it has no model, loss or metrics for the built-in trainer",
                "set entry: path/to/train.py:main (your own loop, which brings its model), or name a task that has a model",
            )
        ]
    if not imports:
        name = task.get("name", "image_classification")
        if name in TASKS or is_import_path(name):
            return []
        return [
            Problem(
                "task.name",
                f"unknown task {name!r}",
                f"use one of: {', '.join(TASKS)}, or an import path to "
                "your Task class (my_pkg.tasks:MyTask or path/to/file.py:MyTask)",
            )
        ]
    try:
        model = options_class(task.get("name", "image_classification"))
    except UserError as error:
        return [problem_from_user_error("task.name", error)]
    options = task.get("options") or {}
    if not isinstance(options, dict):
        return []
    validated, errors = validate_options(model, options)
    if validated is None:
        return [from_pydantic(item, model, ("task", "options")) for error in errors for item in error.errors()]
    task["options"] = validated.model_dump(mode="json")
    return []


def entry_problems(raw: dict[str, Any], imports: bool = True) -> list[Problem]:
    """Script mode: the entry must import and be callable, and ``entry_options`` fit its ``Options``
    model when it declares one (on success they are replaced by the validated ones, defaults filled
    in); without ``imports``, the entry need only have the form of an import path."""
    entry = raw.get("entry")
    options = raw.get("entry_options")
    if not isinstance(entry, str):
        if options and entry is None:
            return [
                Problem(
                    "entry_options",
                    "set, but there is no entry to take them (the built-in trainer has none)",
                    "name your function in entry: my_pkg.train:main, or remove entry_options",
                )
            ]
        return []
    if not imports:
        if is_import_path(entry):
            return []
        return [Problem("entry", f"{entry!r} is not an import path", "write package.module:Name or path/to/file.py:Name")]
    try:
        function = load_callable(entry, "entry")
    except UserError as error:
        return [problem_from_user_error("entry", error)]
    model = entry_options_model(function)
    if model is None or not isinstance(options, dict):
        return []  # any mapping is the entry's to read (the schema reports one that is not a mapping)
    try:
        raw["entry_options"] = model.model_validate(options).model_dump(mode="json")
    except ValidationError as error:
        return [from_pydantic(item, model, ("entry_options",)) for item in error.errors()]
    return []


def entry_options_model(function: Any) -> type[BaseModel] | None:
    """The pydantic model an entry declares for its options (``main.Options = MyOptions``), if any."""
    model = getattr(function, "Options", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def entry_options(function: Any, validated: Mapping[str, Any]) -> Any:
    """``ctx.options``: a loaded spec's ``entry_options``, which :func:`entry_problems` validated and
    replaced by the JSON dump of the entry's ``Options`` model, as an instance of that model again;
    the plain mapping when the entry declares none."""
    model = entry_options_model(function)
    if model is None:
        return dict(validated)
    # Read back in JSON mode, the inverse of that dump: it restores what the dump wrote as JSON
    # (a Path, a tuple, a nested model), which model_construct would leave as strings, lists and
    # dicts, and which a python-mode validate of a strict model would refuse.
    return model.model_validate_json(json.dumps(validated))


def problem_from_user_error(path: str, error: UserError) -> Problem:
    """A UserError about the code at ``path`` as one problem of the spec, its message without the path it repeats."""
    message, _, fix = str(error).partition("\n  fix: ")
    prefix = f"{path}: "
    return Problem(path, message[len(prefix) :] if message.startswith(prefix) else message, fix)
