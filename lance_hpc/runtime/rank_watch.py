"""A rank's side of the watchdog (:mod:`lance_hpc.runtime.watchdog`): the loop's hookup to it.

The context marks each phase on the rank's :class:`~lance_hpc.runtime.watchdog.Progress`, which the
watchdog thread publishes and watches; DDP's comm hook marks the step's first gradient bucket, so
that a rank waiting for the others is told from a stuck one; and at each log point the ranks gather
their own work and data wait per step, for TensorBoard and the straggler check."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lance_hpc.runtime import attempt
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.runtime.progress_bar import PER_RANK
from lance_hpc.runtime.watchdog import Progress, Stragglers, Watchdog, host_name
from lance_hpc.spec import TrainSpec


class RankWatch:
    """What this rank is doing (:attr:`progress`) and its timings since the last log point."""

    def __init__(self, train: TrainSpec, directory: Path, env: DistEnv, device: torch.device) -> None:
        """``directory``: where the ranks' watchdogs meet (:func:`~lance_hpc.runtime.watchdog.watch_dir`)."""
        self.progress = Progress()
        self.train, self.directory, self.env, self.device = train, directory, env, device
        self.world_size, self.is_main = env.world_size, env.is_main
        settings = train.watchdog
        self._watchdog: Watchdog | None = None
        self._stragglers = Stragglers(settings.straggler_factor) if settings is not None else None
        self._hosts: list[str] | None = None
        self._own_s, self._wait_s, self._timed_steps = 0.0, 0.0, 0  # this rank's work and data wait since the last log point

    def start(self) -> None:
        """This rank's watchdog thread (train.watchdog), unless the spec turns it off."""
        settings = self.train.watchdog
        if settings is None:
            return
        # fire well before the collective timeout ends the job with nothing said
        ceiling = max(self.train.collective_timeout_s * 0.5, 1.0)
        on_hang = attempt.end_step_on_hang() if self.is_main else None  # with restarts left, a hang ends the attempt
        self._watchdog = Watchdog(
            self.progress,
            self.directory,
            self.env.rank,
            self.world_size,
            settings.factor,
            settings.floor_s,
            ceiling,
            on_hang=on_hang,
        )
        self._watchdog.start()

    def close(self) -> None:
        """The watchdog thread stopped."""
        if self._watchdog is not None:
            self._watchdog.close()

    def step_done(self, step: int, step_time_s: float, data_wait_s: float) -> None:
        """Count a step's own work (up to its first gradient bucket, when DDP sent one) and data wait."""
        own = self.progress.own_s
        self._own_s += own if own is not None else step_time_s - data_wait_s
        self._wait_s += data_wait_s
        self._timed_steps += 1
        self.progress.step_done(step, step_time_s)

    def rank_figures(self) -> dict[str, float]:
        """Collective: each rank's own work and data wait per step since the last log point, as
        TensorBoard tags; a straggler is named in the log (see :class:`Stragglers`)."""
        steps = max(self._timed_steps, 1)
        mine = torch.tensor([self._own_s / steps, self._wait_s / steps], dtype=torch.float64, device=self.device)
        self._own_s, self._wait_s, self._timed_steps = 0.0, 0.0, 0
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        own = [float(value[0]) for value in gathered]
        wait = [float(value[1]) for value in gathered]
        if self._stragglers is not None and self._hosts is None:  # once: every rank's node, to name a straggler's
            hosts: list[Any] = [None] * self.world_size
            dist.all_gather_object(hosts, host_name())
            self._hosts = [str(host) for host in hosts]
        if self.is_main and self._stragglers is not None:
            named = self._stragglers.check(own, wait, self._hosts)
            if named:
                print(named, file=sys.stderr, flush=True)
        if self.world_size == 1:
            return {}
        figures = {f"{PER_RANK}{rank}/own_work_s": value for rank, value in enumerate(own)}
        figures.update({f"{PER_RANK}{rank}/data_wait_s": value for rank, value in enumerate(wait)})
        return figures

    def hook(self, wrapped: DistributedDataParallel) -> None:
        """DDP's gradient all-reduce, noting the step's first bucket on :attr:`progress`."""
        progress = self.progress

        def all_reduce_noting_the_first_bucket(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
            progress.first_bucket()  # the watchdog tells a rank waiting for others from a stuck one
            return allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings)
        all_reduce_noting_the_first_bucket.__annotations__.update(
            {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        )
        wrapped.register_comm_hook(None, all_reduce_noting_the_first_bucket)
