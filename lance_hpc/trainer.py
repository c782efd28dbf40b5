"""The DDP training loop: :func:`train` resumes, then alternates epochs of :func:`train_step`,
checkpoints and evaluation until the last step or a preemption.

Every collective (metric reduction, preemption agreement, checkpoint, evaluation) happens at the
same step on every rank, and every rank takes the same number of steps.
"""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from lance_hpc import checkpoint, data
from lance_hpc.env import DistEnv
from lance_hpc.errors import UserError
from lance_hpc.metrics import (
    MetricLogger,
    Stopwatch,
    TrainWindow,
    build_logger,
    flatten,
)
from lance_hpc.models import build_model
from lance_hpc.spec import DataSpec, JobSpec, TrainSpec


@dataclass
class Run:
    """What the loop works with; ``step`` counts optimizer steps since the start of training."""

    spec: JobSpec
    env: DistEnv
    device: torch.device
    loader: Any  # lance_hpc.data TrainLoader
    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    logger: MetricLogger
    steps_per_epoch: int
    total_steps: int
    step: int = 0
    window: TrainWindow = field(init=False)

    def __post_init__(self) -> None:
        self.window = TrainWindow(self.device)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    @property
    def autocast(self) -> Any:
        enabled = self.device.type == "cuda" and self.spec.train.precision == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass(frozen=True)
class Summary:
    """How train() ended: status is completed, or preempted (a checkpoint holds the state)."""

    status: str
    step: int
    epoch: int
    checkpoint: str | None
    val_accuracy: float | None = None
    val_loss: float | None = None


def train(spec: JobSpec, env: DistEnv, device: torch.device, preemption: checkpoint.Preemption) -> Summary:
    configure_process(spec.train, env, device)
    resumed = find_resume_point(spec)
    run = build_run(spec, env, device, resumed)
    saved, metrics = None, None
    try:
        while run.step < run.total_steps:
            ended_by = train_epoch(run, preemption)
            if ended_by == "preempted":
                return Summary("preempted", run.step, run.epoch, str(save(run)))
            due = run.step >= run.total_steps or run.epoch % spec.train.eval_every_epochs == 0
            metrics = evaluate(run) if due else None
            saved = save(run)
            if run.step < run.total_steps and preemption.agreed(device):
                return Summary("preempted", run.step, run.epoch, str(saved))
        metrics = metrics or evaluate(run)
    finally:
        run.logger.close()
    report_final(run, metrics)
    metrics = metrics or {}
    return Summary("completed", run.step, run.epoch, str(saved) if saved else None,
                   metrics.get("val/accuracy"), metrics.get("val/loss"))


def configure_process(train_spec: TrainSpec, env: DistEnv, device: torch.device) -> None:
    """Seeds, determinism and CPU threads, before anything draws a random number."""
    random.seed(train_spec.seed)
    np.random.seed(train_spec.seed)
    torch.manual_seed(train_spec.seed)  # every rank builds the same initial model
    if train_spec.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = device.type == "cuda" and not train_spec.deterministic
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one node share its cores; more threads than cores slows every rank down
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // env.local_world_size))


def find_resume_point(spec: JobSpec) -> tuple[Any, dict] | None:
    """The latest checkpoint in checkpoint.dir, unless resume is off (then the directory must hold none:
    pruning would otherwise delete the new run's checkpoints in favour of the old run's later steps)."""
    if spec.checkpoint.resume:
        return checkpoint.load_latest(spec.checkpoint.dir)
    if checkpoint.list_checkpoints(spec.checkpoint.dir):
        raise UserError(
            f"checkpoint.dir {spec.checkpoint.dir} holds checkpoints of an earlier run and checkpoint.resume is false\n"
            "  fix: use a new checkpoint.dir, delete the old checkpoints, or set checkpoint.resume: true"
        )
    return None


