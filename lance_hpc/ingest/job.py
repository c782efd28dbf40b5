"""The ingest job (``job: ingest``): every rank writes its share of the source's shards, rank 0
commits once all are recorded.

The ranks share no collective: shards differ in size, so ranks finish at different times, and a
barrier would time out on a big shard. They coordinate through what they record beside the target
(:mod:`lance_hpc.ingest.records`): rank 0, once its own shards are written, waits until every
shard has a record, then commits. SLURM does the rest: it starts the ranks, stops the job step if
one fails, and requeues. A stop signal is honoured at a shard boundary: the shard in hand is
finished and recorded, and USR2 requeues the job (rank 0 asks SLURM), whose next run writes only
the shards without a record. The ranks' signals and the requeue reach this module as two functions
(:func:`run_ingest`'s ``stopped`` and ``requeue``), so ingest needs nothing of the runtime.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from lance_hpc.ingest.commit import commit, committed_line
from lance_hpc.ingest.plan import Plan, plan_for_data, resume_lines, stale_parts
from lance_hpc.ingest.records import ShardRecord
from lance_hpc.ingest.status import estimate_line, shard_summary
from lance_hpc.ingest.units import wait_for_all
from lance_hpc.ingest.write import run_worker
from lance_hpc.spec import JobSpec

# How often rank 0 looks for the other ranks' shard records while it waits to commit.
POLL_S = 2.0


def ingest_plan(spec: JobSpec, *, check_targets: bool = True) -> Plan:
    """The plan of a ``job: ingest`` spec."""
    return plan_for_data(spec.data, check_targets=check_targets)


@dataclass(frozen=True)
class IngestEnd:
    """How a rank's part of an ingest ended: ``completed``, ``stopped`` or ``requeued``; the shards
    it counts (its own, or on rank 0 once committed all of them); the rows committed per split."""

    status: str
    shards: int
    metrics: dict[str, float] = field(default_factory=dict)


def run_ingest(
    spec: JobSpec, rank: int, world_size: int, stopped: Callable[[], bool], requeue: Callable[[], tuple[bool, str]]
) -> IngestEnd:
    """This rank's shards; on rank 0 also the wait for the others and the commit. ``stopped`` says
    whether a stop signal came; ``requeue``, asked on rank 0 once it stopped, whether the job went
    back into the queue, and what to tell the user."""
    plan = ingest_plan(spec, check_targets=False)  # the launcher checked the targets before the ranks started
    records = plan.shard_records()
    if rank == 0:
        for line in resume_lines(plan):  # records naming what the datasets lack are discarded here
            print(line, flush=True)
    elif not _records_hold(plan, stopped):
        return IngestEnd("stopped", 0)
    if plan.complete:  # every split committed by an earlier run: rank 0 makes sure it is recorded
        if rank == 0:
            print(committed_line(plan, commit(plan)), flush=True)
        return IngestEnd("completed", len(plan.shards))
    mine = plan.assignment(world_size)[rank]
    if rank == 0:
        print(f"ingest {plan.source_text} -> {plan.train.uri}: {len(plan.shards)} shards over {world_size} rank(s)", flush=True)

    def show(record: ShardRecord) -> None:
        rows = sum(record.rows.values())
        print(f"rank {rank}: {record.shard}: {rows:,} rows in {record.seconds:.1f} s", flush=True)

    report = run_worker(plan, rank, world_size, stop=stopped, progress=show)
    print(
        f"rank {rank}: {len(report.done)} shard(s) written, {len(report.already)} written before, "
        f"{len(mine) - len(report.done) - len(report.already)} left",
        flush=True,
    )
    if rank != 0:
        # Stopped or done, this rank's state is its shard records; rank 0 decides the job's end. A
        # non-zero exit here would make srun end the step before rank 0 could requeue it.
        return IngestEnd("completed", len(report.done))
    if not report.stopped:
        report.stopped = not wait_for_all(records, len(plan.shards), stopped, "shard", POLL_S)
    if report.stopped:
        requeued, message = requeue()
        if not requeued:
            message = "run or submit the same job again: it writes only the shards still missing, then commits"
        print(f"ingest stopped with {len(records.finished())}/{len(plan.shards)} shards written; {message}", flush=True)
        return IngestEnd("requeued" if requeued else "stopped", len(report.done))
    done = commit(plan)
    print(committed_line(plan, done), flush=True)
    return IngestEnd("completed", len(plan.shards), {f"rows/{split}": float(n) for split, n in done.rows.items()})


def _records_hold(plan: Plan, stopped: Callable[[], bool]) -> bool:
    """A rank but rank 0, before it writes: wait while the run's records name what the datasets no
    longer hold, until rank 0 has discarded them (a shard record kept now would skip a shard whose
    files are gone); False when stopped meanwhile."""
    while stale_parts(plan):
        if stopped():
            return False
        time.sleep(POLL_S)
    return True


def check_ingest(spec: JobSpec) -> str:
    """Before any rank starts: the targets checked, the shards listed; the plan in a few lines."""
    plan = ingest_plan(spec)
    lines = shard_summary(plan, spec.slurm.world_size)
    lines.append(f"columns: {', '.join(f'{item.name} ({item.type})' for item in plan.schema)}")
    lines.append(estimate_line(plan))
    finished = len(plan.shard_records().finished())
    if finished:
        lines.append(f"{finished} shard(s) already written by an earlier run of this ingest: the job writes the rest")
    return "\n".join(lines)
