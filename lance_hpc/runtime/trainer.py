"""The built-in DDP training loop, for any task: an entry function like a script's, written on the
public :class:`~lance_hpc.runtime.context.Context` only. What it does, a user's loop can do.

The loop knows nothing of images or tokens: the task builds the model, moves a batch to the
device, computes the loss and the metric sums, and turns reduced sums into reported values. The
context iterates the steps (``train.grad_accum`` batches each), resumes, saves, and stops every
rank at the same step, and reports the task's metrics at each log point from the sums the loop
hands it; the loop adds the optimizer, the learning-rate schedule and an evaluation at epoch ends
(step-end and epoch-end hooks).

Progress is counted in samples, not in optimizer steps: the learning-rate schedule follows the
epochs read (:attr:`Context.progress`), so a job resumed on another world size continues the same
curve, with the per-rank batch kept and the peak learning rate rescaled by the linear rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lance_hpc.loading.mix import source_name
from lance_hpc.runtime.context import Context
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.tasks import ROW_ID


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
        self.lr = self.peak_lr * lr_factor(progress * per_epoch, self.warmup_epochs * per_epoch, self.total_epochs * per_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        return self.lr


def train(ctx: Context) -> dict[str, float]:
    """Train the spec's task: the entry of every job that names no ``entry`` of its own."""
    spec, task = ctx.spec, ctx.task
    loader = ctx.train_loader()
    model = ctx.build_model()
    ddp = ctx.wrap(model)
    optimizer = build_optimizer(model, spec.train, peak_lr(spec, ctx.world_size))
    ctx.register(model=ddp, optimizer=optimizer, loader=loader)
    schedule = Schedule(
        optimizer,
        peak_lr(spec, ctx.world_size),
        spec.train.warmup_epochs,
        float(spec.train.epochs),
        math.ceil(loader.steps_per_epoch / spec.train.grad_accum),
    )
    if spec.train.max_steps is not None:  # the schedule ends where max_steps will stop this world size
        steps_left = max(spec.train.max_steps - ctx.step, 0)
        schedule.total_epochs = min(schedule.total_epochs, ctx.progress + steps_left / schedule.steps_per_epoch)
    if ctx.resumed_from is not None and ctx.is_main and not ctx.finished:
        print(
            f"  peak learning rate {schedule.peak_lr:.4g} at this world size (train.lr_scaling: {spec.train.lr_scaling}); "
            "warmup and decay are counted in samples, so the schedule goes on where it was",
            flush=True,
        )
    last: dict[str, dict[str, float] | None] = {"metrics": None}

    def after_step() -> None:
        if ctx.log_due:  # the context logs the task's train/* values beside it
            ctx.log({"train/lr": schedule.lr})
        schedule.apply(ctx.progress)  # for the next step

    def after_epoch() -> None:
        if ctx.finished or ctx.epoch % spec.train.eval_every_epochs == 0:
            last["metrics"] = evaluate(ctx, ddp)

    ctx.on_step_end(after_step)
    ctx.on_epoch_end(after_epoch)
    schedule.apply(ctx.progress)
    for _, batch in ctx.steps(loader):
        batch = ctx.to_device(batch)
        with ctx.no_sync(ddp), ctx.autocast():
            loss, sums = task.forward(ddp, batch)
        (loss / ctx.micro_batches).backward()
        ctx.add_metric_sums(sums)
        if not ctx.accumulating:
            if spec.train.grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return last["metrics"] or evaluate(ctx, ddp) or {}


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
        model.parameters(),
        lr=lr,
        momentum=train_spec.momentum,
        nesterov=train_spec.momentum > 0,
        weight_decay=train_spec.weight_decay,
    )


@torch.no_grad()
def evaluate(ctx: Context, ddp: nn.Module) -> dict[str, float] | None:
    """All ranks evaluate their share, on the bare module (DDP's forward would add collectives,
    and ranks may have different numbers of batches); one all-reduce sums the task's metrics.
    data.val_uri gives ``val/*``; each data.mix source with a val_uri of its own gives
    ``val/<source>/*`` too (the headline stays the combined set's, else the first source's)."""
    sets = [("val", ctx.spec.data.val_uri)] if ctx.spec.data.val_uri else []
    for index, source in enumerate(ctx.spec.data.mix or []):
        if source.val_uri:
            sets.append((f"val/{source_name(source, index)}", source.val_uri))
    if not sets:
        return None
    model = ctx.unwrap(ddp)
    for buffer in model.buffers():  # BatchNorm statistics drift apart per rank: evaluate rank 0's, the saved ones
        dist.broadcast(buffer, src=0)
    model.eval()
    results = [evaluate_set(ctx, model, prefix, None if prefix == "val" else uri) for prefix, uri in sets]
    model.train()
    metrics: dict[str, float] = {}
    for values in results:
        metrics.update(values)
    headline = results[0] if sets[0][0] == "val" else {key.replace(sets[0][0], "val", 1): v for key, v in results[0].items()}
    return {**metrics, **headline}


def evaluate_set(ctx: Context, model: nn.Module, prefix: str, uri: str | None) -> dict[str, float]:
    task, device = ctx.task, ctx.device
    sums = torch.zeros(len(task.metrics), dtype=torch.float64, device=device)
    samples = 0
    for batch in ctx.eval_loader(uri=uri):  # under fsdp, as many batches on every rank (some may be empty)
        samples += len(batch[ROW_ID])
        with ctx.autocast():
            sums += task.forward(model, ctx.to_device(batch))[1].double()
    totals = torch.cat([sums, torch.tensor([float(samples)], dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    metrics = task.report(dict(zip(task.metrics, totals.tolist())), prefix)
    ctx.log(metrics)
    if ctx.is_main:
        named = {key.replace(prefix, "val", 1): value for key, value in metrics.items()}
        where = "validation" if prefix == "val" else f"validation of {prefix.split('/', 1)[1]}"
        print(
            f"epoch {epoch_number(ctx)} step {ctx.step}: {where} {task.headline(named)} ({int(totals[-1].item())} samples)",
            flush=True,
        )
    return metrics


def epoch_number(ctx: Context) -> int:
    """The epoch the last step read, counted from 1 as the progress bar counts them: at an epoch's
    end the one just finished, after train.max_steps stopped mid-epoch the one it stopped in."""
    return max(math.ceil(round(ctx.progress, 9)), 1)
