"""The built-in DDP training loop, for any task: :func:`train` resumes, then alternates epochs of
:func:`train_step`, checkpoints and evaluation until the last step or a preemption.

The loop knows nothing of images or tokens: the task moves a batch to the device, computes the
loss and the metric sums, and turns reduced sums into reported values. Every collective (metric
reduction, preemption agreement, checkpoint, evaluation) happens at the same step on every rank,
and every rank takes the same number of steps.

Progress is counted in samples, not in optimizer steps: the learning-rate schedule follows the
epochs read (:attr:`TrainingRun.progress`), so a job resumed on another world size continues the
same curve, with the per-rank batch kept and the peak learning rate rescaled by the linear rule.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from lance_hpc import data
from lance_hpc.data import TrainLoader
from lance_hpc.runtime import checkpoint
from lance_hpc.runtime.checkpoint import Checkpoint
from lance_hpc.runtime.context import Summary, precision_context, wrap_model
from lance_hpc.runtime.environment import DistEnv, configure_process
from lance_hpc.runtime.metrics import (
    MetricLogger,
    Stopwatch,
    TrainWindow,
    build_logger,
    flatten,
)
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.tasks import ROW_ID, Batch, Task


@dataclass
class Schedule:
    """Linear warmup, then cosine decay to zero, as a function of the epochs read; ``steps_per_epoch``
    (at this world size) only sets the granularity, so the curve is the same at any world size."""

    optimizer: torch.optim.Optimizer
    peak_lr: float
    warmup_epochs: float
    total_epochs: float
    steps_per_epoch: int
    lr: float = 0.0  # what the last apply() set

    def apply(self, progress: float) -> float:
        """Set the learning rate for the step taken at ``progress`` (epochs read so far)."""
        per_epoch = self.steps_per_epoch
        self.lr = self.peak_lr * lr_factor(progress * per_epoch, self.warmup_epochs * per_epoch,
                                           self.total_epochs * per_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        return self.lr


@dataclass
class TrainingRun:
    """What the loop works with; ``step`` counts optimizer steps since the start of training (at
    whatever world sizes they were taken), ``epoch`` is the epoch being read."""

    spec: JobSpec
    env: DistEnv
    device: torch.device
    task: Task
    loader: TrainLoader
    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    logger: MetricLogger
    step: int = 0
    epoch: int = 0
    window: TrainWindow = field(init=False)

    def __post_init__(self) -> None:
        self.window = TrainWindow(self.device, self.task.metrics)

    @property
    def progress(self) -> float:
        """Epochs read so far, in samples: the finished epochs plus the share of this one."""
        return self.epoch + (self.loader.epoch_fraction() if self.loader.epoch == self.epoch else 0.0)

    @property
    def finished(self) -> bool:
        """train.epochs read, or train.max_steps optimizer steps taken."""
        max_steps = self.spec.train.max_steps
        return self.epoch >= self.spec.train.epochs or (max_steps is not None and self.step >= max_steps)

    def autocast(self) -> torch.autocast:
        return precision_context(self.spec.train, self.device)


def train(spec: JobSpec, env: DistEnv, device: torch.device, preemption: Preemption, task: Task) -> Summary:
    configure_process(spec.train.seed, spec.train.deterministic, env, device)
    run = build_run(spec, env, device, task, checkpoint.find_resume_point(spec))
    saved, metrics = None, None
    try:
        while not run.finished:
            ended_by = train_epoch(run, preemption)
            if ended_by == "preempted":
                return Summary("preempted", run.step, run.epoch, str(save(run)))
            due = run.finished or run.epoch % spec.train.eval_every_epochs == 0
            metrics = evaluate(run) if due else None
            saved = save(run)
            if not run.finished and preemption.agreed(device):
                return Summary("preempted", run.step, run.epoch, str(saved))
        metrics = metrics or evaluate(run)
    finally:
        run.logger.close()
    report_final(run, metrics)
    return Summary("completed", run.step, run.epoch, str(saved) if saved else None, metrics or {})


def build_run(spec: JobSpec, env: DistEnv, device: torch.device, task: Task, resumed: Checkpoint | None) -> TrainingRun:
    loader = data.build_train_loader(checkpoint.pinned_data(spec.data, resumed), task.decoder(train=True),
                                     env.rank, env.world_size, pin_memory=device.type == "cuda")
    model = task.build_model()
    if resumed:
        checkpoint.restore_model(model, resumed, spec, task.options)
    ddp = wrap_model(task.prepare_model(model, device), device, spec.train.deterministic)
    optimizer = build_optimizer(model, spec.train, peak_lr(spec, env.world_size))
    step, epoch = (resumed.step, resumed.epoch) if resumed else (0, 0)
    if resumed:
        optimizer.load_state_dict(resumed.state["optimizer"])
        checkpoint.restore_rank(resumed, env, spec.train.seed, loader)
    steps_per_epoch = math.ceil(loader.steps_per_epoch / spec.train.grad_accum)
    schedule = Schedule(optimizer, peak_lr(spec, env.world_size), spec.train.warmup_epochs,
                        float(spec.train.epochs), steps_per_epoch)
    logger = build_logger(spec.logging.tensorboard_dir, env.is_main, purge_step=step if resumed else None)
    hparams = {**flatten(spec.redacted_dict()), "world_size": env.world_size, "peak_lr": schedule.peak_lr}
    logger.log_hparams(hparams, (f"val/{task.headline_metric}", "val/loss"))
    run = TrainingRun(spec, env, device, task, loader, ddp, optimizer, schedule, logger, step, epoch)
    if spec.train.max_steps is not None:  # the schedule ends where max_steps will stop this world size
        steps_left = max(spec.train.max_steps - step, 0)
        schedule.total_epochs = min(schedule.total_epochs, run.progress + steps_left / steps_per_epoch)
    schedule.apply(run.progress)
    if resumed and env.is_main:
        print(checkpoint.resume_message(resumed, run.progress, env.world_size, spec.data.batch_size,
                                        spec.train.grad_accum, schedule.peak_lr), flush=True)
    return run


def peak_lr(spec: JobSpec, world_size: int) -> float:
    """The linear scaling rule: lr grows with the global batch (Goyal et al., 2017)."""
    if spec.train.lr_scaling == "none":
        return spec.train.lr
    global_batch = spec.data.batch_size * world_size * spec.train.grad_accum
    return spec.train.lr * global_batch / spec.train.base_batch_size


def lr_factor(step: float, warmup_steps: float, total_steps: float) -> float:
    """Linear warmup to the peak, then cosine decay to zero at the last step. Steps are fractional
    when progress is counted in samples (a job resumed on another world size): the warmup then
    stops at the peak rather than overshoot it by up to one step's worth."""
    if step < warmup_steps:
        return min((step + 1) / warmup_steps, 1.0)
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: nn.Module, train_spec: TrainSpec, lr: float) -> torch.optim.Optimizer:
    if train_spec.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=train_spec.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=train_spec.momentum, nesterov=train_spec.momentum > 0,
        weight_decay=train_spec.weight_decay,
    )


