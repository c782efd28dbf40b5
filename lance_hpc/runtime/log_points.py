"""The metric window of the step loop: what it sums between log points, and what it logs at each.

Between log points every rank adds its batches' samples, its step timings and (when the loop gives
them) the task's metric sums to a :class:`~lance_hpc.runtime.metrics.TrainWindow`; at a log point
one all-reduce turns them into the task's ``train/*`` values and the ``perf/*`` tags, which rank 0's
logger writes."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from lance_hpc.loading import MixLoader, TrainLoader
from lance_hpc.runtime.metrics import MetricLogger, TrainWindow
from lance_hpc.tasks import Task


class LogPoints:
    """The window since the last log point, and the logger it ends in."""

    def __init__(self, logger: MetricLogger, task: Task, device: torch.device, is_main: bool) -> None:
        self.logger, self.task, self.is_main = logger, task, is_main
        self.window = TrainWindow(device, task.metrics)  # reduced once per log point: perf/* and train/*

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.logger.log(scalars, step)

    def close(
        self,
        step: int,
        loader: TrainLoader,
        rank_figures: Callable[[], dict[str, float]],
        epoch_time_s: float | None,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Collective at a log point, one all-reduce (then ``rank_figures``, which may gather too):
        the task's ``train/*`` values (if the loop added metric sums) and the ``perf/*`` tags, both
        logged and returned."""
        self.window.count_store_retries(loader.stats.retries)
        has_sums = self.window.has_sums
        sums, seconds, perf = self.window.reduce()
        perf.update(rank_figures())
        if epoch_time_s is not None:
            perf["perf/epoch_time_s"] = epoch_time_s
        if isinstance(loader, MixLoader):  # the plan knows every rank's draws: no collective
            perf.update(loader.source_figures())
        reported = self.task.report(sums, "train", seconds) if has_sums else {}
        self.logger.log({**reported, **perf}, step)
        return reported, perf

    def note_retries(self, step: int, perf: dict[str, float]) -> None:
        """Rank 0 says when the store failed reads in the window: one line, however many."""
        if self.is_main and perf["data/store_retries"] > 0:
            print(
                f"step {step}: the store failed {perf['data/store_retries']:.0f} batch read(s) since the previous "
                "log point, all read again (retried up to data.io_timeout_s)",
                file=sys.stderr,
                flush=True,
            )
