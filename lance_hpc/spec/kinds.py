"""The job kinds ``job`` names, as the spec knows them: the registry (:data:`KINDS`; a kind of the
user's own is an import path instead, ``my_pkg.kinds:CountRows`` or ``path/to/file.py:CountRows``),
and :class:`JobKindBase`, the half of a kind that reads nothing but a spec: its name, the check
before any rank starts, the plan a dry run prints, the progress status shows.

Validation resolves ``job`` here (:func:`kind_class`), so a name that is not a kind is one problem
among the spec's others. The rank's half, ``run``, takes the runtime, which takes the spec, so it
cannot be here: :class:`lance_hpc.kinds.JobKind` adds it, and is the class a kind subclasses.
Registered kinds are imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable

if TYPE_CHECKING:
    from lance_hpc.spec.schema import JobSpec


class JobKindBase:
    """What launch, the dry run and status ask of a kind, from its spec alone; the defaults suit a
    kind without a data plan or progress of its own."""

    #: the name that ``lance-hpc status`` and the messages show (a registered kind's spec name)
    name: str = "custom"
    #: whether USR1 records a profiler trace of its steps; the other kinds ignore USR1, which
    #: ``scancel --signal=USR1`` sends to every process of the job and would otherwise end it
    profiled: bool = False
    #: whether its ranks train on data.uri: ``lance-hpc plan`` then shows how an epoch's rows split
    #: over them; for the other kinds it shows :meth:`plan`, what their ranks would read or write
    trains: bool = False

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """Before any rank starts, on the launching machine: fail early, return the lines to print (nproc: local ranks, or None under SLURM)."""
        return []

    def plan(self, spec: JobSpec, source: str) -> str:
        """The data plan a dry run prints: what the ranks would read or write, without doing it."""
        return f"job: {self.name} shows no data plan"

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The progress lines ``lance-hpc status`` prints from what the job left behind; None: the training lines."""
        return None


# The built-in kinds, each in its own module of lance_hpc.kinds, imported when a spec names it.
KINDS: dict[str, str] = {
    "train": "lance_hpc.kinds.train:Train",
    "ingest": "lance_hpc.kinds.ingest:Ingest",
    "infer": "lance_hpc.kinds.infer:Infer",
    "evaluate": "lance_hpc.kinds.infer:Evaluate",
    "map": "lance_hpc.kinds.map:Map",
    "command": "lance_hpc.kinds.command:Command",
}

# The built-in kinds whose ranks read through DataLoader workers: ``python -m lance_hpc.run`` starts
# their workers' server before anything else (lance_hpc.loading.worker_server); another kind's rank
# starts it when it first builds a loader, if it ever does.
READS_WITH_WORKERS = frozenset({"train", "infer", "evaluate"})

KIND_ADVICE = (
    f"use one of: {', '.join(KINDS)}, or an import path to your JobKind subclass (my_pkg.kinds:MyKind or path/to/file.py:MyKind)"
)

Kind = TypeVar("Kind", bound=JobKindBase)


def kind_class(name: str, base: type[Kind]) -> type[Kind]:
    """The class a spec's ``job`` names, a subclass of ``base``; a UserError that lists the choices otherwise."""
    if name in KINDS:
        found = load_callable(KINDS[name], "job")
    elif is_import_path(name):
        found = load_callable(name, "job")
    else:
        raise UserError(f"job: unknown job kind {name!r}\n  fix: {KIND_ADVICE}")
    if not (isinstance(found, type) and issubclass(found, base)):
        raise UserError(
            f"job: {name!r} is not a subclass of lance_hpc.JobKind\n  fix: subclass lance_hpc.JobKind (docs/tasks.md, Job kinds of your own)"
        )
    return found
