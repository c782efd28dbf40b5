"""How far a job got, from what it leaves behind: its TensorBoard events and
the last lines lance_hpc.run printed. Nothing here asks SLURM, so it works for jobs long gone.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lance_hpc.spec import JobSpec

LOSS_TAG, THROUGHPUT_TAG, STEP_TIME_TAG = "train/loss", "perf/samples_per_s", "perf/step_time_s"
RECENT_POINTS = 5  # log points averaged for the seconds per step of the time-left estimate
# What the rendered script prints when SLURM starts (or restarts) the job.
ATTEMPT_START = re.compile(r"^job \d+ \(restart \d+\)", re.MULTILINE)
# The last thing lance_hpc.run prints for each way a job ends, most telling first.
OUTCOMES = (
    (
        re.compile(r"stopped at step (\d+) by (SIG\w+); checkpoint (\S+?);"),
        lambda m: f"stopped at step {m[1]} by {m[2]}, checkpoint {m[3]}",
    ),
    (re.compile(r"final validation (.+) after (\d+) steps"), lambda m: f"finished after {m[2]} steps, validation {m[1]}"),
    (re.compile(r"training finished after (\d+) steps"), lambda m: f"finished after {m[1]} steps"),
    (re.compile(r"lance_hpc\.run: (.+)"), lambda m: f"failed: {m[1]}"),
    # the summary line of a Python traceback (submitit jobs print the rank's exception this way)
    (
        re.compile(r"^(?:\s*\d+: )?((?:\w+\.)*\w*(?:Error|Exception|Failed)): (.+)$", re.MULTILINE),
        lambda m: f"failed: {m[1].rsplit('.', 1)[-1]}: {m[2]}",
    ),
)


@dataclass(frozen=True)
class Logged:
    """The last values rank 0 logged; ``step`` is the step of the last loss (or throughput)."""

    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    seconds_per_step: float | None = None


def last_logged(tensorboard_dir: str) -> Logged:
    """The last loss, throughput and recent seconds per step in the job's TensorBoard events."""
    if not Path(tensorboard_dir).is_dir():
        return Logged()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # TensorBoard's reservoir keeps the newest point of every tag, whatever it samples away.
    events = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 1000})
    events.Reload()
    available = set(events.Tags().get("scalars", ()))
    series = {
        tag: [(point.step, point.value) for point in events.Scalars(tag)]
        for tag in (LOSS_TAG, THROUGHPUT_TAG, STEP_TIME_TAG)
        if tag in available
    }
    last = {tag: points[-1] for tag, points in series.items() if points}
    step = (last.get(LOSS_TAG) or last.get(THROUGHPUT_TAG) or (None, None))[0]
    return Logged(
        step=step,
        loss=last[LOSS_TAG][1] if LOSS_TAG in last else None,
        samples_per_s=last[THROUGHPUT_TAG][1] if THROUGHPUT_TAG in last else None,
        seconds_per_step=recent_seconds_per_step(series.get(STEP_TIME_TAG, [])),
    )


def recent_seconds_per_step(step_times: list[tuple[int, float]], points: int = RECENT_POINTS) -> float | None:
    """Mean of the last ``points`` logged step times (each already a mean over its log window)."""
    recent = [value for _, value in step_times[-points:] if math.isfinite(value) and value > 0]
    return sum(recent) / len(recent) if recent else None


def total_steps(spec: JobSpec) -> int:
    """Optimizer steps of the whole run, as the trainer counts them: epochs of the data plan for
    the spec's world size, in steps of grad_accum batches, capped by train.max_steps."""
    # imported here: the data layer imports torch and Lance, needed only for a running job
    from lance_hpc.loading import plan_data

    batches = plan_data(spec.data, spec.slurm.world_size).steps_per_rank
    per_epoch = math.ceil(batches / spec.train.grad_accum)
    return min(spec.train.max_steps or sys.maxsize, spec.train.epochs * per_epoch)


def seconds_left(step: int, total: int, seconds_per_step: float | None) -> float | None:
    """Steps left times recent seconds per step; None without a rate, 0 once every step is done."""
    if step >= total:
        return 0.0
    if seconds_per_step is None:
        return None
    return (total - step) * seconds_per_step


def format_duration(seconds: float) -> str:
    """``42 s``, ``12 min 5 s``, ``3 h 07 min``, ``2 d 04 h``."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


def outcome_from_log(stdout: str, stderr: str = "") -> str | None:
    """How the job's last run ended, from lance_hpc.run's closing lines (a stop or the end of training
    in ``stdout``, else an error in ``stderr``); None when neither shows one."""
    attempts = list(ATTEMPT_START.finditer(stdout))
    return _last_outcome(stdout[attempts[-1].start() :] if attempts else stdout) or _last_outcome(stderr)


def _last_outcome(text: str) -> str | None:
    best: tuple[int, str] | None = None
    for pattern, describe in OUTCOMES:
        for match in pattern.finditer(text):
            if best is None or match.start() > best[0]:
                best = (match.start(), describe(match))
    return best[1] if best else None
