"""A training loop of your own, run by lance_hpc in every rank (script mode).

lance_hpc starts the ranks, joins the process group, and hands ``main`` a context: loaders with
the spec's strategy, DDP wrapping, checkpoints of what you register, and a step iterator that
resumes mid-epoch, shows progress, logs throughput, and stops every rank together when SLURM
preempts the job. The built-in trainer is written on the same context.

    lance-hpc submit examples/script_mode/job.yaml --local
"""

from __future__ import annotations

import torch
from torch import nn

from lance_hpc import Context


def build_model(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def main(ctx: Context) -> dict[str, float]:
    loader = ctx.train_loader()  # the spec's task decodes: uint8 images, labels, row ids
    model = ctx.wrap(build_model(ctx.task.num_classes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.spec.train.lr)
    ctx.register(model=model, optimizer=optimizer, loader=loader)  # restored here on resume

    losses: list[float] = []

    def log_loss() -> None:  # after every step, on every rank
        if ctx.log_due:  # every logging.log_every_steps, and at epoch ends
            ctx.log(ctx.all_reduce({"train/loss": sum(losses) / len(losses)}))
            losses.clear()

    ctx.on_step_end(log_loss)
    for _step, batch in ctx.steps(loader):  # a step is train.grad_accum batches
        batch = ctx.to_device(batch)  # normalised images on this rank's device
        with ctx.no_sync(model), ctx.autocast():
            loss = nn.functional.cross_entropy(model(batch["image"]), batch["label"])
        (loss / ctx.micro_batches).backward()
        losses.append(loss.item())
        if not ctx.accumulating:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    correct, count = 0.0, 0.0
    model.eval()
    bare = ctx.unwrap(model)  # DDP's module (no collective), or the sharded model under fsdp
    with torch.no_grad():
        for batch in ctx.eval_loader():
            batch = ctx.to_device(batch)
            correct += (bare(batch["image"]).argmax(1) == batch["label"]).sum().item()
            count += len(batch["label"])
    totals = ctx.all_reduce({"correct": correct, "count": count}, op="sum")
    accuracy = totals["correct"] / totals["count"]
    ctx.log({"val/accuracy": accuracy})
    return {"val/accuracy": accuracy}  # printed as the job's final line
