"""What rank 0 shows of the loop: a progress bar per epoch with the task's ``train/*`` values, or,
with ``logging.progress: false``, one line per log point."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lance_hpc.output import ProgressDisplay, progress_bar

# The tags of each rank's own figures (written by lance_hpc.runtime.rank_watch): TensorBoard's, not the line's.
PER_RANK = "perf/rank/"


class ProgressBar:
    """The bar of the epoch being read (drawn on rank 0 with logging.progress) and the scalars
    logged since the last log point, which it shows there."""

    def __init__(self, is_main: bool, progress: bool) -> None:
        self.is_main, self.progress = is_main, progress
        self._bar: ProgressDisplay | None = None
        self._shown: dict[str, float] = {}  # scalars logged at the current log point: the bar and the log line

    @contextmanager
    def epoch(self, total: int, done: int, epoch: int) -> Iterator[None]:
        """The bar of ``epoch`` (counted from 0, shown from 1 as every line that names one counts
        them), ``done`` of its ``total`` steps already taken: a bar on a terminal, plain lines in a
        log file (:func:`lance_hpc.output.progress_bar`)."""
        bar = progress_bar(total, f"epoch {epoch + 1}", done=done, unit="steps", enabled=self.is_main and self.progress)
        with bar as self._bar:
            yield
        self._bar = None

    def advance(self) -> None:
        """One step taken."""
        if self._bar is not None:
            self._bar.update()

    def note(self, scalars: dict[str, float]) -> None:
        """Scalars the loop logged: shown at the next log point."""
        self._shown.update(scalars)

    def forget(self) -> None:
        """Drop what was noted (an evaluation prints its own line)."""
        self._shown.clear()

    def show(self, reported: dict[str, float], perf: dict[str, float], step: int, total_steps: int) -> None:
        """At a log point: the task's values (``reported``) and what the loop logged on the bar, or,
        without a bar, everything in one line from rank 0."""
        shown, self._shown = {**reported, **self._shown, **perf}, {}  # the task's values lead the line
        train = {tag: value for tag, value in shown.items() if tag.startswith("train/") and tag != "train/lr"}
        if self._bar is not None:
            self._bar.set_postfix({tag.split("/", 1)[1]: f"{value:.3f}" for tag, value in list(train.items())[:3]})
        if self.is_main and not self.progress:  # each rank's figures go to TensorBoard only: a line
            # as long as the world is wide would be unreadable, and SLURM cuts lines over 1 KiB in two
            values = ", ".join(f"{tag} {value:.4g}" for tag, value in shown.items() if not tag.startswith(PER_RANK))
            print(f"step {step}/{total_steps}: {values}", flush=True)
