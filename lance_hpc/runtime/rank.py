"""The entry point of every rank: ``python -m lance_hpc.run SPEC_FILE``.

srun starts one per GPU (or :mod:`lance_hpc.launch.local` one per local process); each reads the
resolved spec, joins the process group, takes checkpoint.dir for this run (rank 0 holds its lease;
a second run on the same directory stops here), checks the task against the data, trains (the
built-in loop, or the spec's ``entry`` in script mode), and on preemption saves and requeues the job.
Exit codes: 0 finished or requeued, 1 training failed (or the data store stayed down for longer
than data.io_timeout_s), 2 a problem the user can fix, 3 stopped by a signal without requeue (the
checkpoint holds the state; run again to resume), 130 interrupted (Ctrl-C) before training began.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import submitit
import torch.distributed as dist

from lance_hpc import data
from lance_hpc.checkpoint import saving
from lance_hpc.data import load_task
from lance_hpc.errors import ExitCode, UserError, note_failure
from lance_hpc.imports import load_callable
from lance_hpc.runtime import context, trainer
from lance_hpc.runtime.environment import (
    SLURM_VARS,
    DistEnv,
    detect,
    explain_failure,
    lost_peer,
    process_group,
)
from lance_hpc.runtime.infer_job import run_infer
from lance_hpc.runtime.ingest_job import run_ingest
from lance_hpc.runtime.preemption import (
    INTERRUPT_SIGNAL,
    PREEMPTION_SIGNALS,
    PROFILE_SIGNAL,
    REQUEUE_SIGNAL,
    Preemption,
    Requeue,
    after_preemption,
    hold,
    ignore_profile_requests,
    requeue_with_scontrol,
    requeue_with_submitit,
)
from lance_hpc.runtime.watchdog import WATCH_DIR_VARIABLE, watch_dir
from lance_hpc.spec import JobSpec, load_spec_text
from lance_hpc.spec.choices import JOB_KINDS, check_registry
from lance_hpc.spec.load import read_own_text
from lance_hpc.storage.retry import StoreUnavailable


def run_job(spec_file: str, requeue: Requeue, signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> context.Summary:
    """Train this rank's part of the job described by ``spec_file``; requeue it when preempted."""
    hold((PROFILE_SIGNAL,))  # held already in python -m lance_hpc.run; not yet in a submitit task
    # Loading the spec imports its task and entry, so a task file's directory is on sys.path
    # before the worker server starts and copies it (workers then unpickle the task's decoder).
    # Read only if this user owns it: the spec names the code this rank imports and runs.
    spec = load_spec_text(read_own_text(spec_file), spec_file).spec
    if spec.sweep:
        raise UserError(
            f"{spec_file} is a sweep, not one run: submit it with lance-hpc submit, which runs each combination with its own spec"
        )
    env = detect()
    if spec.job not in PROFILED_JOBS:  # before the kind starts: USR1 must not end it
        ignore_profile_requests(spec.job, env.rank)
    return JOBS[spec.job](spec, env, requeue, signals)


