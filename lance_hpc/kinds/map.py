"""``job: map``: your function over batches of data.uri's columns, its results written back as new
columns like an inference's, with no model, no task and no GPU (:mod:`lance_hpc.writeback.map_job`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.kinds import JobKind
from lance_hpc.spec.kinds.columns import MapRules

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class Map(MapRules, JobKind):
    """A function over every row's columns, new columns committed once; CPU only unless asked."""

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """The dataset (ingested first, here, when data.ingest says so), the columns read and written,
        and the function's import checked; the work."""
        from lance_hpc.writeback.map_job import check_map

        if nproc is not None and spec.data.ingest is not None:
            from lance_hpc.ingest import ensure_dataset

            ensure_dataset(spec.data)
        return [check_map(spec, nproc)]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The same lines as the check, for the spec's world size."""
        from lance_hpc.writeback.map_job import check_map

        return check_map(spec)

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """This rank's fragments through the function, and on rank 0 the commit."""
        from lance_hpc.runtime.preemption import Preemption
        from lance_hpc.writeback.map_job import run_map
        from lance_hpc.writeback.waits import until_stopped

        with Preemption(signals) as preemption:
            return until_stopped(lambda: run_map(spec, env, preemption, requeue), env.rank)

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The fragments done (of how many) and the commit, from the job's records."""
        from lance_hpc.writeback import new_columns

        return new_columns.progress_lines(spec)
