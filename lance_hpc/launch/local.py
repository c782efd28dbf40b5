"""Local runs: N processes on this machine through the same code path as a SLURM job.

:func:`run_local` refuses a checkpoint.dir another run writes to, lets the job's kind check it once
(the built-in training prepares the dataset and checks the task against it), then starts N ranks,
each ``python -P -m lance_hpc.run SPEC`` (without the working directory on sys.path, see
:mod:`lance_hpc.imports`), forked from a warm server when the kind's ranks import torch (the
check as well: see :mod:`lance_hpc.launch.warm_ranks`), with the variables torchrun would set
(gloo on CPU), forwards SLURM's stop signals to them, and when one rank dies stops the others and
says which rank died and how. A failed attempt starts again from what the job saved (its latest checkpoint, if any), as in a
SLURM allocation (slurm.max_restarts; the same error at the same step twice stops the job, see
:mod:`lance_hpc.launch.restarts`).

Ctrl-C behaves like SIGTERM under SLURM: the ranks agree at the next step, save and exit 3, and
rerunning the same command continues. A second Ctrl-C stops every rank at once. The ranks run in
a process group of their own, so a terminal's Ctrl-C reaches them once, through this process, and
they are killed when it dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from lance_hpc.checkpoint import lease
from lance_hpc.checkpoint.manifests import checkpoint_steps
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.imports import child_environment, python_command
from lance_hpc.kinds import job_kind
from lance_hpc.launch import job_check
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.render import write_job_files
from lance_hpc.launch.restarts import NOT_RESTARTED, Attempt, Cause, cause_from_note, decide, first_note
from lance_hpc.launch.restarts.supervisor import RESUMES
from lance_hpc.launch.warm_ranks import RankProcess, WarmRanks, die_with_parent
from lance_hpc.output import whole_lines
from lance_hpc.quiet import exec_children
from lance_hpc.runtime.ports import free_port
from lance_hpc.runtime.restart_variables import (
    ATTEMPT_VARIABLE,
    FAILED_AT_VARIABLE,
    FAILED_STEP_VARIABLE,
    FAILURE_DIR_VARIABLE,
    RESTARTS_LEFT_VARIABLE,
)
from lance_hpc.signals import INTERRUPT_SIGNAL, PREEMPTION_SIGNALS, PROFILE_SIGNAL
from lance_hpc.slurm.variables import SLURM_VARS
from lance_hpc.spec import JobSpec, SweepRun, expand, load_spec

# After one rank fails, the others get this long to notice (a broken connection) and exit.
GRACE_S = 15.0


def run_local(spec_file: str | Path, nproc: int) -> int:
    """Train with ``nproc`` local ranks; returns 0, or the exit code of the first rank that failed."""
    whole_lines()  # the ranks write to the same terminal or file as this process
    spec_file = Path(spec_file).resolve()
    spec = load_spec(spec_file).spec
    if spec.sweep:
        raise UserError(
            f"{spec_file} is a sweep, not one run: use lance-hpc submit {spec_file} --local, which runs each combination in turn"
        )
    # rank 0 takes the lease itself (another run may still get there first); this look says who
    # holds it once, before the dataset is prepared and N ranks start only to refuse
    lease.refuse_if_held(
        open_store(spec.checkpoint.dir),
        os.environ.get(SLURM_VARS["job_id"]),
        int(os.environ.get(SLURM_VARS["restart_count"]) or 0),
    )
    # a kind whose ranks import torch (its DataLoader workers' readers, a model): ranks forked from a
    # server that imports it once, while the launcher gets ready; the others start as they are
    warm = WarmRanks.start() if job_kind(spec.job).reads_with_workers else None
    try:
        return run_attempts(spec, spec_file, nproc, warm)
    finally:
        if warm is not None:
            warm.close()


def run_attempts(spec: JobSpec, spec_file: Path, nproc: int, warm: WarmRanks | None) -> int:
    """The kind's check, then attempts until one ends the job (see :func:`run_local`)."""
    try:
        check_code = check_job(spec, spec_file, nproc, warm)  # one error here, not one per rank
    except KeyboardInterrupt:
        print("\nlance_hpc: interrupted before training started; nothing to save", file=sys.stderr, flush=True)
        return ExitCode.INTERRUPTED
    if check_code != 0:
        return check_code
    history: list[Attempt] = []
    while True:
        attempt = Attempt(len(history), time.time(), ["localhost"], nproc)
        history.append(attempt)
        attempt.exit_code, attempt.cause, asked_to_stop = run_ranks(
            spec_file, nproc, attempt_environment(history, spec.slurm.max_restarts), warm
        )
        attempt.ended = time.time()
        if asked_to_stop and attempt.exit_code != 0:
            return attempt.exit_code  # Ctrl-C or a stop signal: a rank that failed on its way out is not restarted
        decision = decide(history, spec.slurm.max_restarts)
        if not decision.restart:
            if decision.exit_code != 0 and attempt.exit_code not in NOT_RESTARTED and len(history) > 1:
                print(
                    f"lance_hpc.launch.local: the job failed after {len(history)} attempts: {decision.reason}",
                    file=sys.stderr,
                    flush=True,
                )
            return decision.exit_code
        failed = attempt.cause.describe() if attempt.cause else f"exit code {attempt.exit_code}"
        print(f"lance_hpc.launch.local: {decision.reason}, {restart_point(spec)}, after: {failed}", file=sys.stderr, flush=True)