def ingest_job(spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> context.Summary:
    """``job: ingest``: this rank's shards of the source, and on rank 0 the commit."""
    with Preemption(signals) as preemption:
        return run_ingest(spec, env, preemption, requeue)


def infer_job(spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> context.Summary:
    """``job: infer`` / ``job: evaluate``: this rank's fragments through the model, and on rank 0 the commit or the report."""
    with Preemption(signals) as preemption:
        return run_infer(spec, env, preemption, requeue)


def train_job(spec: JobSpec, env: DistEnv, requeue: Requeue, signals: tuple[int, ...]) -> context.Summary:
    """``job: train``: the built-in trainer or the spec's entry, on the public Context."""
    entry = load_callable(spec.entry, "entry") if spec.entry else trainer.train
    if spec.train.watchdog is not None:  # before the worker server starts: its workers inherit it
        os.environ[WATCH_DIR_VARIABLE] = str(watch_dir(spec.slurm.log_dir, spec.name, env.job_ref))
    if spec.data.num_workers > 0:
        data.worker_context()  # the DataLoader worker server imports torch while the process group forms
    try:
        timeout_s = spec.train.collective_timeout_s
        with (
            Preemption(signals) as preemption,
            process_group(env, timeout_s) as device,
            saving.writer_lease(spec.checkpoint.dir, env) as lease,
        ):
            on_main_rank(lambda: data.ensure_dataset(spec.data), "prepare the dataset")
            task = load_task(spec)
            summary = context.run_entry(entry, spec, env, device, preemption, task)
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


# What the ranks of a job run, by the spec's ``job``.
JOBS: dict[str, Callable[[JobSpec, DistEnv, Requeue, tuple[int, ...]], context.Summary]] = {
    "train": train_job,
    "ingest": ingest_job,
    "infer": infer_job,
    "evaluate": infer_job,
}
check_registry(JOBS, JOB_KINDS, "job")
# The kinds whose steps USR1 profiles (train.profile; the built-in loop and script mode alike).
PROFILED_JOBS = frozenset({"train"})


def on_main_rank(action: Callable[[], object], what: str) -> None:
    """Run ``action`` on rank 0 while the others wait; an error on rank 0 is raised on every rank."""
    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as error:
            outcome[0] = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise UserError(f"rank 0 could not {what}: {outcome[0]}")


class TrainingFailed(RuntimeError):
    """A rank failed; the message says which and the likely cause. The traceback of the cause is
    printed too, unless another rank went away: then it only shows where this one noticed."""

    def __init__(self, message: str, show_traceback: bool = True):
        super().__init__(message)
        self.show_traceback = show_traceback


class SubmititJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles and runs in every task.

    It holds only the spec path: everything else lives in the checkpoint directory, so the
    inherited ``checkpoint()`` (resubmit the same callable) is the whole requeue protocol.
    """

    def __init__(self, spec_file: str):
        self.spec_file = str(spec_file)

    def __call__(self) -> dict[str, Any]:
        # submitit's protocol: USR2 checkpoints and requeues; SIGTERM keeps submitit's handler (it logs it)
        summary = run_job(self.spec_file, requeue_with_submitit, signals=(REQUEUE_SIGNAL,))
        if summary.status == "unsaved":
            exit_process(ExitCode.FAILED)
        if summary.status == "requeued":
            exit_process(255)  # as submitit's handler does (sys.exit(-1)): a requeued task leaves no result behind
        return dataclasses.asdict(summary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lance_hpc.run", description=__doc__.splitlines()[0])
    parser.add_argument("spec_file", help="resolved job spec (YAML)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK") or os.environ.get(SLURM_VARS["rank"]) or 0)
    try:
        summary = run_job(args.spec_file, requeue_with_scontrol)
    except UserError as error:
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        note_failure(rank, str(error), lost_contact=False)
        return ExitCode.USER_ERROR
    except StoreUnavailable as error:  # the store, not the code, failed: its message says it all
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        note_failure(rank, str(error), lost_contact=False)
        return ExitCode.FAILED
    except TrainingFailed as error:
        if error.show_traceback:
            traceback.print_exception(error.__cause__, file=sys.stderr)
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        cause = error.__cause__
        own = f"{type(cause).__name__}: {cause}" if cause is not None and error.show_traceback else str(error)
        note_failure(rank, own.strip().splitlines()[0], lost_contact=not error.show_traceback)
        return ExitCode.FAILED
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save yet
        return ExitCode.INTERRUPTED
    if summary.status == "unsaved":  # a stop signal the loop could not honour: it said so
        return ExitCode.FAILED
    return ExitCode.STOPPED if summary.status == "stopped" else ExitCode.OK


def exit_process(code: int) -> NoReturn:
    """End this rank with ``code``, skipping the interpreter's teardown.

    When the last collective returns, a gloo thread may still hold that collective's tensors. If
    it lets go of them while the interpreter shuts down, it cannot take the GIL, and the process
    dies of SIGABRT ("terminate called without an active exception") after doing all its work.
    So: the exit hooks run (they stop the DataLoader workers and flush logging), then the output
    is flushed, and the process ends without a teardown.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
