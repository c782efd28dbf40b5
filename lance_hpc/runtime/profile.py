"""Profiler traces on demand: ``train.profile: {start_step, steps}`` in the spec, or USR1 sent to a
running job (``scancel --signal=USR1 JOBID`` on SLURM, ``kill -USR1`` of a local launcher), records
a PyTorch profiler trace of a few steps on every rank.

Each rank writes ``<tensorboard_dir>/profile/rank<R>.step<S>.pt.trace.json``: a Chrome trace that
Perfetto (ui.perfetto.dev) and chrome://tracing open, and TensorBoard's PyTorch profiler plugin
reads with ``--logdir <tensorboard_dir>/profile``. CPU activity always; CUDA kernels on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from lance_hpc.runtime.preemption import take_over
from lance_hpc.signals import PROFILE_SIGNAL
from lance_hpc.spec import LoggingSpec, TrainSpec

DEFAULT_STEPS = 5


class StepProfiler:
    """Starts the profiler at a step boundary and stops it ``steps`` steps later (see the module doc)."""

    def __init__(self, train: TrainSpec, logging: LoggingSpec, rank: int, device: torch.device) -> None:
        settings = train.profile
        self.start_step = settings.start_step if settings is not None else None
        self.steps = settings.steps if settings is not None else DEFAULT_STEPS
        self.directory = Path(logging.tensorboard_dir) / "profile"
        self.rank, self.device = rank, device
        self.requested = False
        self.active: Any = None
        self.span: Any = None
        self.started_at = 0
        self.written: list[Path] = []

    def listen(self) -> None:
        """Take PROFILE_SIGNAL as a request for a trace of the next steps (main thread only); one
        that came while the rank started (held since its first line) counts too."""
        if take_over(PROFILE_SIGNAL, self._request):
            self.requested = True

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True

    def before_step(self, step: int) -> None:
        """At a step boundary: start recording when the spec's step comes or a request arrived;
        while recording, open the step's span (``ProfilerStep#<step>``, as the profiler's own)."""
        if self.active is None and (self.requested or step == self.start_step):
            self.requested = False
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities, record_shapes=True)
            self.active.__enter__()
            self.started_at = step
        if self.active is not None:
            self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self.span.__enter__()

    def after_step(self, step: int) -> None:
        """After a step: close its span, and stop and write the trace after ``steps`` steps."""
        if self.active is None:
            return
        self._close_span()
        if step - self.started_at >= self.steps:
            self.stop(step)

    def _close_span(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.__exit__(None, None, None)

    def stop(self, step: int) -> None:
        if self.active is None:
            return
        self._close_span()
        profiler, self.active = self.active, None
        profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.rank}.step{self.started_at}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        self.written.append(path)
        if self.rank == 0:
            print(
                f"profiler trace of steps {self.started_at}..{step - 1} written for every rank: {path} "
                f"(Perfetto or chrome://tracing; tensorboard --logdir {self.directory})",
                file=sys.stderr,
                flush=True,
            )