def check_job(spec: JobSpec, spec_file: Path, nproc: int, warm: WarmRanks | None) -> int:
    """The kind's check of the job (the built-in training prepares its dataset and checks the task
    against it), printing what it says; 0, or the exit code of a check that crashed. It runs in a
    process forked from ``warm`` when it can, which has imported torch and Lance already (this
    process then never does), else here. Its error is raised here as a UserError, as it would be
    here; Ctrl-C as a KeyboardInterrupt."""
    if warm is not None:
        descriptor, message_file = tempfile.mkstemp(prefix="lance_hpc-check-")
        os.close(descriptor)
        try:
            process = warm.fork(
                child_environment(), [str(spec_file), str(nproc), message_file], "lance_hpc check", job_check.__name__
            )
            if process is not None:
                return checked(process, message_file)
        finally:
            os.unlink(message_file)
    for line in job_check.check_lines(spec, nproc):
        print(line, flush=True)
    return 0


def checked(process: RankProcess, message_file: str) -> int:
    """What the forked check ended with (see :func:`check_job`). It leads a session of its own, so
    a terminal's Ctrl-C reaches it through this process only, once."""
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.send_signal(INTERRUPT_SIGNAL)
        process.wait()
        raise
    if code == ExitCode.INTERRUPTED:
        raise KeyboardInterrupt
    if code == ExitCode.USER_ERROR:
        raise UserError(Path(message_file).read_text() or "the job's check failed: its output above says why")
    if code < 0:
        print(f"lance_hpc.launch.local: the job's check {describe_exit(code)}", file=sys.stderr, flush=True)
        return 128 - code
    return code


def restart_point(spec: JobSpec) -> str:
    """Where the next attempt starts, for the line that says so: a training job from its latest
    checkpoint, or from the start when it saved none yet; the other kinds resume from what they
    recorded (fragments, shards), which is no checkpoint of theirs."""
    if not job_kind(spec.job).trains:
        return "resuming from what the job saved"
    try:
        saved = checkpoint_steps(open_store(spec.checkpoint.dir).names())
    except (OSError, UserError):  # the ranks say what is wrong with the directory
        return RESUMES
    return "from the latest checkpoint" if saved else "from the start (no checkpoint saved yet)"


def attempt_environment(history: list[Attempt], max_restarts: int) -> dict[str, str]:
    """What the ranks of the newest attempt read: its number, the restarts left after it, and after a
    restart when the one before failed (lance_hpc.runtime.attempt)."""
    number = len(history) - 1
    environ = {ATTEMPT_VARIABLE: str(number), RESTARTS_LEFT_VARIABLE: str(max_restarts - number)}
    if number:
        previous = history[-2]
        environ[FAILED_AT_VARIABLE] = f"{previous.failed_at or previous.ended or time.time():.3f}"
        if previous.cause is not None and previous.cause.step is not None:
            environ[FAILED_STEP_VARIABLE] = str(previous.cause.step)
    return environ


