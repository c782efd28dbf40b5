"""``job: infer``: a model over data.uri, fragment by fragment, its outputs committed once as new
columns (:mod:`lance_hpc.writeback.job`); and :class:`ModelKind`, the run it shares with ``job:
evaluate`` (:mod:`lance_hpc.kinds.evaluate`), which differ only in their pass over the fragments."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.kinds import JobKind
from lance_hpc.spec.kinds.columns import InferRules

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec
    from lance_hpc.writeback.job import ModelPass


class ModelKind(JobKind):
    """A model over every fragment: the fragments each rank runs through it, and on rank 0 what
    :meth:`work` makes of them besides the commit."""

    def work(self) -> ModelPass:
        """What the run makes of the fragments (imported here: a login-node command loads it only when used)."""
        raise NotImplementedError(f"{type(self).__name__}.work")

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """The dataset, the columns and the checkpoint checked; the work for the ranks that will run it (no model loaded)."""
        from lance_hpc.writeback.job import check_infer

        return [check_infer(spec, self.work(), nproc)]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The same lines as the check, for the spec's world size."""
        from lance_hpc.writeback.job import check_infer

        return check_infer(spec, self.work())

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """This rank's fragments through the model, and on rank 0 the commit or the report."""
        from lance_hpc.runtime.preemption import Preemption
        from lance_hpc.writeback.job import run_infer
        from lance_hpc.writeback.waits import until_stopped

        work = self.work()
        with Preemption(signals) as preemption:
            return until_stopped(lambda: run_infer(spec, env, preemption, requeue, work), env.rank)

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The fragments done (of how many) and the commit, from the job's records."""
        from lance_hpc.writeback import new_columns

        return new_columns.progress_lines(spec)


class Infer(InferRules, ModelKind):
    """Inference: the model's outputs written as each fragment's new columns, committed on rank 0."""

    def work(self) -> ModelPass:
        """The outputs written as new columns."""
        from lance_hpc.writeback.job import WriteColumns

        return WriteColumns()