def train_epoch(run: TrainingRun, preemption: Preemption) -> str:
    """Steps until the end of the epoch, max_steps, or an agreed preemption; returns which.
    A resumed epoch starts where the checkpoint left it, at whatever world size wrote it."""
    run.loader.set_epoch(run.epoch)
    accum = run.spec.train.grad_accum
    remaining = run.loader.steps_remaining  # batches; an optimizer step takes up to grad_accum of them
    batches = iter(run.loader)
    epoch_watch = Stopwatch()
    total, done = math.ceil(run.loader.epoch_steps / accum), math.ceil((run.loader.epoch_steps - remaining) / accum)
    with progress_bar(run, total, done) as progress:
        while remaining > 0:
            micro_batches = min(accum, remaining)
            train_step(run, batches, micro_batches)
            remaining -= micro_batches
            progress.update()
            if remaining == 0:
                run.epoch += 1
            if run.step % run.spec.logging.log_every_steps == 0 or remaining == 0 or run.finished:
                log_window(run, progress, epoch_watch.lap() if remaining == 0 else None)
            if remaining == 0:
                return "epoch_end"
            if run.finished:
                return "max_steps"
            if preemption.agreed(run.device):
                return "preempted"
            if run.step % run.spec.checkpoint.every_steps == 0:
                save(run)
    run.epoch += 1  # nothing left of a resumed epoch
    return "epoch_end"


def progress_bar(run: TrainingRun, total: int, done: int) -> tqdm:
    # In a SLURM log (no terminal) a bar redrawn ten times a second buries everything else.
    redraw_s = 0.1 if sys.stdout.isatty() else 30.0
    return tqdm(total=total, initial=done, desc=f"epoch {run.epoch + 1}", leave=False, mininterval=redraw_s,
                disable=not (run.env.is_main and run.spec.logging.progress), file=sys.stdout)


