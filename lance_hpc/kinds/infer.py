"""``job: infer`` and ``job: evaluate``: a model over data.uri, fragment by fragment; new columns
committed once, or the metrics reported (:mod:`lance_hpc.writeback.job`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.kinds import JobKind

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class Infer(JobKind):
    """Inference: the fragments each rank runs through the model, and on rank 0 the commit of the new columns."""

    name = "infer"

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """The dataset, the columns and the checkpoint checked; the work for the ranks that will run it (no model loaded)."""
        from lance_hpc.writeback.job import check_infer

        return [check_infer(spec, nproc)]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The same lines as the check, for the spec's world size."""
        from lance_hpc.writeback.job import check_infer

        return check_infer(spec)

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """This rank's fragments through the model, and on rank 0 the commit or the report."""
        from lance_hpc.runtime.preemption import Preemption
        from lance_hpc.writeback.job import run_infer
        from lance_hpc.writeback.waits import until_stopped

        with Preemption(signals) as preemption:
            return until_stopped(lambda: run_infer(spec, env, preemption, requeue), env.rank)

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The fragments done (of how many) and the commit, from the job's records."""
        from lance_hpc.writeback import new_columns

        return new_columns.progress_lines(spec)


class Evaluate(Infer):
    """Evaluation: the same fragment-by-fragment run, with the metrics reported instead of columns written."""

    name = "evaluate"
