"""SLURM's preemption warning (USR2) that reaches a rank while it is still starting: importing
torch, forming the process group. Its default action kills the process, which fails the job
instead of requeueing it. ``python -m lance_hpc.run`` holds it from its first line (this module
imports nothing heavy); :class:`lance_hpc.checkpoint.Preemption` takes over what was held, so
the warning is acted on at the first step boundary like one that came later."""

from __future__ import annotations

import signal
from types import FrameType

HELD_SIGNALS = (signal.SIGUSR2,)
received: list[int] = []


def hold() -> None:
    for signum in HELD_SIGNALS:
        signal.signal(signum, _remember)


def _remember(signum: int, frame: FrameType | None) -> None:
    received.append(signum)


def is_holding(handler: object) -> bool:
    """Whether ``handler`` (as signal.signal returned it) is this module's."""
    return handler is _remember
