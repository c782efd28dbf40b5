"""The iterator behind ``ctx.steps(loader)``: the batches of each step, and after each step the
loop's hooks, the log point, the epoch-end hooks, a checkpoint and a stop on preemption, in that
order and at the same step on every rank."""

from __future__ import annotations

import math
import signal
import warnings
from collections.abc import Callable, Iterator

import torch

from lance_hpc.loading import TrainLoader
from lance_hpc.runtime.clock import StepClock
from lance_hpc.runtime.log_points import LogPoints
from lance_hpc.runtime.metrics import Stopwatch
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.runtime.profile import StepProfiler
from lance_hpc.runtime.progress_bar import ProgressBar
from lance_hpc.runtime.rank_watch import RankWatch
from lance_hpc.spec import CheckpointSpec, LoggingSpec, TrainSpec
from lance_hpc.tasks import ROW_ID, Batch


class Preempted(Exception):
    """Raised out of :meth:`Context.steps` once every rank agreed to stop and the state is saved."""

    def __init__(self, step: int, saved: str) -> None:
        super().__init__(f"preempted at step {step}; checkpoint {saved}")
        self.step, self.saved = step, saved


class StopNotHonoured(Exception):
    """A stop signal came while the loop read its loader without :meth:`Context.steps`, the only
    place where the ranks agree to stop and save: the job ends without a checkpoint, and says so."""

    def __init__(self, signum: int, step: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name}, and nothing was saved: the loop reads its loader directly, not through "
            f"ctx.steps(loader), which is where lance_hpc stops the ranks together and saves a checkpoint "
            f"(no checkpoint since step {step})\n  fix: iterate with `for step, batch in ctx.steps(loader):`"
        )
        self.signum = signum


class StepLoop:
    """Steps of ``train.grad_accum`` batches over a training loader, on the context's collaborators;
    ``save`` checkpoints (collective), ``wait`` waits for a checkpoint written in the background,
    ``total_steps`` says where the running loop will end."""

    def __init__(
        self,
        train: TrainSpec,
        logging: LoggingSpec,
        checkpoint: CheckpointSpec,
        device: torch.device,
        clock: StepClock,
        *,
        watch: RankWatch,
        profiler: StepProfiler,
        bar: ProgressBar,
        log_points: LogPoints,
        preemption: Preemption,
        save: Callable[[], str],
        wait: Callable[[], None],
        total_steps: Callable[[], int],
    ) -> None:
        self.train, self.logging, self.checkpoint = train, logging, checkpoint
        self.device, self.clock = device, clock
        self.watch, self.profiler, self.bar, self.log_points, self.preemption = watch, profiler, bar, log_points, preemption
        self.save, self.wait, self.total_steps = save, wait, total_steps
        self.step_hooks: list[Callable[[], None]] = []
        self.epoch_hooks: list[Callable[[], None]] = []
        self._warned_direct = False

    def run(self, loader: TrainLoader) -> Iterator[tuple[int, Batch]]:
        """(step, batch) until the clock is finished (see :meth:`Context.steps`)."""
        clock, accumulate = self.clock, self.train.grad_accum
        while not clock.finished:
            loader.set_epoch(clock.epoch)
            remaining = loader.steps_remaining  # batches; a step takes up to grad_accum of them
            if remaining == 0:  # nothing left of a resumed epoch
                clock.epoch += 1
                continue
            total = math.ceil(loader.epoch_steps / accumulate)
            done = math.ceil((loader.epoch_steps - remaining) / accumulate)
            epoch_watch = Stopwatch()
            with self.bar.epoch(total, done, clock.epoch):
                batches = iter(loader)
                self.watch.progress.new_pass()
                while remaining > 0:
                    count = min(accumulate, remaining)
                    yield from self._one_step(batches, count)
                    remaining -= count
                    if self._after_step(remaining == 0, epoch_watch, loader):
                        return

    def _one_step(self, batches: Iterator[Batch], count: int) -> Iterator[tuple[int, Batch]]:
        """The ``count`` batches of one step, timed; then the step counted."""
        clock, progress = self.clock, self.watch.progress
        clock.micro_batches = count
        step_watch, data_wait = Stopwatch(), 0.0
        self.profiler.before_step(clock.step)
        clock.in_steps = True
        try:
            for index in range(count):
                wait = Stopwatch()
                progress.wait_for_batch(first_of_step=index == 0)
                batch = next(batches)
                data_wait += wait.lap()
                progress.got_batch()
                self.log_points.window.add_samples(len(batch[ROW_ID]))
                clock.accumulating = index < count - 1
                yield clock.step, batch
        finally:
            clock.in_steps, clock.accumulating = False, False
        step_time_s = step_watch.lap()
        clock.step_taken(step_time_s)
        self.log_points.window.add_step(step_time_s, data_wait)
        self.watch.step_done(clock.step, step_time_s, data_wait)
        self.profiler.after_step(clock.step)
        self.bar.advance()

    def _after_step(self, epoch_end: bool, epoch_watch: Stopwatch, loader: TrainLoader) -> bool:
        """What follows a step, on every rank; True once the loop is done."""
        clock = self.clock
        done_all = clock.end_step(epoch_end, self.logging.log_every_steps)
        for hook in self.step_hooks:
            hook()
        if clock.log_due:
            self._log_point(loader, epoch_watch.lap() if epoch_end else None)
        if epoch_end or done_all:
            self.watch.progress.enter("evaluate")
            for hook in self.epoch_hooks:
                hook()
            self.bar.forget()  # an evaluation prints its own line
        saved = None
        if epoch_end or done_all or clock.step % self.checkpoint.every_steps == 0:
            saved = self.save()
        if done_all:
            return True
        if self.preemption.agreed(self.device):
            saved = saved or self.save()
            self.wait()  # the requeued job must find it complete
            raise Preempted(clock.step, saved)
        return False

    def _log_point(self, loader: TrainLoader, epoch_time_s: float | None) -> None:
        """Collective: the window's values logged (see :class:`LogPoints`), shown on the progress bar
        or in the log line, and a note of store retries."""
        self.watch.progress.enter("log")
        step = self.clock.step
        reported, perf = self.log_points.close(step, loader, self.watch.rank_figures, epoch_time_s)
        self.bar.show(reported, perf, step, self.total_steps())
        self.log_points.note_retries(step, perf)

    def direct_batch(self, holds_state: bool, is_main: bool) -> None:
        """For every batch a loader hands out: outside :meth:`run`, a loop that ``holds_state``
        (registered objects) is told once that nothing is saved, and a stop signal ends it."""
        if self.clock.in_steps:
            return
        if not self._warned_direct and holds_state and is_main:
            warnings.warn(
                "this loop iterates its loader directly, not through ctx.steps(loader): what it registered "
                "is never checkpointed, and a preemption cannot stop it at a step boundary; iterate with "
                "`for step, batch in ctx.steps(loader):`",
                stacklevel=4,  # the loop's line: past this method, the context's and the loader's
            )
        self._warned_direct = True
        if self.preemption.received is not None:
            raise StopNotHonoured(self.preemption.received, self.clock.step)
