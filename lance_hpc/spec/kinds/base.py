"""The half of a job kind that reads nothing but a spec: :class:`JobKindBase`. Validation asks it
what the kind needs of a spec and what it refuses; launch, the dry run and status ask it for the
check before any rank starts, the plan and the progress.

The rank's half, ``run``, takes the runtime, which takes the spec, so it cannot be here:
:class:`lance_hpc.kinds.JobKind` adds it, and is the class a kind subclasses.
"""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.spec.named_code import entry_problems, task_problems
from lance_hpc.spec.problems import Problem

# The kind a spec without ``job`` runs.
DEFAULT_KIND = "train"


class JobKindBase:
    """What validation, launch, the dry run and status ask of a kind, from its spec alone; the
    defaults suit a kind that reads no section of its own and has no data plan or progress."""

    #: the name that ``lance-hpc status`` and the messages show (a registered kind's spec name)
    name: str = "custom"
    #: whether USR1 records a profiler trace of its steps; the other kinds ignore USR1, which
    #: ``scancel --signal=USR1`` sends to every process of the job and would otherwise end it
    profiled: bool = False
    #: whether its ranks train on data.uri: ``lance-hpc plan`` then shows how an epoch's rows split
    #: over them; for the other kinds it shows :meth:`plan`, what their ranks would read or write
    trains: bool = False
    #: whether its ranks read through DataLoader workers: ``python -m lance_hpc.run`` then starts the
    #: workers' server before anything else (lance_hpc.loading.worker_server); another kind's rank
    #: starts it when it first builds a loader, if it ever does
    reads_with_workers: bool = False
    #: the section whose presence names this kind, whatever ``job`` says (``command:`` implies
    #: ``job: command``); None: only ``job`` names it
    implied_by: str | None = None

    def defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        """The spec mapping with what this kind fills in before the schema reads it (a section it
        never reads but the schema requires of every other kind)."""
        return values

    def spec_problems(self, raw: Mapping[str, Any]) -> list[Problem]:
        """The sections this kind needs and those it refuses, read from the spec as written (before
        validation fills any in), so they are reported with the spec's other problems. By default
        a kind reads no ``infer`` section."""
        if raw.get("infer") is None:
            return []
        job = raw.get("job", DEFAULT_KIND)
        return [Problem("infer", f"job: {job} does not read it", "set job: infer, evaluate or map, or remove the section")]

    def named_code_problems(self, raw: dict[str, Any], imports: bool) -> list[Problem]:
        """The code the spec names besides the kind: the task and its options, the entry and its
        options (their defaults filled into ``raw``); without ``imports``, only their form."""
        return task_problems(raw, imports=imports) + entry_problems(raw, imports=imports)
