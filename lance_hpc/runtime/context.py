"""The runtime every job runs on: its entry function gets a :class:`Context` in every rank.

The built-in trainer (:func:`lance_hpc.runtime.trainer.train`) is one such entry, written on this
public API only; a script's ``entry: my_pkg.train:main`` is another. The context gives the rank,
world size and device, the spec and its task, loaders for any task or decoder (every strategy,
equal steps, exactly-once rows, mid-epoch resume), DDP wrapping on the right device, checkpoints of
what you :meth:`~Context.register`, and :meth:`~Context.steps`: the iterator that resumes, shows
progress, logs the ``perf/*`` tags (and the task's ``train/*`` values, from the metric sums the loop
gives :meth:`~Context.add_metric_sums`), saves every ``checkpoint.every_steps`` and at each epoch end,
and stops every rank at the same step when SLURM preempts the job (it saves, then raises
:class:`Preempted`, which lance_hpc turns into a requeue). Every collective goes through the
context, so ranks cannot fall out of step::

    def main(ctx: Context) -> dict[str, float]:
        loader = ctx.train_loader()
        model = ctx.wrap(MyModel())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx.register(model=model, optimizer=optimizer, loader=loader)
        for step, batch in ctx.steps(loader, epochs=3):
            loss = ...
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            ctx.log(ctx.all_reduce({"train/loss": loss.item()}))
        return {}

A step is ``train.grad_accum`` batches: :attr:`Context.accumulating` is true for all but the last
batch of a step (take the optimizer step only after that one), and :meth:`Context.no_sync` skips
DDP's gradient all-reduce while it is.

The rank's main module stays ``lance_hpc.run``: DataLoader workers import your module only to
unpickle what they need, never re-running a script's top level.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.checkpoint.shards.saver import bare
from lance_hpc.loading import TrainLoader
from lance_hpc.runtime import loaders, model_setup
from lance_hpc.runtime.checkpoints import CheckpointManager, Stateful
from lance_hpc.runtime.clock import StepClock
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.runtime.log_points import LogPoints
from lance_hpc.runtime.metrics import MetricLogger
from lance_hpc.runtime.model_setup import ModelSetup
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.runtime.profile import StepProfiler
from lance_hpc.runtime.progress_bar import ProgressBar
from lance_hpc.runtime.rank_watch import RankWatch
from lance_hpc.runtime.step_loop import Preempted as Preempted  # raised out of steps(): part of this module's API
from lance_hpc.runtime.step_loop import StepLoop
from lance_hpc.runtime.watchdog import watch_dir
from lance_hpc.spec import JobSpec
from lance_hpc.tasks import Batch, Decoder, Task


@dataclass(frozen=True)
class Summary:
    """How a rank's job ended: ``completed``, or ``preempted`` (a checkpoint holds the state), or
    ``unsaved`` (a stop signal the loop could not honour: nothing saved), or ``failed`` (a
    ``job: command`` program that exited with an error; the kind said so); ``metrics`` are what the
    entry returned (the built-in trainer: the last validation values)."""

    status: str
    step: int
    epoch: int
    checkpoint: str | None
    metrics: dict[str, float] = field(default_factory=dict)


class Context:
    """What a job's entry function gets in every rank; see the module doc for a loop.

    ``spec``, ``task`` and ``device`` are plain attributes; everything else is read through
    properties and methods. The context is a face over its collaborators: the step clock
    (:mod:`~lance_hpc.runtime.clock`) and the loop that drives it (:mod:`~lance_hpc.runtime.step_loop`),
    the checkpoints (:mod:`~lance_hpc.runtime.checkpoints`), the metric window
    (:mod:`~lance_hpc.runtime.log_points`), the watchdog hookup (:mod:`~lance_hpc.runtime.rank_watch`),
    the profiler (:mod:`~lance_hpc.runtime.profile`), the progress bar
    (:mod:`~lance_hpc.runtime.progress_bar`), the model's setup (:mod:`~lance_hpc.runtime.model_setup`)
    and the loaders (:mod:`~lance_hpc.runtime.loaders`)."""

    def __init__(
        self,
        spec: JobSpec,
        env: DistEnv,
        device: torch.device,
        task: Task,
        logger: MetricLogger,
        preemption: Preemption,
        resumed: Checkpoint | None = None,
        options: Any = None,
    ) -> None:
        self.spec, self.task, self.device = spec, task, device
        self._options = dict(spec.entry_options) if options is None else options
        self._env, self._preemption = env, preemption
        self._clock = StepClock(
            resumed.step if resumed else 0, resumed.epoch if resumed else 0, spec.train.epochs, spec.train.max_steps
        )
        self._checkpoints = CheckpointManager(spec, env, resumed)
        self._models = ModelSetup(spec, task, device, env.world_size, env.is_main, resumed)
        self._log_points = LogPoints(logger, task, device, env.is_main)
        self._watch = RankWatch(spec.train, watch_dir(spec.slurm.log_dir, spec.name, env.job_ref), env, device)
        self._profiler = StepProfiler(spec.train, spec.logging, env.rank, device)
        self._bar = ProgressBar(env.is_main, spec.logging.progress)
        self._stepping: TrainLoader | None = None  # the loader steps() iterates
        self._loop = StepLoop(
            spec.train,
            spec.logging,
            spec.checkpoint,
            device,
            self._clock,
            watch=self._watch,
            profiler=self._profiler,
            bar=self._bar,
            log_points=self._log_points,
            preemption=preemption,
            save=self.save,
            wait=self.wait_for_checkpoint,
            total_steps=lambda: self.total_steps,
        )

    # ---- where this rank runs ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._env.rank

    @property
    def world_size(self) -> int:
        return self._env.world_size

    @property
    def local_rank(self) -> int:
        return self._env.local_rank

    @property
    def is_main(self) -> bool:
        return self._env.is_main

    @property
    def options(self) -> Any:
        """The spec's ``entry_options``: an instance of the entry's ``Options`` model when it declares
        one (``main.Options = MyOptions``, validated with the spec), else the plain mapping."""
        return self._options

    # ---- how far the job is ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken, counting those before a resume (at whatever world sizes)."""
        return self._clock.step

    @property
    def epoch(self) -> int:
        """The epoch being read (the next one, once an epoch's last step is taken)."""
        return self._clock.epoch

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from; None for a fresh start."""
        resumed = self._checkpoints.resumed
        return str(resumed.path) if resumed is not None else None

    @property
    def last_checkpoint(self) -> str | None:
        """The checkpoint this run saved last."""
        return self._checkpoints.last

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of a whole epoch of the loader that steps() iterates, at this world size
        (0 before steps() is called)."""
        loader = self._position_loader()
        if loader is None:
            return 0
        return math.ceil(loader.steps_per_epoch / self.spec.train.grad_accum)

    @property
    def progress(self) -> float:
        """Epochs read so far, counted in samples (the same at any world size): drive a learning-rate
        schedule with it, rather than with steps, and a resumed job on another world size keeps its curve."""
        loader = self._position_loader()
        if loader is None or loader.epoch != self._clock.epoch:
            return float(self._clock.epoch)
        return self._clock.epoch + loader.epoch_fraction()

    @property
    def total_steps(self) -> int:
        """The step the running steps() ends at, if this world size reads the rest (exact unless resized again)."""
        return self._clock.total_steps(self.progress, self.steps_per_epoch)

    @property
    def finished(self) -> bool:
        """The running steps() (or train.epochs and train.max_steps, before it) is done."""
        return self._clock.finished

    @property
    def accumulating(self) -> bool:
        """Inside steps(): more batches of this step follow (train.grad_accum > 1); take the optimizer
        step after the batch for which this is False."""
        return self._clock.accumulating

    @property
    def micro_batches(self) -> int:
        """Inside steps(): the batches of the current step (train.grad_accum, or fewer at an epoch's
        end); divide the loss by it for the mean over the step."""
        return self._clock.micro_batches

    @property
    def step_time_s(self) -> float:
        """In a step-end hook: the wall time of the step just taken, from the request for its first
        batch to the end of the loop's work on its last (data wait included)."""
        return self._clock.step_time_s

    @property
    def log_due(self) -> bool:
        """In a step-end hook: this step is a log point (every logging.log_every_steps, each epoch's
        last step and the last step of all)."""
        return self._clock.log_due

    # ---- building blocks -------------------------------------------------------------------------

    def train_loader(self, decoder: Decoder | None = None) -> TrainLoader:
        """This rank's training batches with the spec's strategy; ``decoder`` defaults to the task's."""
        decoder = decoder or self.task.decoder(train=True)
        loader = loaders.train_loader(self.spec.data, self._checkpoints.resumed, decoder, self._env, self.device)
        loader.watch = self._direct_batch
        return loader

    def eval_loader(self, decoder: Decoder | None = None, uri: str | None = None) -> Iterable[Batch]:
        """This rank's share of data.val_uri (or of ``uri``: a mix source's own validation set).
        Under ddp ranks may get one batch more or less than each other; under fsdp, where a forward
        pass gathers the model's shards from every rank, each rank gets as many batches as the rank
        with the most (the extra ones hold no rows)."""
        return loaders.eval_loader(
            self.spec.data, self.spec.train, decoder or self.task.decoder(train=False), uri, self._env, self.device
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model to call outside the training step (an evaluation): DDP's own module, whose
        forward adds no collective; a sharded model itself (its forward gathers the shards, which
        :meth:`eval_loader` makes every rank do equally often)."""
        return bare(model)

    def build_model(self) -> nn.Module:
        """The task's model, with the initial weights its options name, as the task prepares it. It is
        built on the meta device and initialised where it lives (:mod:`lance_hpc.parallel.materialise`):
        on this rank's device under ddp; under fsdp it stays on the meta device until :meth:`wrap`
        gives each rank its shards. A resumed job checks instead that its checkpoint was written for
        the same task and model (register the model to restore it)."""
        return self._models.build()

    def wrap(self, model: nn.Module, blocks: list[nn.Module] | None = None) -> nn.Module:
        """``model`` on this rank's device, wrapped for train.parallelism (call it before building the
        optimizer): DDP, or FSDP2 shards of each of ``blocks`` (default: the task's
        :meth:`~lance_hpc.tasks.Task.blocks`) and of the root. A model of :meth:`build_model` under
        fsdp is initialised here, each rank computing only its own shards."""
        return self._models.wrap(model, blocks, self._watch)

    def to_device(self, batch: Batch) -> Batch:
        """A batch on this rank's device, as the task prepares it (normalised images, ...)."""
        return self.task.to_device(batch, self.device)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on GPU when train.precision is bf16; a no-op on CPU."""
        return model_setup.precision_context(self.spec.train, self.device)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """DDP's no_sync while :attr:`accumulating` (under fsdp: no gradient reduce-scatter until the
        step's last batch): gradients are reduced once per step."""
        return model_setup.no_sync(model, self._clock.accumulating)

    # ---- checkpoints -----------------------------------------------------------------------------

    def register(self, **objects: Stateful) -> None:
        """Checkpoint these objects (model, optimizer, scheduler, loader, anything with
        ``state_dict``/``load_state_dict``); when the job resumes, each is restored here, in place.
        Register a model together with its optimizer: a sharded checkpoint keys the optimizer's
        state by the model's parameter names."""
        train_loaders = {name: item for name, item in objects.items() if isinstance(item, TrainLoader)}
        for loader in train_loaders.values():
            loader.watch = self._direct_batch
        self._checkpoints.register(objects, train_loaders)

    def save(self) -> str:
        """Collective: checkpoint every registered object now (steps() calls it for you). Under fsdp
        each rank writes its own shards of the model and optimizer (in the background with
        checkpoint.async_save)."""
        self._watch.progress.enter("checkpoint")
        saved = self._checkpoints.save(self._clock.step, self._clock.epoch, self.progress)
        if self._checkpoints.sharded:
            self._log_points.log({"checkpoint/blocked_s": self._checkpoints.saver.blocked_s}, self._clock.step)
        return saved

    def wait_for_checkpoint(self) -> None:
        """Collective: the checkpoint still being written in the background (checkpoint.async_save)
        complete; steps() calls it before a preemption ends the job, lance_hpc at the end."""
        self._checkpoints.wait()

    def out_of_memory(self, error: BaseException) -> str:
        """What the model's state needs per rank and what to change, for a device out of memory."""
        return self._models.out_of_memory(error, self._checkpoints.models())

    # ---- the loop --------------------------------------------------------------------------------

    def on_step_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on every rank after each step, before steps() saves or stops (:attr:`step`
        already counts it; :attr:`log_due` says whether it is a log point)."""
        self._loop.step_hooks.append(hook)

    def on_epoch_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on every rank after each epoch's last step, and after the last step of all,
        before the checkpoint saved there (an evaluation, say; it may be a collective)."""
        self._loop.epoch_hooks.append(hook)

    @contextmanager
    def running(self) -> Iterator[None]:
        """lance_hpc runs the entry inside it (an entry never calls it): the watchdog and the profiler
        started; after, however the entry ended, the shards a failed run was writing given their time
        (no collective: another rank may be gone), the profiler's trace, the logger and watchdog closed."""
        self._watch.start()
        self._profiler.listen()
        try:
            yield
        finally:
            self._checkpoints.wait_quietly(timeout_s=self.spec.train.collective_timeout_s)
            self._profiler.stop(self._clock.step)
            self._log_points.logger.close()
            self._watch.close()

    def steps(self, loader: TrainLoader, epochs: int | None = None, max_steps: int | None = None) -> Iterator[tuple[int, Batch]]:
        """(step, batch) until ``epochs`` (default train.epochs) or ``max_steps`` (default
        train.max_steps), from where a resumed job stopped. ``step`` counts the steps taken before
        this batch's. After each step it calls the step-end hooks, logs ``perf/*`` at log points (with
        the task's ``train/*`` values when the loop gives :meth:`add_metric_sums`), calls the
        epoch-end hooks at an epoch's end, saves every checkpoint.every_steps and at each epoch end,
        and stops all ranks together on preemption (saves, raises :class:`Preempted`)."""
        self._stepping = loader
        loader.watch = self._direct_batch
        self._checkpoints.restore_rng()  # now: building the model drew from the generators
        clock = self._clock
        clock.run_to(epochs or self.spec.train.epochs, max_steps or self.spec.train.max_steps)
        if clock.finished:
            if self.is_main:
                print(clock.already_finished(self.last_checkpoint or self.resumed_from), flush=True)
            return
        yield from self._loop.run(loader)

    # ---- metrics ---------------------------------------------------------------------------------

    def log(self, scalars: dict[str, float], step: int | None = None) -> None:
        """TensorBoard scalars at ``step`` (default: the current step); rank 0 writes. Values are
        this rank's: reduce them with :meth:`all_reduce` first for all-rank figures. Inside steps(),
        the ``train/*`` values also show on the progress bar (or, without one, in the log line
        rank 0 prints at each log point)."""
        self._log_points.log(scalars, self._clock.step if step is None else step)
        self._bar.note(scalars)

    def add_metric_sums(self, sums: torch.Tensor) -> None:
        """Count a batch's metric sums towards the task's ``train/*`` values: ``sums`` is what
        ``task.forward`` returns beside the loss (one value for each name in ``task.metrics``). Call
        it for every batch inside steps(), on every rank; the sums stay on the device. At each log
        point steps() reduces them together with its ``perf/*`` figures, in the same all-reduce, and
        logs ``task.report(sums, "train", seconds)`` (``train/loss``, ...) beside the ``perf/*`` tags;
        a loop that never calls it logs ``perf/*`` only."""
        self._log_points.window.add_sums(sums)

    def all_reduce(self, values: dict[str, float], op: str = "mean") -> dict[str, float]:
        """Collective: ``values`` summed (``op="sum"``) or averaged over all ranks."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be mean or sum, not {op!r}")
        totals = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        if op == "mean":
            totals /= self.world_size
        return dict(zip(values, totals.tolist()))

    # ---- private ---------------------------------------------------------------------------------

    def _position_loader(self) -> TrainLoader | None:
        """The loader whose position measures progress: the one steps() iterates, else the first registered."""
        if self._stepping is not None:
            return self._stepping
        return next((item for item in self._checkpoints.objects.values() if isinstance(item, TrainLoader)), None)

    def _direct_batch(self) -> None:
        """Called by a loader of this context for every batch it hands out (see :meth:`StepLoop.direct_batch`)."""
        self._loop.direct_batch(bool(self._checkpoints.objects), self.is_main)
