"""The job kinds ``job`` names, as the spec knows them: the registry (:data:`KINDS`, the one list
of kind names; a kind of the user's own is an import path instead, ``my_pkg.kinds:CountRows`` or
``path/to/file.py:CountRows``), each kind by its spec half (:class:`JobKindBase`): what it needs of
a spec and refuses, the check before any rank starts, the plan a dry run prints, the progress
status shows.

Validation resolves ``job`` here (:func:`kind_class`), so a name that is not a kind is one problem
among the spec's others, and asks the kind for its rules (:func:`spec_kind`); nothing in the spec
branches on a kind's name. A registered kind's ranks' half is the :class:`lance_hpc.kinds.JobKind`
subclass in ``lance_hpc.kinds.<name>``, which subclasses the spec half registered here; a kind of
the user's own is one class with both halves.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.spec.kinds.base import DEFAULT_KIND, JobKindBase
from lance_hpc.spec.kinds.builtin import CommandRules, IngestRules, TrainRules
from lance_hpc.spec.kinds.columns import EvaluateRules, InferRules, MapRules
from lance_hpc.spec.named_code import problem_from_user_error
from lance_hpc.spec.problems import Problem

# The built-in kinds by name, each the spec's half of its class in lance_hpc.kinds.<name>.
KINDS: dict[str, type[JobKindBase]] = {
    kind.name: kind for kind in (TrainRules, IngestRules, InferRules, EvaluateRules, MapRules, CommandRules)
}

KIND_ADVICE = (
    f"use one of: {', '.join(KINDS)}, or an import path to your JobKind subclass (my_pkg.kinds:MyKind or path/to/file.py:MyKind)"
)

Kind = TypeVar("Kind", bound=JobKindBase)


def kind_class(name: str, base: type[Kind]) -> type[Kind]:
    """The class an import path in ``job`` names, a subclass of ``base``; a UserError that lists the choices otherwise."""
    if not is_import_path(name):
        raise UserError(f"job: unknown job kind {name!r}\n  fix: {KIND_ADVICE}")
    found = load_callable(name, "job")
    if not (isinstance(found, type) and issubclass(found, base)):
        raise UserError(
            f"job: {name!r} is not a subclass of lance_hpc.JobKind\n  fix: subclass lance_hpc.JobKind (docs/tasks.md, Job kinds of your own)"
        )
    return found


def job_problems(raw: Mapping[str, Any], imports: bool = True) -> list[Problem]:
    """Check ``job`` names a registered kind, or an import path to a JobKind subclass. Without
    ``imports``, only that it is a registered name or has the form of an import path: importing
    it would run its code."""
    name = raw.get("job", DEFAULT_KIND)
    if not isinstance(name, str) or name in KINDS:
        return []  # the schema reports the wrong type
    if not imports:
        return [] if is_import_path(name) else [Problem("job", f"unknown job kind {name!r}", KIND_ADVICE)]
    try:
        kind_class(name, JobKindBase)
    except UserError as error:
        return [problem_from_user_error("job", error)]
    return []


def named_kind(raw: Mapping[str, Any]) -> JobKindBase:
    """The registered kind a spec mapping names: the one a section implies (``command:``), else
    ``job``'s; the defaults of :class:`JobKindBase` for an import path or a name that is no kind."""
    for kind in KINDS.values():
        if kind.implied_by is not None and raw.get(kind.implied_by) is not None:
            return kind()
    name = raw.get("job", DEFAULT_KIND)
    return KINDS[name]() if isinstance(name, str) and name in KINDS else JobKindBase()


def spec_kind(raw: Mapping[str, Any], imports: bool = True) -> JobKindBase:
    """The kind whose rules a spec mapping is held to: a registered one (:func:`named_kind`),
    or with ``imports`` the user's class its import path names (its code runs); the defaults of
    :class:`JobKindBase` when that does not load (:func:`job_problems` says why)."""
    kind = named_kind(raw)
    name = raw.get("job")
    if type(kind) is not JobKindBase or not imports or not isinstance(name, str) or not is_import_path(name):
        return kind
    try:
        return kind_class(name, JobKindBase)()
    except UserError:
        return kind


__all__ = ["DEFAULT_KIND", "KINDS", "KIND_ADVICE", "JobKindBase", "job_problems", "kind_class", "named_kind", "spec_kind"]