def build_run(spec: JobSpec, env: DistEnv, device: torch.device, resumed: tuple[Any, dict] | None) -> Run:
    state = resumed[1] if resumed else None
    loader = data.build_train_loader(
        pinned_data(spec.data, state), env.rank, env.world_size, pin_memory=device.type == "cuda"
    )
    model = build_model(spec.model.arch, spec.model.num_classes or loader.num_classes)
    if state:
        check_resumable(state, env, resumed[0])
        model.load_state_dict(state["model"])
    memory_format = torch.channels_last if device.type == "cuda" and spec.model.channels_last else torch.preserve_format
    model = model.to(device, memory_format=memory_format)
    optimizer = build_optimizer(model, spec.train, peak_lr(spec, env.world_size))
    steps_per_epoch = math.ceil(loader.steps_per_epoch / spec.train.grad_accum)
    total_steps = min(spec.train.max_steps or sys.maxsize, spec.train.epochs * steps_per_epoch)
    warmup_steps = round(spec.train.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup_steps, total_steps))
    # DDP regroups its gradient buckets after the first iteration, which changes the order in which
    # all-reduce sums each gradient; a resumed job would sum its first step differently from the
    # uninterrupted one. find_unused_parameters keeps the first grouping for good (at the cost of
    # one graph traversal per step), so deterministic runs resume bit for bit.
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  find_unused_parameters=spec.train.deterministic)
    step = state["step"] if state else 0
    logger = build_logger(spec.logging.tensorboard_dir, env.is_main, purge_step=step if state else None)
    hparams = {**flatten(spec.to_dict()), "world_size": env.world_size, "peak_lr": peak_lr(spec, env.world_size)}
    logger.log_hparams(hparams)
    run = Run(spec, env, device, loader, ddp, optimizer, scheduler, logger, steps_per_epoch, total_steps, step)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        mine = state["ranks"][env.rank]
        checkpoint.restore_rng(mine["rng"])
        if mine["loader"] is not None:
            loader.load_state_dict(mine["loader"])  # set_epoch of the same epoch keeps this position
        if env.is_main:
            print(f"resuming from {resumed[0]} at step {step} (epoch {run.epoch})", flush=True)
    return run


def pinned_data(data_spec: DataSpec, state: dict | None) -> DataSpec:
    """A resumed job reads the dataset version its checkpoint was trained on."""
    if state is None:
        return data_spec
    version = state["dataset_version"]
    if data_spec.version is not None and data_spec.version != version:
        raise UserError(
            f"data.version is {data_spec.version} but the checkpoint was trained on version {version}\n"
            "  fix: remove data.version to resume, or start over with checkpoint.resume: false and a new checkpoint.dir"
        )
    return data_spec.model_copy(update={"version": version})


def check_resumable(state: dict, env: DistEnv, path: Any) -> None:
    if state["mid_epoch"] and len(state["ranks"]) != env.world_size:
        raise UserError(
            f"checkpoint {path} was written mid-epoch by {len(state['ranks'])} ranks, and its data position "
            f"is only valid for that many; this job has {env.world_size}\n"
            f"  fix: resume with {len(state['ranks'])} ranks, or delete it to fall back to an epoch-end checkpoint"
        )


def peak_lr(spec: JobSpec, world_size: int) -> float:
    """The linear scaling rule: lr grows with the global batch (Goyal et al., 2017)."""
    if spec.train.lr_scaling == "none":
        return spec.train.lr
    global_batch = spec.data.batch_size * world_size * spec.train.grad_accum
    return spec.train.lr * global_batch / spec.train.base_batch_size


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to the peak, then cosine decay to zero at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_optimizer(model: nn.Module, train_spec: TrainSpec, lr: float) -> torch.optim.Optimizer:
    if train_spec.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=train_spec.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=train_spec.momentum, nesterov=train_spec.momentum > 0,
        weight_decay=train_spec.weight_decay,
    )


def train_epoch(run: Run, preemption: checkpoint.Preemption) -> str:
    """Steps until the end of the epoch, max_steps, or an agreed preemption; returns which."""
    epoch, first = run.epoch, run.step % run.steps_per_epoch
    run.loader.set_epoch(epoch)
    last = min(run.steps_per_epoch, first + run.total_steps - run.step)
    accum = run.spec.train.grad_accum
    batches = iter(run.loader)
    epoch_watch = Stopwatch()
    # In a SLURM log (no terminal) a bar redrawn ten times a second buries everything else.
    redraw_s = 0.1 if sys.stdout.isatty() else 30.0
    with tqdm(total=run.steps_per_epoch, initial=first, desc=f"epoch {epoch + 1}", leave=False, mininterval=redraw_s,
              disable=not (run.env.is_main and run.spec.logging.progress), file=sys.stdout) as progress:
        for index in range(first, last):
            train_step(run, batches, micro_batches=min(accum, run.loader.steps_per_epoch - index * accum))
            progress.update()
            end_of_epoch = index + 1 == run.steps_per_epoch
            if run.step % run.spec.logging.log_every_steps == 0 or index + 1 == last:
                scalars = {**run.window.reduce(), "train/lr": run.scheduler.get_last_lr()[0]}
                if end_of_epoch:
                    scalars["perf/epoch_time_s"] = epoch_watch.lap()
                run.logger.log(scalars, run.step)
                progress.set_postfix(loss=f"{scalars['train/loss']:.3f}", acc=f"{scalars['train/accuracy']:.3f}")
                if run.env.is_main and not run.spec.logging.progress:
                    values = ", ".join(f"{tag} {value:.4g}" for tag, value in scalars.items())
                    print(f"step {run.step}/{run.total_steps}: {values}", flush=True)
            if end_of_epoch:
                return "epoch_end"
            if run.step >= run.total_steps:
                return "max_steps"
            if preemption.agreed(run.device):
                return "preempted"
            if run.step % run.spec.checkpoint.every_steps == 0:
                save(run)
    return "epoch_end"


