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
  supervisor says go (:func:`lance_hpc.kinds.standby.wait_if_standby`): a restart then skips
  Python's start-up.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lance_hpc.errors import ExitCode
from lance_hpc.runtime.failures import note_failure
from lance_hpc.runtime.restart_variables import ATTEMPT_VARIABLE, FAILED_AT_VARIABLE, FAILED_STEP_VARIABLE, RESTARTS_LEFT_VARIABLE

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


class RunningJob(Protocol):
    """What :func:`report_restart` needs of the job's :class:`~lance_hpc.runtime.context.Context`."""

    @property
    def step(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def log(self, scalars: dict[str, float], step: int | None = None) -> None: ...

    def on_step_end(self, hook: Callable[[], None]) -> None: ...


def report_restart(context: RunningJob, environ: Mapping[str, str] = os.environ) -> None:
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
