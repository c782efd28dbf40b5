"""``job: train``: the built-in trainer, or the spec's ``entry`` (script mode), on the public Context."""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import TYPE_CHECKING, Any

from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.kinds import JobKind
from lance_hpc.spec.kinds.builtin import TrainRules

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Summary
    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.runtime.preemption import Requeue
    from lance_hpc.spec import JobSpec


class Train(TrainRules, JobKind):
    """Training: the steps USR1 profiles, checkpoints the next run resumes from, the training status lines."""

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """Here: the dataset prepared and the task checked once; under SLURM: the data reachable from the login node."""
        from lance_hpc import loading
        from lance_hpc.ingest import ensure_dataset

        if nproc is not None:  # this machine runs the ranks: prepare the dataset once for all of them
            ensure_dataset(spec.data)
            lines = [f"data selected: {line}" for line in loading.check_selection(spec.data)]
            loading.load_task(spec)  # a column the task needs but the data lacks: one error here, not one per rank
            return lines
        loading.preflight(spec.data)
        lines = [f"data preflight ok: {spec.data.uri}" + (f" and {spec.data.val_uri}" if spec.data.val_uri else "")]
        return lines + task_check(spec)

    def plan(self, spec: JobSpec, source: str) -> str:
        """One epoch split between the ranks, from metadata; skipped for object storage, which lance-hpc plan shows."""
        from lance_hpc.loading import plan_data

        if "://" in spec.data.uri:
            return f"skipped for object storage in a dry run; see it with: lance-hpc plan {source}"
        return str(plan_data(spec.data, spec.slurm.world_size))

    def run(self, spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
        """The built-in trainer or the spec's entry; on preemption a checkpoint, then the requeue."""
        return train(spec, env, requeue, signals)


def task_check(spec: JobSpec) -> list[str]:
    """The task's columns and types against the datasets, unless ingest has yet to create them."""
    from lance_hpc.loading import load_task
    from lance_hpc.storage.datasets import dataset_exists
    from lance_hpc.storage.options import storage_options

    uris = [uri for uri in (spec.data.uri, spec.data.val_uri) if uri]
    if not all(dataset_exists(uri, storage_options(uri, spec.data.storage_options)) for uri in uris):
        return []
    load_task(spec)
    return [f"task check ok: {spec.task.name} reads what it needs from the data"]


def train(spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> Summary:
    """This rank's part of the training: the process group, the checkpoint lease, the loop, the requeue."""
    import torch.distributed as dist

    from lance_hpc import loading
    from lance_hpc.checkpoint import saving
    from lance_hpc.checkpoint.stores import open_store
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.runtime import trainer
    from lance_hpc.runtime.entry import run_entry
    from lance_hpc.runtime.environment import TrainingFailed, explain_failure, lost_peer, on_main_rank, process_group
    from lance_hpc.runtime.preemption import Preemption, after_preemption
    from lance_hpc.runtime.watchdog import watch_dir
    from lance_hpc.signals import INTERRUPT_SIGNAL, WATCH_DIR_VARIABLE
    from lance_hpc.storage.retry import StoreUnavailable

    entry = load_callable(spec.entry, "entry") if spec.entry else trainer.train
    if spec.train.watchdog is not None:  # where the rank and its loaders' workers write their stacks
        os.environ[WATCH_DIR_VARIABLE] = str(watch_dir(spec.slurm.log_dir, spec.name, env.job_ref))
    if spec.data.num_workers > 0:
        loading.worker_context()  # if python -m lance_hpc.run has not: the server imports while the process group forms
    try:
        timeout_s = spec.train.collective_timeout_s
        with (
            Preemption(signals) as preemption,
            process_group(env, timeout_s) as device,
            saving.writer_lease(open_store(spec.checkpoint.dir), env) as lease,
        ):
            on_main_rank(lambda: ensure_dataset(spec.data), "prepare the dataset")
            task = loading.load_task(spec)
            summary = run_entry(entry, spec, env, device, preemption, task)
            if summary.status == "preempted":
                outcome: list[Any] = [None]
                if env.is_main:
                    outcome[0] = after_preemption(env, spec, preemption, requeue)
                dist.broadcast_object_list(outcome, src=0)
                requeued, message = outcome[0]
                if requeued and lease is not None:  # the job's next run takes the lease back; nobody else meanwhile
                    lease.keep()
                if env.is_main and preemption.agreed_signal == INTERRUPT_SIGNAL:
                    print(f"interrupted at step {summary.step}, checkpoint saved ({summary.checkpoint}); {message}", flush=True)
                elif env.is_main:
                    assert preemption.agreed_signal is not None  # the ranks agreed on it to stop
                    name = signal.Signals(preemption.agreed_signal).name
                    print(f"stopped at step {summary.step} by {name}; checkpoint {summary.checkpoint}; {message}", flush=True)
                summary = dataclasses.replace(summary, status="requeued" if requeued else "stopped")
            dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves while others still use it
            return summary
    except (UserError, StoreUnavailable):
        raise
    except Exception as error:
        raise TrainingFailed(explain_failure(error, env), show_traceback=not lost_peer(error, env)) from error