def run_ranks(
    spec_file: Path, nproc: int, attempt_env: dict[str, str], warm: WarmRanks | None = None
) -> tuple[int, Cause | None, bool]:
    """One attempt: ``nproc`` ranks started (forked from ``warm`` when it can, else each a fresh
    interpreter), their signals forwarded, waited for; returns the exit code (0, or the first failed
    rank's), after a failure its cause, and whether the launcher was asked to stop (Ctrl-C or a stop
    signal) meanwhile."""
    port = free_port()
    ranks: list[RankProcess] = []
    stops: list[int] = []  # the stop signals received, Ctrl-C's among them
    failures = tempfile.mkdtemp(prefix="lance_hpc-failures-")  # each rank notes how it failed

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum in PREEMPTION_SIGNALS:
            stops.append(signum)
        if signum == INTERRUPT_SIGNAL:
            if stops.count(INTERRUPT_SIGNAL) > 1:
                print(
                    "\nlance_hpc: stopping at once; what was trained since the last checkpoint is lost",
                    file=sys.stderr,
                    flush=True,
                )
                for process in ranks:
                    if process.poll() is None:
                        process.kill()
                return
            print(
                "\nlance_hpc: interrupted; the ranks save a checkpoint at the next step and stop (Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (*PREEMPTION_SIGNALS, PROFILE_SIGNAL)}
    try:
        for rank in range(nproc):
            environ = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                FAILURE_DIR_VARIABLE: failures,
                **attempt_env,
            }
            forked = warm.fork(child_environment(environ), [str(spec_file)], f"lance_hpc r{rank}") if warm else None
            if forked is not None:
                ranks.append(forked)
                continue
            with exec_children():
                ranks.append(
                    subprocess.Popen(
                        python_command("-m", "lance_hpc.run", str(spec_file)),
                        env=child_environment(environ),
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
        code, failed = wait_for_ranks(ranks, stopped_at_once=lambda: stops.count(INTERRUPT_SIGNAL) > 1, failures=failures)
        if stops.count(INTERRUPT_SIGNAL) > 1:
            return ExitCode.INTERRUPTED, None, True
        return code, None if code in NOT_RESTARTED else local_cause(failed, failures), bool(stops)
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()


def local_cause(failed: tuple[int, int] | None, failures: str) -> Cause:
    """Why the ranks failed: the first own error a rank noted, else the rank seen failing first."""
    note = first_note(failures)
    if note is not None and not note["lost_contact"]:
        return cause_from_note(note)
    if failed is None:
        return Cause("exit", "the ranks failed")
    rank, code = failed
    return Cause("killed" if code < 0 else "exit", describe_exit(code), rank, "localhost")


def run_sweep_locally(spec: JobSpec, nproc: int | None) -> int:
    """Run a sweep's runs here one after another. A failed run does not stop the others (each is
    its own experiment); an interrupted one (Ctrl-C) stops the sweep. Returns the first non-zero
    exit code, or 0."""
    runs = expand(spec)
    write_job_files(spec)
    results: list[tuple[SweepRun, int]] = []
    for run in runs:
        print(f"==== sweep run {run.index + 1}/{len(runs)}: {run.spec.name} ({run.describe()})", flush=True)
        code = run_local(JobPaths.of(spec).run_spec(run.index), nproc or run.spec.slurm.world_size)
        results.append((run, code))
        if code in (ExitCode.STOPPED, ExitCode.INTERRUPTED):
            break
    print(f"==== sweep {spec.name}: {sum(code == 0 for _, code in results)} of {len(runs)} runs finished")
    for run, code in results:
        stopped = "stopped; run the same command again to continue"
        outcomes: dict[int, str] = {ExitCode.OK: "finished", ExitCode.STOPPED: stopped, ExitCode.INTERRUPTED: stopped}
        outcome = outcomes.get(code, f"failed (exit {int(code)})")
        print(f"  [{run.index}] {run.spec.name}: {outcome}")
    for run in runs[len(results) :]:
        print(f"  [{run.index}] {run.spec.name}: not started")
    return next((code for _, code in results if code != 0), 0)


def wait_for_ranks(
    ranks: Sequence[RankProcess], stopped_at_once: Callable[[], bool] = lambda: False, failures: str | None = None
) -> tuple[int, tuple[int, int] | None]:
    """Wait for every rank; after the first failure give the others GRACE_S, then kill them.
    ``failures``: the directory where the ranks note how they failed (:func:`note_failure`): the
    last line names the rank whose own error came first, not one that lost contact with it.
    Returns the exit code and (rank, exit code) of the rank seen failing first, if one did."""
    failed: tuple[int, int] | None = None
    deadline = float("inf")
    # every rank polled each time (not any(), which stops at the first one running): a rank that
    # died is noticed even while rank 0 lives on, waiting for it without a collective to fail in
    while None in [process.poll() for process in ranks]:
        if stopped_at_once():
            for process in ranks:
                process.wait()
            return ExitCode.INTERRUPTED, failed
        if failed is None:
            failed = first_failure(ranks)
            if failed is not None:
                rank, code = failed
                print(
                    f"lance_hpc.launch.local: rank {rank} (pid {ranks[rank].pid}) {describe_exit(code)}; "
                    "stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                deadline = time.monotonic() + GRACE_S
        if time.monotonic() > deadline:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
        time.sleep(0.1)
    failed = failed or first_failure(ranks)
    if failed is None:
        codes = {process.returncode for process in ranks}
        for code in (ExitCode.STOPPED, ExitCode.INTERRUPTED):
            if code in codes:
                return code, None
        return ExitCode.OK, None
    rank, code = failed
    note = first_note(failures) if failures else None
    if note is not None and not note["lost_contact"] and 0 <= note["rank"] < len(ranks):
        rank, code = note["rank"], ranks[note["rank"]].returncode
        others = [str(other) for other, process in enumerate(ranks) if other != rank and process.returncode not in (0, None)]
        cause = f": {note['message']}" + (f" (rank {', '.join(others)} then lost contact with it)" if others else "")
    else:
        cause = ""
    print(
        f"lance_hpc.launch.local: the job failed: rank {rank} (pid {ranks[rank].pid}) {describe_exit(code)}{cause}",
        file=sys.stderr,
        flush=True,
    )
    return (code if code > 0 else 128 - code), failed


def first_failure(ranks: Sequence[RankProcess]) -> tuple[int, int] | None:
    """(rank, exit code) of a failed rank, if any. When several failed since the last look, a rank
    killed by a signal is the likelier cause: the others exit with an error once it is gone."""
    failed = [
        (rank, process.returncode)
        for rank, process in enumerate(ranks)
        if process.returncode not in (None, 0, ExitCode.STOPPED, ExitCode.INTERRUPTED)
    ]
    return min(failed, key=lambda item: (item[1] > 0, item[0]), default=None)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
