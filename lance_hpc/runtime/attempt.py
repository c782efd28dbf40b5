"""This rank's attempt inside the job's allocation, as the restart supervisor
(:mod:`lance_hpc.launch.restarts`, or the local launcher) started it.

- The step a rank failed at goes into its failure note (:func:`remember_step`, :func:`failed_step`):
  the same error at the same step twice stops the job instead of restarting it again.
- After a restart, rank 0 reports what it cost at the first step: ``restarts/downtime_s`` (from the
  failure to this step), ``restarts/steps_redone`` (steps since the checkpoint it resumed from) and
  ``restarts/attempt`` in TensorBoard, and one line in the log (:func:`report_restart`).
- With restarts left, a hang the watchdog names ends the attempt at once (:func:`end_step_on_hang`)
  instead of waiting for the collective timeout: the next attempt starts from the checkpoint.
- A rank of a standby step (the next attempt, started ahead) waits with its imports done until the
  supervisor says go (:func:`wait_if_standby`): a restart then skips Python's start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lance_hpc.errors import ExitCode, note_failure

if TYPE_CHECKING:
    from lance_hpc.runtime.context import Context

# Set by the supervisor for each attempt (the same names as in lance_hpc.launch.restarts, which
# runs without lance_hpc and cannot import them).
ATTEMPT_VARIABLE = "LANCE_HPC_ATTEMPT"
RESTARTS_LEFT_VARIABLE = "LANCE_HPC_RESTARTS_LEFT"
FAILED_AT_VARIABLE = "LANCE_HPC_FAILED_AT"
FAILED_STEP_VARIABLE = "LANCE_HPC_FAILED_STEP"
STANDBY_VARIABLE = "LANCE_HPC_STANDBY"
# How often a waiting standby rank looks for its go file: the delay it adds to a restart, and the
# metadata reads it costs a shared file system while it waits (one per rank per interval).
STANDBY_POLL_S = 0.2
# A waiting standby rank ends quietly on these (srun passes SIGTERM on; submitit's task would ignore it).
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_failed_step: list[int | None] = [None]


def remember_step(step: int) -> None:
    """The step this rank was at when an error left its loop (for its failure note)."""
    _failed_step[0] = step


def failed_step() -> int | None:
    return _failed_step[0]


@dataclass(frozen=True)
class Restart:
    """What the attempt before this one left: when it failed, and the furthest step it reached."""

    attempt: int  # this attempt's number in the allocation (1 for the first restart)
    failed_at: float  # seconds since the epoch
    failed_step: int | None


def restarted(environ: Mapping[str, str] = os.environ) -> Restart | None:
    """This attempt's :class:`Restart`, or None for a first attempt (or a rank no supervisor started)."""
    try:
        attempt = int(environ.get(ATTEMPT_VARIABLE) or 0)
        failed_at = float(environ[FAILED_AT_VARIABLE])
        step_text = environ.get(FAILED_STEP_VARIABLE)
        step = int(step_text) if step_text else None
    except (KeyError, ValueError):
        return None
    return Restart(attempt, failed_at, step) if attempt > 0 else None


def report_restart(context: Context, environ: Mapping[str, str] = os.environ) -> None:
    """After a restart: at the first step, log what the failure cost (module doc)."""
    restart = restarted(environ)
    if restart is None:
        return
    resumed_at = context.step
    reported = [False]

    def report() -> None:
        if reported[0]:
            return
        reported[0] = True
        downtime = max(time.time() - restart.failed_at, 0.0)
        scalars = {"restarts/attempt": float(restart.attempt), "restarts/downtime_s": downtime}
        redone = ""
        if restart.failed_step is not None:
            scalars["restarts/steps_redone"] = float(max(restart.failed_step - resumed_at, 0))
            redone = f"; {int(scalars['restarts/steps_redone'])} step(s) since the checkpoint at step {resumed_at} redone"
        context.log(scalars)
        if context.is_main:
            print(
                f"restart {restart.attempt}: first step {downtime:.1f} s after the failure (step {context.step}){redone}",
                flush=True,
            )

    context.on_step_end(report)


def end_step_on_hang(environ: Mapping[str, str] = os.environ) -> Callable[[dict[str, Any]], None] | None:
    """For rank 0's watchdog, when the supervisor has a restart left: a function that notes the
    stuck rank's hang and ends this process, which ends the step (srun --kill-on-bad-exit, or the
    local launcher) so that the next attempt starts; None otherwise (the watchdog only reports)."""
    if int(environ.get(RESTARTS_LEFT_VARIABLE) or 0) <= 0:
        return None

    def end(stuck: dict[str, Any]) -> None:
        from lance_hpc.runtime.watchdog import PHASES

        phase = PHASES.get(stuck.get("phase", ""), stuck.get("phase", ""))
        note_failure(
            int(stuck["rank"]),
            f"hung {phase} (named by the watchdog)",
            lost_contact=False,
            step=stuck.get("step"),
            what="hang",
            host=stuck.get("host"),
        )
        print(
            "lance_hpc.watchdog: ending this attempt so that the job starts again from its checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(ExitCode.FAILED)

    return end


def wait_if_standby(spec_file: str, environ: dict[str, str] | os._Environ = os.environ) -> None:
    """In a rank of a standby step: import what the job will (:func:`warm_up`), then wait until
    the supervisor's go file says go, take the variables it brings and run; or that this step is
    not needed, then end."""
    go = environ.get(STANDBY_VARIABLE)
    if not go:
        return
    from lance_hpc.runtime import preemption

    # USR2 and USR1 reach every step of the job: while it waits, a standby rank must not act on them
    # (submitit's own USR2 handler would requeue the job from here, before the running ranks save)
    previous = {signum: signal.getsignal(signum) for signum in (*preemption.HELD_SIGNALS, *QUIT_SIGNALS)}
    preemption.hold()
    for signum in QUIT_SIGNALS:  # the supervisor cancels a standby step that never read its go file so
        signal.signal(signum, lambda signum, frame: os._exit(0))
    warm_up(spec_file)
    rank = environ.get("SLURM_PROCID") or environ.get("RANK") or "0"
    with contextlib.suppress(OSError):  # the supervisor counts these to say the standby is ready
        Path(f"{go}.ready-{rank}").touch()
    while True:
        try:
            message = json.loads(Path(go).read_text())
            break
        except (OSError, ValueError):  # not written yet (it is renamed into place whole)
            time.sleep(STANDBY_POLL_S)
    if message.get("cancel"):
        os._exit(0)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    environ.update(message.get("environ", {}))
    environ.pop(STANDBY_VARIABLE, None)


# What a rank imports only on first use, after its start: a standby rank imports them ahead.
WARM_MODULES = ("lance", "lance.dataset", "pyarrow.dataset", "torch.utils.tensorboard", "lance_hpc.runtime.trainer")


def warm_up(spec_file: str) -> None:
    """Import the job's own code (its task, entry and kind, as the rank loads them) and what the
    run imports on first use; nothing that opens files of the job or talks to other ranks. A
    failure here is left for the run itself to report."""
    import importlib

    from lance_hpc.kinds import job_kind
    from lance_hpc.spec import load_spec_text
    from lance_hpc.spec.load import read_own_text

    deterministic = False
    with contextlib.suppress(Exception):
        spec = load_spec_text(read_own_text(spec_file), spec_file).spec
        job_kind(spec.job)
        deterministic = spec.train.deterministic
    # torch.use_deterministic_algorithms imports torch._inductor.config: seconds of imports
    for module in [*WARM_MODULES, *(["torch._inductor.config"] if deterministic else [])]:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
