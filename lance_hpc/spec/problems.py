"""How a spec reports what is wrong: :class:`Problem` (where, what, how to fix it) and
:class:`SpecError` (all of them at once), and pydantic's errors translated into problems."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ValidationError

from lance_hpc.errors import UserError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"  {self.path or '<spec>'}: {self.message}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


class SpecError(UserError):
    """Every problem found in a spec, reported together."""

    def __init__(self, source: str, problems: Sequence[Problem]):
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        header = f"{source}: {count} problem{'s' if count != 1 else ''} in the job spec"
        super().__init__("\n".join([header, *map(str, self.problems)]))


def section_of(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``raw[name]`` when it is a mapping, else empty: rules over a raw spec run even when a section is malformed."""
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def unique(problems: Sequence[Problem]) -> list[Problem]:
    seen, result = set(), []
    for problem in problems:
        key = (problem.path, problem.message)
        if key not in seen:
            seen.add(key)
            result.append(problem)
    return result


def _model_at(root: type[BaseModel], location: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in location:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}


def from_pydantic(item: Mapping[str, Any], root: type[BaseModel], prefix: Sequence[str] = ()) -> Problem:
    """A pydantic error of ``root`` (validated at YAML path ``prefix``) as a Problem."""
    location = list(item["loc"])
    path = ".".join(str(part) for part in [*prefix, *location])
    kind = item["type"]
    value = item.get("input")
    context = item.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _model_at(root, location[:-1])
        valid = sorted(parent.model_fields) if parent else []
        key = str(location[-1])
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return Problem(path, f"unknown key '{key}'", f"{hint}valid keys: {', '.join(valid)}")
    if kind == "missing":
        return Problem(path, "required key is missing", f"add '{location[-1]}: ...'")
    if kind in ("literal_error", "choice"):
        return Problem(path, f"'{value}' is not a valid choice", f"use one of: {context.get('expected', '')}")
    if kind in BOUNDS:
        bound, limit = BOUNDS[kind], next(iter(context.values()), "")
        return Problem(path, f"must be {bound} {limit}, got {value!r}", f"set a value {bound} {limit}")
    if kind == "finite_number":
        return Problem(path, f"must be a finite number, got {value!r}", "write a number, not .inf or .nan")
    if kind == "string_too_short":
        return Problem(path, "must not be empty", f"write a value for '{location[-1]}'")
    if kind == "string_pattern_mismatch":
        return Problem(path, f"{value!r} has characters that are not allowed", "use letters, digits, '.', '_', '-'")
    if kind == "value_error":
        message, _, fix = str(context.get("error", item["msg"])).partition("\n  fix: ")
        return Problem(path, message, fix)
    if kind.endswith("_type") or kind.endswith("_parsing"):
        expected = kind.split("_")[0]
        return Problem(path, f"expected {expected}, got {type(value).__name__} {value!r}", f"write a value of type {expected}")
    return Problem(path, item["msg"])


def option_problems(model: type[BaseModel], values: Mapping[str, Any], **required: Any) -> list[str]:
    """Command-line options checked as the fields of ``model`` of the same names (``--val-fraction``
    as ``val_fraction``), so that a spec and a command line refuse the same values: each refused
    value with its fix (``required``: the model's other required fields, not checked here)."""
    try:
        model(**required, **values)
    except ValidationError as error:
        found = [from_pydantic(item, model) for item in error.errors()]
        return [
            f"--{problem.path.replace('_', '-')} {values.get(problem.path)!r}: {problem.message}\n  fix: {problem.fix}"
            for problem in found
        ]
    return []
