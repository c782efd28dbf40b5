"""Job kinds by name: what the ranks of a job run, and what validation, launch, dry run and status ask of it.

``job`` in a spec is a registered name (:data:`~lance_hpc.spec.kinds.KINDS`, the one list of kind
names) or an import path to a :class:`JobKind` subclass (``my_pkg.kinds:CountRows``,
``path/to/file.py:CountRows``), as ``task.name`` is for tasks. Validation, launch, status, the dry
run and the rank ask the kind; none of them branches on its name, so a new kind is one module here
(or in the user's own code). A registered kind ``<name>`` is two halves: its spec half, the
:class:`~lance_hpc.spec.kinds.JobKindBase` subclass registered in the spec (what it needs of a spec
and refuses, which the spec checks without importing this package), and the class in
``lance_hpc.kinds.<name>`` that subclasses it and :class:`JobKind`, adding the rank's half,
``run``, which takes the runtime. Registered kinds are imported only when used: a login-node
command (status, dry run) loads only what the kind's method itself needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lance_hpc.spec.kinds import KINDS, JobKindBase, kind_class

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class JobKind(JobKindBase):
    """One kind of job. Subclass it, set ``name``, and implement :meth:`run`; the rules of
    :class:`~lance_hpc.spec.kinds.JobKindBase` and ``check``, ``plan`` and ``progress`` here have
    defaults that suit a kind that reads no section of its own and has no data plan or progress."""

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """Before any rank starts, on the launching machine: fail early, return the lines to print (nproc: local ranks, or None under SLURM)."""
        return []

    def plan(self, spec: JobSpec, source: str) -> str:
        """The data plan a dry run prints: what the ranks would read or write, without doing it."""
        return f"job: {self.name} shows no data plan"

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The progress lines ``lance-hpc status`` prints from what the job left behind; None: the training lines."""
        return None

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """What each rank runs; ``signals`` stop it (see lance_hpc.runtime.preemption), ``requeue`` puts the job back in the queue."""
        raise NotImplementedError(f"{type(self).__name__}.run")


def job_kind(name: str) -> JobKind:
    """The kind a spec's ``job`` names, ready to use; a UserError that lists the choices otherwise."""
    if name not in KINDS:
        return kind_class(name, JobKind)()
    module = importlib.import_module(f"{__name__}.{name}")
    (found,) = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, JobKind) and issubclass(value, KINDS[name]) and value.name == name
    ]
    return found()


def registered_kind(name: str) -> JobKind | None:
    """The kind when ``name`` is registered; None for an import path, whose code a reader of
    someone else's job (status) must not run."""
    return job_kind(name) if name in KINDS else None


__all__ = ["KINDS", "JobKind", "job_kind", "registered_kind"]
