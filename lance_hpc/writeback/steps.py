"""The run that ``job: infer`` (and ``evaluate``) and ``job: map`` share, around what each computes.

:func:`begin`: the run's records, and an earlier run's commit that still holds (nothing to do).
:func:`pin`: the version rank 0 pins at the first start and the plan every rank agrees on (for a
refresh, only the fragments the columns lack). Then each rank computes its fragments, recording
each (the kind's own loop), and :func:`finish`: rank 0 waits for every record, or for a stop
signal, and commits once (with the columns' provenance, the indices on them followed), or reports
an evaluation. The ranks share no collective: fragments differ in size, so ranks finish at
different times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from lance_hpc.backfill import indices, missing
from lance_hpc.ingest.units import wait_for_all
from lance_hpc.lineage.provenance import Producer, provenance_of
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import storage_options
from lance_hpc.writeback import column_swap, earlier_runs, identity, new_columns, repin, rerun, row_errors
from lance_hpc.writeback.new_columns import ColumnPlan, FragmentRecord, Records
from lance_hpc.writeback.provenance import commit_metadata, producer

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Preemption, Requeue
    from lance_hpc.spec import JobSpec

# How often rank 0 looks for the other ranks' fragment records while it waits to commit.
POLL_S = 2.0


@dataclass
class Run:
    """One run of a write-back job: what names it, what computes its columns, where it records."""

    name: str  # the model or function, for messages
    made_by: Producer
    folder: str
    records: Records
    options: dict[str, str]

    def with_weights(self, weights: str | None) -> Run:
        return replace(self, made_by=replace(self.made_by, weights=weights))


def begin(spec: JobSpec, env: DistEnv, preemption: Preemption) -> Run | None:
    """The run of ``spec``; None, said on rank 0, when an earlier run's commit still holds. A stop
    signal while this rank waits for rank 0 raises :class:`~lance_hpc.writeback.waits.Stopped`."""
    assert spec.infer is not None
    name = new_columns.model_name(spec)
    folder, records = new_columns.run_records(spec, name)
    options = storage_options(spec.data.uri, spec.data.storage_options)
    refresh = spec.infer.refresh is not None
    if env.is_main:
        earlier_runs.claim(
            new_columns.records_root(spec.data.uri), new_columns.job_key(spec, name), folder, identity.code(spec), options
        )
    committed = rerun.earlier_commit(
        records,
        spec.data.uri,
        options,
        spec.infer.outputs,
        main=env.is_main,
        stopped=lambda: preemption.received is not None,
        refresh=refresh,
        filtered=bool(spec.infer.filter),
    )
    if committed is None:
        return Run(name, producer(spec), folder, records, options)
    if env.is_main:
        print(f"already committed: {spec.data.uri} version {committed} ({name}); nothing to do", flush=True)
        if spec.infer.outputs and not refresh:  # a job that writes columns (not an evaluation)
            note = missing.lacking_note(open_dataset(spec.data.uri, None, options), spec.infer.outputs)
            if note:
                print(note, flush=True)
    return None


def pin(spec: JobSpec, env: DistEnv, run: Run, preemption: Preemption) -> ColumnPlan:
    """The plan on the pinned version; rank 0 says what runs (a refresh: what it fills). A refresh
    with nothing to fill is recorded as committed, so a rerun knows until rows are added. A stop
    signal while this rank waits for the pin raises :class:`~lance_hpc.writeback.waits.Stopped`."""
    assert spec.infer is not None
    plan = new_columns.start(
        spec.data.uri,
        run.options,
        spec.infer.outputs,
        run.folder,
        main=env.is_main,
        overwrite=spec.infer.overwrite,
        filter=spec.infer.filter,
        refresh=run.made_by if spec.infer.refresh else None,
        stopped=lambda: preemption.received is not None,
    )
    if env.is_main:
        announce(spec, plan, run, env.world_size)
        if not plan.compute:
            run.records.mark_committed(plan.version)
    return plan


def announce(spec: JobSpec, plan: ColumnPlan, run: Run, world_size: int) -> None:
    assert spec.infer is not None
    what = f"{spec.job} {', '.join(spec.infer.outputs)}" if spec.infer.outputs else spec.job
    print(
        f"{what}: {run.name} over {spec.data.uri} version {plan.version}, {len(plan.fragments)} fragments "
        f"over {world_size} rank(s)",
        flush=True,
    )
    dataset = plan.dataset()
    if dataset.latest_version != plan.version:
        print(
            f"  note: the dataset is at version {dataset.latest_version} now; this run goes on reading version {plan.version}",
            flush=True,
        )
    if plan.fill:  # the weights are known now: the columns must be this model's too
        missing.fills(dataset, spec.data.uri, spec.infer.outputs, run.made_by, False)
        lacking = missing.describe(dataset, plan.compute, spec.infer.outputs)
        print(f"refresh: {lacking}: computing them only" if plan.compute else f"nothing to refresh: {lacking}", flush=True)


def finish(
    spec: JobSpec,
    env: DistEnv,
    plan: ColumnPlan,
    run: Run,
    mine: list[int],
    done: list[int],
    already: list[int],
    preemption: Preemption,
    requeue: Requeue,
    report: Callable[[dict[int, FragmentRecord]], dict[str, float]] | None = None,
) -> Summary:
    """After this rank's fragments: on rank 0 the wait for the others' records (or a stop signal,
    then the requeue), and the commit, or the ``report`` of an evaluation."""
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.preemption import after_preemption

    left = len(mine) - len(done) - len(already)
    print(f"rank {env.rank}: {len(done)} fragment(s) written, {len(already)} written before, {left} left", flush=True)
    if not env.is_main:
        return Summary("completed", len(done), 0, None)
    records = run.records
    received = lambda: preemption.received is not None  # noqa: E731
    if received() or not wait_for_all(records, len(plan.compute), received, "fragment", POLL_S):
        preemption.agreed_signal = preemption.received  # no collective: each rank honours its own signal
        requeued, message = after_preemption(env, spec, preemption, requeue)
        if not requeued:
            message = "run or submit the same job again: it writes only the fragments still missing, then commits"
        print(f"stopped with {len(records.finished())}/{len(plan.compute)} fragments written; {message}", flush=True)
        return Summary("requeued" if requeued else "stopped", len(done), 0, None)
    finished = records.finished()
    if report is not None:
        return Summary("completed", len(plan.compute), 0, None, report(finished))
    rows = commit(spec, plan, finished, run)
    return Summary("completed", len(plan.compute), 0, None, {"rows": float(rows)})


def commit(spec: JobSpec, plan: ColumnPlan, finished: dict[int, FragmentRecord], run: Run) -> int:
    """Rank 0's commit of every fragment's columns with their provenance, recorded; then the
    indices on the columns it replaced or extended. Returns the rows written."""
    assert spec.infer is not None
    rows = sum(record.rows for record in finished.values())
    pinned = plan.dataset()
    metadata = commit_metadata(
        spec,
        run.made_by,
        version=plan.version,
        run=new_columns.run_name(plan.run),
        rows=rows,
        fragments=len(finished),
        refreshed={name: provenance_of(pinned.schema, name) or {} for name in spec.infer.outputs} if plan.fill else None,
    )
    kept = indices.on_columns(pinned, spec.infer.outputs)
    repin.refuse_if_moved(plan, run.records)
    version = new_columns.commit(plan, finished, metadata)
    run.records.mark_committed(version)
    unreadable = sum(record.unreadable for record in finished.values())
    skipped = [row for record in finished.values() for row in record.skipped]
    print(
        f"committed: {spec.data.uri} version {version} with {', '.join(spec.infer.outputs)} for {rows:,} rows"
        + (f" of {len(finished)} fragment(s), the others' values kept" if plan.fill else "")
        + (f" ({unreadable} unreadable: null)" if unreadable else "")
        + row_errors.summary(skipped),
        flush=True,
    )
    filled = [plan.fragments[index].id for index in finished] if plan.fill else []
    for line in indices.follow(plan.uri, plan.options, kept, replaced=not plan.fill, filled=filled):
        print(line, flush=True)
    return rows


def check(spec: JobSpec, world_size: int | None, inputs: Callable[[], None], *, runs_a_model: bool = True) -> str:
    """Before any rank starts: the dataset and the columns checked, ``inputs()`` (the job's own check
    of what it reads); the work in a few lines for ``world_size`` ranks (default: the spec's), and
    for a refresh the rows and fragments it will compute; ``runs_a_model``: the lines name what
    computes the columns a model (``job: map`` runs a function only). Nothing is loaded or written."""
    assert spec.infer is not None
    options = storage_options(spec.data.uri, spec.data.storage_options)
    dataset = open_dataset(spec.data.uri, None, options)
    name = new_columns.model_name(spec)
    folder, records = new_columns.run_records(spec, name)
    committed, key, outputs = records.committed(), new_columns.run_name(folder), spec.infer.outputs
    refresh = producer(spec) if spec.infer.refresh else None
    filtered = bool(spec.infer.filter)
    if committed is not None and not rerun.stale_commit(
        dataset, outputs, committed, key, refresh=bool(refresh), filtered=filtered
    ):
        return f"already committed by an earlier run of this job: {spec.data.uri} version {committed} ({name})"
    inputs()
    if outputs and (records.pinned() is None or committed is not None):
        filling = refresh is not None and missing.fills(dataset, spec.data.uri, outputs, refresh, spec.infer.overwrite)
        column_swap.check_columns(dataset, spec.data.uri, outputs, spec.infer.overwrite or filling)
    plan = new_columns.plan_at(
        spec.data.uri,
        options,
        int(dataset.version),
        outputs,
        folder,
        spec.infer.filter,
        refresh=refresh,
        overwrite=spec.infer.overwrite,
    )
    rows = sum(fragment.rows for fragment in plan.fragments)
    rows_text = f"{rows:,} rows"
    if spec.infer.filter:
        chosen = sum(plan.rows_selected(index) for index in plan.compute)
        rows_text = f"{chosen:,} of {rows:,} rows (infer.filter)"
    what = f"new columns {', '.join(f'{n} ({t})' for n, t in outputs.items())}" if outputs else spec.job
    lines = [
        f"{what}: model {name}" if runs_a_model else f"{what}: {name}",
        f"{rows_text} in {len(plan.fragments)} fragments of {spec.data.uri} version {dataset.version}, "
        f"over {world_size or spec.slurm.world_size} rank(s)",
    ]
    if plan.fill:
        lines.append(f"refresh: {missing.describe(dataset, plan.compute, outputs)}: only they are computed")
    return "\n".join(lines)
