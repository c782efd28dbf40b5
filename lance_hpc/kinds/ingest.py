"""``job: ingest``: the source's shards split between the ranks, one commit at the end
(:mod:`lance_hpc.ingest.job`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.kinds import JobKind
from lance_hpc.spec.kinds.builtin import IngestRules

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class Ingest(IngestRules, JobKind):
    """Writing a dataset: the shards each rank writes, rank 0's commit, the shards written so far."""

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """The targets checked and the shards listed: the plan in a few lines. Here (``nproc`` ranks on
        this machine) a tokenizer the ingest names but lacks is trained first."""
        from lance_hpc.ingest.job import check_ingest
        from lance_hpc.ingest.local import prepare_tokenizer

        if nproc is not None:
            prepare_tokenizer(spec.data)
        return [check_ingest(spec)]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The same plan as the check: the shards and how they split between the ranks."""
        from lance_hpc.ingest.job import check_ingest

        return check_ingest(spec)

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """This rank's shards of the source, and on rank 0 the commit."""
        from lance_hpc.ingest.job import run_ingest
        from lance_hpc.runtime.context import Summary
        from lance_hpc.runtime.preemption import Preemption, after_preemption

        with Preemption(signals) as preemption:

            def stop() -> tuple[bool, str]:
                preemption.agreed_signal = preemption.received  # no collective: each rank honours its own signal
                return after_preemption(env, spec, preemption, requeue)

            end = run_ingest(spec, env.rank, env.world_size, lambda: preemption.received is not None, stop)
            return Summary(end.status, end.shards, 0, None, end.metrics)

    def progress(self, spec: JobSpec) -> list[str] | None:
        """The shards written (of how many), rows, skips, the commit or the time left."""
        from lance_hpc.ingest.status import progress_lines
        from lance_hpc.ingest.target import Target
        from lance_hpc.storage.options import storage_options

        assert spec.data.ingest is not None  # job: ingest requires it
        train = Target(spec.data.uri, storage_options(spec.data.uri, spec.data.storage_options), "data.uri")
        ingest = spec.data.ingest
        return progress_lines(ingest.source, train, spec.slurm.world_size, ingest.files_per_shard)
