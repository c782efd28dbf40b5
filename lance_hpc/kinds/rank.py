"""The entry point of every rank: ``python -m lance_hpc.run SPEC_FILE``.

srun starts one per GPU (or `lance-hpc submit --local` one per local process); each reads the
resolved spec, joins the process group, takes checkpoint.dir for this run (rank 0 holds its lease;
a second run on the same directory stops here), checks the task against the data, trains (the
built-in loop, or the spec's ``entry`` in script mode), and on preemption saves and requeues the job.
Exit codes: 0 finished or requeued, 1 training failed (or the data store stayed down for longer
than data.io_timeout_s), 2 a problem the user can fix, 3 stopped by a signal without requeue (the
checkpoint holds the state; run again to resume), 130 interrupted (Ctrl-C) before training began.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import traceback
from typing import Any, NoReturn

import submitit

from lance_hpc.errors import ExitCode, RepeatingError, UserError
from lance_hpc.kinds import job_kind
from lance_hpc.kinds.standby import wait_if_standby
from lance_hpc.output import whole_lines
from lance_hpc.runtime.attempt import failed_step
from lance_hpc.runtime.context import Summary
from lance_hpc.runtime.environment import LOST_PEER_HINTS, SLURM_VARS, TrainingFailed, detect
from lance_hpc.runtime.failures import PortInUse, error_that_repeats, note_failure
from lance_hpc.runtime.preemption import (
    Requeue,
    hold,
    ignore_profile_requests,
    requeue_with_scontrol,
    requeue_with_submitit,
)
from lance_hpc.signals import PREEMPTION_SIGNALS, PROFILE_SIGNAL, REQUEUE_SIGNAL
from lance_hpc.spec import load_spec_text
from lance_hpc.spec.load import read_own_text
from lance_hpc.storage.retry import StoreUnavailable


def run_job(spec_file: str, requeue: Requeue, signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> Summary:
    """Run this rank's part of the job described by ``spec_file`` (the kind its ``job`` names); requeue it when preempted."""
    hold((PROFILE_SIGNAL,))  # held already in python -m lance_hpc.run; a submitit task ignored it until here
    whole_lines()  # the ranks share a log: each line in one write
    # Loading the spec imports its task and entry, so a task file's directory is on sys.path
    # before the worker server starts and copies it (workers then unpickle the task's decoder).
    # Read only if this user owns it: the spec names the code this rank imports and runs.
    spec = load_spec_text(read_own_text(spec_file), spec_file).spec
    if spec.sweep:
        raise UserError(
            f"{spec_file} is a sweep, not one run: submit it with lance-hpc submit, which runs each combination with its own spec"
        )
    kind = job_kind(spec.job)
    env = detect()
    if not kind.profiled:  # before the kind starts: USR1 must not end it
        ignore_profile_requests(kind.name, env.rank)
    try:
        return kind.run(spec, env, requeue, signals)
    except Exception as error:
        repeats = error_that_repeats(error)  # the job's code does not import: no restart, one message
        if repeats is None:
            raise
        raise repeats from None


class SubmititJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles and runs in every task.

    It holds only the spec path: everything else lives in the checkpoint directory, so the
    inherited ``checkpoint()`` (resubmit the same callable) is the whole requeue protocol.
    """

    def __init__(self, spec_file: str):
        self.spec_file = str(spec_file)

    def __call__(self) -> dict[str, Any]:
        # submitit's protocol: USR2 checkpoints and requeues; SIGTERM keeps submitit's handler (it logs it)
        wait_if_standby(self.spec_file)  # a rank started ahead of a restart waits for its turn
        try:
            summary = run_job(self.spec_file, requeue_with_submitit, signals=(REQUEUE_SIGNAL,))
        except Exception as error:  # submitit keeps the error as the task's result; the restart supervisor reads the note
            note_rank_failure(error)
            raise
        if summary.status in ("unsaved", "failed"):
            exit_process(ExitCode.FAILED)
        if summary.status == "requeued":
            exit_process(255)  # as submitit's handler does (sys.exit(-1)): a requeued task leaves no result behind
        return dataclasses.asdict(summary)


def run_rank(spec_file: str) -> int:
    """Run this rank of the job in ``spec_file`` (``python -m lance_hpc.run``) and return its exit
    code; how it failed is printed once and noted for the launcher (:func:`note_rank_failure`)."""
    wait_if_standby(spec_file)  # a rank started ahead of a restart waits for its turn
    try:
        summary = run_job(spec_file, requeue_with_scontrol)
    except UserError as error:
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        note_rank_failure(error)
        return ExitCode.USER_ERROR
    except (StoreUnavailable, RepeatingError) as error:  # the store failed, or the user's code on a row: its message says it all
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        note_rank_failure(error)
        return ExitCode.FAILED
    except TrainingFailed as error:
        if error.show_traceback:
            traceback.print_exception(error.__cause__, file=sys.stderr)
        print(f"lance_hpc.run: {error}", file=sys.stderr, flush=True)
        note_rank_failure(error)
        return ExitCode.FAILED
    except Exception as error:  # ingest, inference, a kind of one's own: its traceback as always, and a note
        note_rank_failure(error)
        raise
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save yet
        return ExitCode.INTERRUPTED
    if summary.status in ("unsaved", "failed"):  # a stop the loop could not honour, or a program that failed: it said so
        return ExitCode.FAILED
    return ExitCode.STOPPED if summary.status == "stopped" else ExitCode.OK


def note_rank_failure(error: BaseException) -> None:
    """Note how this rank failed, for its launcher (see lance_hpc.runtime.failures.note_failure): its own
    error's first line, or that it lost contact with another rank; the step it was at; and whether
    the user must fix something (a restart cannot help then)."""
    rank = int(os.environ.get("RANK") or os.environ.get(SLURM_VARS["rank"]) or 0)
    message, lost_contact = str(error), False
    if isinstance(error, TrainingFailed):
        cause = error.__cause__
        own = f"{type(cause).__name__}: {cause}" if cause is not None and error.show_traceback else str(error)
        message, lost_contact = own.strip().splitlines()[0], not error.show_traceback
    elif not isinstance(error, (UserError, StoreUnavailable, RepeatingError)):
        message = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        lost_contact = any(hint in message.lower() for hint in LOST_PEER_HINTS)  # another rank went away first
    user_error = isinstance(error, UserError) and not isinstance(error, PortInUse)  # a taken port is a fault
    repeats = isinstance(error, RepeatingError)
    note_failure(rank, message, lost_contact, step=failed_step(), user_error=user_error, repeats=repeats)


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
