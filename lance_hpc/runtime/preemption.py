"""Preemption, from the signal to the requeue, in one place.

- SLURM sends USR2 ``signal_delay_s`` before the time limit (submitit uses the same signal); scancel
  and a preemption that SLURM requeues itself send SIGTERM; Ctrl-C on a local run sends SIGINT.
- ``python -m lance_hpc.run`` holds USR2 and USR1 from its first line (:func:`hold`: this module
  imports nothing heavy), since their default action would kill a rank that is still importing
  torch. USR1 asks for a profiler trace: a training job's profiler takes it over, every other job
  kind says, on rank 0, that it ignores it (:func:`ignore_profile_requests`).
- :class:`Preemption` takes over what was held and only remembers the signal; the ranks agree on it
  at a step boundary (:meth:`Preemption.agreed`), save, and stop together.
- Rank 0 then decides (:func:`after_preemption`): only USR2 asks for a requeue, done with ``scontrol
  requeue`` (:func:`requeue_sbatch`), by submitit's own handler, or, in a container, by the batch
  script's handler (:func:`requeue_handler`) once srun has ended.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from lance_hpc.errors import UserError
from lance_hpc.runtime.restart_variables import REQUEUE_REQUEST_VARIABLE
from lance_hpc.signals import INTERRUPT_SIGNAL, PREEMPTION_SIGNALS, PROFILE_SIGNAL, REQUEUE_SIGNAL

if TYPE_CHECKING:
    import torch

    from lance_hpc.runtime.environment import DistEnv
    from lance_hpc.spec import JobSpec, SlurmSpec

# The shell function that acts on that request; a site template must include requeue_handler.
REQUEUE_FUNCTION = "requeue_if_asked"
# Held by hold() until Preemption (USR2), or the profiler or ignore_profile_requests (USR1), take over.
HELD_SIGNALS = (REQUEUE_SIGNAL, PROFILE_SIGNAL)
received: list[int] = []


def hold(signals: tuple[int, ...] = HELD_SIGNALS) -> None:
    """Remember ``signals`` instead of dying of them until the rank is ready to act on them."""
    for signum in signals:
        signal.signal(signum, _remember)


def _remember(signum: int, frame: FrameType | None) -> None:
    received.append(signum)


def is_holding(handler: object) -> bool:
    """Whether ``handler`` (as signal.signal returned it) is this module's."""
    return handler is _remember


def take_over(signum: int, handler: Callable[[int, FrameType | None], Any]) -> bool:
    """Install ``handler`` for ``signum``; True when ``signum`` arrived while :func:`hold` held it."""
    return is_holding(signal.signal(signum, handler)) and signum in received


def ignore_profile_requests(kind: str, rank: int) -> None:
    """For a job kind without training steps to profile (ingest, infer, evaluate): USR1, which
    ``scancel --signal=USR1`` sends to every process of the job, must not end it. Rank 0 says so in
    one line per request, written with one unbuffered write (a signal handler must not re-enter
    the buffered stream the job may be printing to); the other ranks ignore it silently."""
    line = (
        f"lance_hpc.run: USR1 ignored: it asks for a profiler trace of training steps, which a job: {kind} "
        "does not take (job: train records one)\n"
    ).encode()

    def say(signum: int, frame: FrameType | None) -> None:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.write(2, line)

    if take_over(PROFILE_SIGNAL, say):
        say(PROFILE_SIGNAL, None)


