"""How far a job's loop is: the step clock that :class:`~lance_hpc.runtime.context.Context` reads
out as ``ctx.step``, ``ctx.epoch``, ``ctx.finished``, ``ctx.accumulating`` and the rest."""

from __future__ import annotations

import math


class StepClock:
    """Optimizer steps and epochs, counting those before a resume, with where the running
    ``steps()`` stops and what the step under way is (its batches, whether more follow, whether it
    is a log point, how long it took)."""

    def __init__(self, step: int, epoch: int, epochs: int, max_steps: int | None) -> None:
        self.step = step  # optimizer steps taken, counting those before a resume
        self.epoch = epoch  # the epoch being read
        self.epochs, self.max_steps = epochs, max_steps  # where the running steps() stops
        self.in_steps = False  # a batch of steps() is with the loop
        self.accumulating = False  # more batches of this step follow
        self.micro_batches = 1  # the batches of the current step
        self.log_due = False  # the step just taken is a log point
        self.step_time_s = 0.0  # the wall time of the step just taken

    def run_to(self, epochs: int, max_steps: int | None) -> None:
        """Where the next ``steps()`` stops."""
        self.epochs, self.max_steps = epochs, max_steps

    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs or (self.max_steps is not None and self.step >= self.max_steps)

    def total_steps(self, progress: float, steps_per_epoch: int) -> int:
        """The step the running steps() ends at, from ``progress`` (epochs read) at ``steps_per_epoch``."""
        left = (self.epochs - progress) * steps_per_epoch
        estimate = self.step + math.ceil(round(max(left, 0.0), 6))
        return min(estimate, self.max_steps) if self.max_steps is not None else estimate

    def step_taken(self, seconds: float) -> None:
        """Count the step just taken, which took ``seconds``."""
        self.step += 1
        self.step_time_s = seconds

    def end_step(self, epoch_end: bool, log_every_steps: int) -> bool:
        """After the step just taken: count the epoch at its end, and say whether the step is a log
        point (every ``log_every_steps``, at an epoch's end, at the last step of all); True once the
        running steps() is done."""
        if epoch_end:
            self.epoch += 1
        done = self.finished
        self.log_due = self.step % log_every_steps == 0 or epoch_end or done
        return done

    def already_finished(self, checkpoint: str | None) -> str:
        """What steps() says when there is nothing left to train (``checkpoint``: the one it came from)."""
        limit = (
            f"train.max_steps ({self.max_steps})"
            if self.max_steps is not None and self.step >= self.max_steps
            else f"train.epochs ({self.epochs})"
        )
        where = f" ({checkpoint})" if checkpoint else ""
        return (
            f"already finished: step {self.step}, epoch {self.epoch}, reached {limit}; nothing to train"
            f"{where}\n  fix: raise {limit.split(' ')[0]} to train on from here, or give the job a new "
            "checkpoint.dir to start over"
        )