def log_window(run: TrainingRun, progress: tqdm, epoch_time_s: float | None) -> None:
    """Reduce the window over all ranks (collective); rank 0 logs it and shows it."""
    run.window.count_store_retries(run.loader.stats.retries)
    sums, seconds, perf = run.window.reduce()
    scalars = {**run.task.report(sums, "train", seconds), **perf, "train/lr": run.schedule.lr}
    if epoch_time_s is not None:
        scalars["perf/epoch_time_s"] = epoch_time_s
    run.logger.log(scalars, run.step)
    shown = [tag for tag in (f"train/{run.task.headline_metric}", "train/loss") if tag in scalars]
    progress.set_postfix({tag.split("/", 1)[1]: f"{scalars[tag]:.3f}" for tag in shown})
    if run.env.is_main and not run.spec.logging.progress:
        values = ", ".join(f"{tag} {value:.4g}" for tag, value in scalars.items())
        print(f"step {run.step}/{total_steps(run)}: {values}", flush=True)
    if run.env.is_main and scalars["data/store_retries"] > 0:  # one line per log window, however many
        print(f"step {run.step}: the store failed {scalars['data/store_retries']:.0f} batch read(s) since the previous "
              "log point, all read again (retried up to data.io_timeout_s)", file=sys.stderr, flush=True)


def train_step(run: TrainingRun, batches: Iterator[Batch], micro_batches: int) -> None:
    """One optimizer step over ``micro_batches`` batches; gradients sync only on the last one."""
    watch, data_wait = Stopwatch(), 0.0
    run.schedule.apply(run.progress)
    for index in range(micro_batches):
        wait = Stopwatch()
        batch = next(batches)
        data_wait += wait.lap()
        samples = len(batch[ROW_ID])
        batch = run.task.to_device(batch, run.device)
        sync = index == micro_batches - 1
        with nullcontext() if sync else run.model.no_sync(), run.autocast():
            loss, sums = run.task.forward(run.model, batch)
        (loss / micro_batches).backward()
        run.window.add_batch(sums, samples)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.window.add_step(watch.lap(), data_wait)


@torch.no_grad()
def evaluate(run: TrainingRun) -> dict[str, float] | None:
    """All ranks evaluate their share, on the bare module (DDP's forward would add collectives,
    and ranks may have different numbers of batches); one all-reduce sums the task's metrics."""
    if run.spec.data.val_uri is None:
        return None
    model = run.model.module
    for buffer in model.buffers():  # BatchNorm statistics drift apart per rank: evaluate rank 0's, the saved ones
        dist.broadcast(buffer, src=0)
    model.eval()
    sums = torch.zeros(len(run.task.metrics), dtype=torch.float64, device=run.device)
    loader = data.build_eval_loader(run.spec.data, run.task.decoder(train=False), run.env.rank, run.env.world_size,
                                    pin_memory=run.device.type == "cuda")
    samples = 0
    for batch in loader:
        samples += len(batch[ROW_ID])
        with run.autocast():
            sums += run.task.forward(model, run.task.to_device(batch, run.device))[1].double()
    totals = torch.cat([sums, torch.tensor([float(samples)], dtype=torch.float64, device=run.device)])
    dist.all_reduce(totals)
    model.train()
    metrics = run.task.report(dict(zip(run.task.metrics, totals.tolist())), "val")
    run.logger.log(metrics, run.step)
    if run.env.is_main:
        print(f"epoch {run.epoch} step {run.step}: validation {run.task.headline(metrics)} "
              f"({int(totals[-1].item())} samples)", flush=True)
    return metrics


def total_steps(run: TrainingRun) -> int:
    """The step training ends at, if this world size reads the rest (exact unless resized again)."""
    left = (run.spec.train.epochs - run.progress) * run.schedule.steps_per_epoch
    estimate = run.step + math.ceil(round(left, 6))
    return min(estimate, run.spec.train.max_steps or estimate)


def save(run: TrainingRun) -> str:
    """Collective checkpoint of everything a resumed job needs to continue bit for bit."""
    mid_epoch = run.loader.epoch == run.epoch and run.loader.consumed > 0
    state = {
        "step": run.step,
        "epoch": run.epoch,
        "progress": run.progress,
        "mid_epoch": mid_epoch,
        "world_size": run.env.world_size,
        "model": run.model.module.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "dataset_version": run.loader.dataset_version,
        "spec": run.spec.redacted_dict(),
    }
    rank_state = {"loader": run.loader.state_dict() if mid_epoch else None}
    return str(checkpoint.save(run.spec.checkpoint.dir, run.step, state, rank_state, run.spec.checkpoint.keep))


def report_final(run: TrainingRun, metrics: dict[str, float] | None) -> None:
    if not run.env.is_main:
        return
    if metrics:
        print(f"final validation {run.task.headline(metrics)} after {run.step} steps", flush=True)
    else:
        print(f"training finished after {run.step} steps (no data.val_uri, so no validation)", flush=True)