class Preemption:
    """Remembers that SLURM asked the job to stop; the trainer acts on it at a step boundary.

    The handler only sets a flag: saving from inside a signal handler would race the step in
    progress, and the ranks must agree before anyone saves. Use as a context manager; the
    previous handlers (submitit's, in a submitit job) are kept in :attr:`previous`.
    """

    def __init__(self, signals: tuple[int, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None  # the strongest signal this rank got
        self.agreed_signal: int | None = None  # after agreed(): the strongest any rank got
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        for signum in self.signals:
            previous = signal.signal(signum, self._on_signal)
            if is_holding(previous):  # held while the rank started: act on them now
                previous = signal.SIG_DFL
                if signum in received:
                    self._on_signal(signum, None)
            self.previous[signum] = previous
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None or PREEMPTION_SIGNALS.index(signum) > PREEMPTION_SIGNALS.index(self.received):
            self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank when any rank received a signal (then see agreed_signal)."""
        import torch  # here, not at the top: hold() must be importable before torch is
        import torch.distributed as dist

        code = 0 if self.received is None else PREEMPTION_SIGNALS.index(self.received) + 1
        flag = torch.tensor(code, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed_signal = PREEMPTION_SIGNALS[int(flag.item()) - 1] if flag.item() else None
        return self.agreed_signal is not None


def requeue_sbatch(env: DistEnv, max_requeues: int, request_file: str | None = None) -> tuple[bool, str]:
    """Rank 0 of an sbatch job puts it (or its run of a job array) back in the queue; returns
    (requeued, message). In a container, where scontrol is rarely installed, it creates
    ``request_file`` instead, and the batch script requeues the job once srun has ended."""
    job = env.job_ref
    if env.restart_count >= max_requeues:
        return False, (
            f"not requeued: job {job} has been requeued {env.restart_count} times already "
            f"(slurm.max_requeues: {max_requeues}); submit it again to continue from the checkpoint"
        )
    which = f"requeue {env.restart_count + 1} of at most {max_requeues}"
    if request_file:
        try:
            Path(request_file).write_text(f"{job}\n")
        except OSError as error:
            return False, (
                f"cannot ask the batch script to requeue job {job}: {request_file}: {error.strerror}; "
                "mount slurm.log_dir in the container at the same path"
            )
        return True, f"asked the batch script to requeue job {job} ({which})"
    result = _spared_run([*SCONTROL_REQUEUE, str(job)])
    if result.returncode != 0 and not _requeued_since(str(job), env.restart_count):
        said = result.stderr.strip() or result.stdout.strip() or _ended_by(result.returncode)
        return False, f"scontrol requeue {job} failed: {said}"
    return True, f"requeued job {job} ({which})"


# A requeue that takes ends the job's step at once: slurmstepd's SIGTERM reaches every process in
# it, scontrol too, which could die before it reports its success; and a warning signal sent to the
# step again (scancel retries one it could not deliver to every node) would kill scontrol before it
# asks. It ignores both here, and starts with them blocked (a blocked signal stays blocked across
# fork and exec), so one sent before the shell's trap ran waits and is then ignored.
SPARED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
SPARED_TRAP = "trap '' " + " ".join(signum.name.removeprefix("SIG") for signum in SPARED_SIGNALS)
SCONTROL_REQUEUE = ["sh", "-c", f'{SPARED_TRAP}; exec scontrol requeue "$1"', "scontrol"]


def _spared_run(command: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end, started with :data:`SPARED_SIGNALS` blocked (in this thread
    only while it starts: one sent to this process meanwhile is delivered once it has)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SPARED_SIGNALS)
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _requeued_since(job: str, restart_count: int) -> bool:
    """Whether SLURM counts a requeue of ``job`` beyond ``restart_count``: scontrol may fail to say
    so (killed, or timed out on a busy controller) though the requeue took."""
    from lance_hpc.slurm import queue  # here: a rank imports the SLURM client only to requeue

    try:
        shown = queue.show_job(job)
    except UserError:
        return False
    return shown is not None and shown.restarts is not None and shown.restarts > restart_count


def _ended_by(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return "killed"
    return f"exit code {returncode}, nothing printed"


# How a preempted job gets back into the queue: (env, spec, preemption) -> (requeued, message).
Requeue = Callable[["DistEnv", "JobSpec", "Preemption"], tuple[bool, str]]


def after_preemption(env: DistEnv, spec: JobSpec, preemption: Preemption, requeue: Requeue) -> tuple[bool, str]:
    """Rank 0's decision once the ranks stopped on a signal: only USR2 asks for a requeue."""
    if preemption.agreed_signal == INTERRUPT_SIGNAL:
        return False, "run the same command again to continue"
    if preemption.agreed_signal != REQUEUE_SIGNAL:
        return False, (
            "not requeued: a cancelled job ends here and SLURM requeues a preempted one itself; "
            "run or submit it again to resume from the checkpoint"
        )
    return requeue(env, spec, preemption)


def requeue_with_scontrol(env: DistEnv, spec: JobSpec, preemption: Preemption) -> tuple[bool, str]:
    """sbatch jobs: ``scontrol requeue`` up to slurm.max_requeues (in a container: a request the
    batch script carries out, see render.requeue_handler); other launchers just stop."""
    if env.launcher != "slurm":
        return False, "run the same command again to resume from the checkpoint"
    request_file = os.environ.get(REQUEUE_REQUEST_VARIABLE) if spec.slurm.container else None
    return requeue_sbatch(env, spec.slurm.max_requeues, request_file)


def requeue_with_submitit(env: DistEnv, spec: JobSpec, preemption: Preemption) -> tuple[bool, str]:
    """submitit jobs: run submitit's own USR2 handler now, at the step boundary. It calls
    SubmititJob.checkpoint, requeues within the executor's max_num_timeout, then exits.

    In a container submitit's handler would need scontrol there; the batch script requeues instead,
    and the spec path submitit pickled is all a resumed task needs."""
    import submitit

    handler = preemption.previous.get(signal.SIGUSR2)
    if not callable(handler) or spec.slurm.container:
        return requeue_with_scontrol(env, spec, preemption)
    # submitit runs scontrol itself: ignored here, these signals stay ignored in it (see SCONTROL_REQUEUE)
    kept = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SPARED_SIGNALS}
    try:
        handler(signal.SIGUSR2, None)
    except SystemExit:  # submitit requeued the job and ends this task; the other ranks hear it first
        return True, "requeued by submitit"
    except submitit.core.utils.UncompletedJobError as error:
        return False, str(error)
    except subprocess.CalledProcessError as error:
        if _requeued_since(str(env.job_ref), env.restart_count):
            return True, "requeued by submitit"
        return False, f"submitit's scontrol requeue failed: {_ended_by(error.returncode)}"
    finally:
        for signum, previous in kept.items():
            signal.signal(signum, previous)
    return False, "submitit did not requeue the job"


def requeue_handler(slurm: SlurmSpec) -> list[str]:
    """For a job in a container: shell that requeues the job after srun when rank 0 asked for it.

    Rank 0 checked slurm.max_requeues before asking. An array task is requeued as
    ARRAYID_TASKID: the bare array job id would requeue every run of the sweep.
    """
    if slurm.container is None:
        return []
    request = f'{shlex.quote(slurm.log_dir)}/requeue-"$SLURM_JOB_ID"'
    return [
        f"export {REQUEUE_REQUEST_VARIABLE}={request}",
        f'rm -f "${REQUEUE_REQUEST_VARIABLE}"',
        f"{REQUEUE_FUNCTION}() {{",
        f'    [ -e "${REQUEUE_REQUEST_VARIABLE}" ] || return 0',
        f'    rm -f "${REQUEUE_REQUEST_VARIABLE}"',
        "    local job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}",
        "    job=${job:-$SLURM_JOB_ID}",
        f'    echo "requeueing job $job (requeue $((${{SLURM_RESTART_COUNT:-0}} + 1)) of at most {slurm.max_requeues})"',
        # SLURM's SIGTERM to this script as the requeue takes (or a warning signal again) must not cut scontrol short
        f'    if ({SPARED_TRAP}; exec scontrol requeue "$job"); then',
        "        sleep 300  # SLURM ends this script as it requeues the job; exiting first would race the requeue",
        "    else",
        '        echo "scontrol requeue $job failed; submit the job again to resume from its checkpoint" >&2',
        "    fi",
        "}",
        f"trap {REQUEUE_FUNCTION} EXIT",
    ]