def train_step(run: Run, batches: Iterator, micro_batches: int) -> None:
    """One optimizer step over ``micro_batches`` batches; gradients sync only on the last one."""
    watch, data_wait = Stopwatch(), 0.0
    for index in range(micro_batches):
        wait = Stopwatch()
        images, labels = next(batches)
        data_wait += wait.lap()
        images, labels = to_device(run, images, labels)
        sync = index == micro_batches - 1
        with nullcontext() if sync else run.model.no_sync(), run.autocast:
            logits = run.model(images)
            loss = nn.functional.cross_entropy(logits, labels)
        (loss / micro_batches).backward()
        run.window.add_batch(loss, logits, labels)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.window.add_step(watch.lap(), data_wait)


def to_device(run: Run, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 batches cross to the device as they are (4x fewer bytes), then normalize there, in
    the memory format of the model (loaders deliver channels-last batches)."""
    images = data.normalize(images.to(run.device, non_blocking=True))
    channels_last = run.device.type == "cuda" and run.spec.model.channels_last
    images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return images, labels.to(run.device, non_blocking=True)


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float] | None:
    """All ranks evaluate their share, on the bare module (DDP's forward would add collectives,
    and ranks may have different numbers of batches); one all-reduce sums the counts."""
    if run.spec.data.val_uri is None:
        return None
    model = run.model.module
    for buffer in model.buffers():  # BatchNorm statistics drift apart per rank: evaluate rank 0's, the saved ones
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss sum, correct, count
    for images, labels in data.build_eval_loader(run.spec.data, run.env.rank, run.env.world_size,
                                                 pin_memory=run.device.type == "cuda"):
        images, labels = to_device(run, images, labels)
        with run.autocast:
            logits = model(images)
        totals[0] += nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += labels.numel()
    dist.all_reduce(totals)
    model.train()
    loss_sum, correct, count = totals.tolist()
    metrics = {"val/loss": loss_sum / max(count, 1), "val/accuracy": correct / max(count, 1)}
    run.logger.log(metrics, run.step)
    if run.env.is_main:
        print(f"epoch {run.epoch} step {run.step}: validation accuracy {metrics['val/accuracy']:.4f}, "
              f"loss {metrics['val/loss']:.4f} ({int(count)} images)", flush=True)
    return metrics


def save(run: Run) -> Any:
    """Collective checkpoint of everything a resumed job needs to continue bit for bit."""
    mid_epoch = run.step % run.steps_per_epoch != 0 and run.step < run.total_steps
    state = {
        "step": run.step,
        "epoch": run.epoch,
        "mid_epoch": mid_epoch,
        "model": run.model.module.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "dataset_version": run.loader.dataset_version,
        "spec": run.spec.to_dict(),
    }
    rank_state = {"loader": run.loader.state_dict() if mid_epoch else None}
    return checkpoint.save(run.spec.checkpoint.dir, run.step, state, rank_state, run.spec.checkpoint.keep)


def report_final(run: Run, metrics: dict[str, float] | None) -> None:
    if not run.env.is_main:
        return
    if metrics:
        print(f"final validation accuracy: {metrics['val/accuracy']:.4f} (loss {metrics['val/loss']:.4f}) "
              f"after {run.step} steps", flush=True)
    else:
        print(f"training finished after {run.step} steps (no data.val_uri, so no validation)", flush=True)
