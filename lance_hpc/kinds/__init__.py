"""Job kinds by name: what the ranks of a job run, and what launch, dry run and status ask of it.

``job`` in a spec is a registered name (:data:`KINDS`) or an import path to a :class:`JobKind`
subclass (``my_pkg.kinds:CountRows``, ``path/to/file.py:CountRows``), as ``task.name`` is for
tasks. Launch, status, the dry run and the rank ask the kind; none of them branches on its name,
so a new kind is one module here (or in the user's own code) and one line in :data:`KINDS`.
Registered kinds are imported only when used: ``import lance_hpc.kinds`` costs nothing, and a
login-node command (status, dry run) loads only what the kind's method itself needs. The spec
validates ``job`` against :data:`KINDS` (:func:`lance_hpc.spec.rules.job_problems`, which also
checks the registry against the names the spec documents), so this package imports no spec code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class JobKind:
    """One kind of job. Subclass it, set ``name``, and implement :meth:`run`; the other methods
    have defaults that suit a kind without a data plan or progress of its own."""

    #: the name that ``lance-hpc status`` and the messages show (a registered kind's spec name)
    name: str = "custom"
    #: whether USR1 records a profiler trace of its steps; the other kinds ignore USR1, which
    #: ``scancel --signal=USR1`` sends to every process of the job and would otherwise end it
    profiled: bool = False

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """Before any rank starts, on the launching machine: fail early, return the lines to print (nproc: local ranks, or None under SLURM)."""
        return []

    def plan(self, spec: JobSpec, source: str) -> str:
        """The data plan a dry run prints: what the ranks would read or write, without doing it."""
        return f"job: {self.name} shows no data plan"

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """What each rank runs; ``signals`` stop it (see lance_hpc.runtime.preemption), ``requeue`` puts the job back in the queue."""
        raise NotImplementedError(f"{type(self).__name__}.run")

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The progress lines ``lance-hpc status`` prints from what the job left behind; None: the training lines."""
        return None


# The built-in kinds, each in its own module, imported when a spec names it.
KINDS: dict[str, str] = {
    "train": "lance_hpc.kinds.train:Train",
    "ingest": "lance_hpc.kinds.ingest:Ingest",
    "infer": "lance_hpc.kinds.infer:Infer",
    "evaluate": "lance_hpc.kinds.infer:Evaluate",
    "map": "lance_hpc.kinds.map:Map",
}

KIND_ADVICE = (
    f"use one of: {', '.join(KINDS)}, or an import path to your JobKind subclass (my_pkg.kinds:MyKind or path/to/file.py:MyKind)"
)


def job_kind(name: str) -> JobKind:
    """The kind a spec's ``job`` names, ready to use; a UserError that lists the choices otherwise."""
    if name in KINDS:
        found = load_callable(KINDS[name], "job")
    elif is_import_path(name):
        found = load_callable(name, "job")
    else:
        raise UserError(f"job: unknown job kind {name!r}\n  fix: {KIND_ADVICE}")
    if not (isinstance(found, type) and issubclass(found, JobKind)):
        raise UserError(
            f"job: {name!r} is not a subclass of lance_hpc.JobKind\n  fix: subclass lance_hpc.JobKind (docs/tasks.md, Job kinds of your own)"
        )
    return found()


def registered_kind(name: str) -> JobKind | None:
    """The kind when ``name`` is registered; None for an import path, whose code a reader of
    someone else's job (status) must not run."""
    return job_kind(name) if name in KINDS else None


__all__ = ["KINDS", "JobKind", "job_kind", "registered_kind"]
