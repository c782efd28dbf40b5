"""Script mode (``entry: my_pkg.train:main``): your training function runs in every rank, under
lance_hpc's runtime, with a :class:`Context`.

The context gives the rank, world size and device, the spec and its task, loaders for any task or
decoder (every strategy, equal steps, exactly-once rows, mid-epoch resume), DDP wrapping on the
right device, checkpoints of what you :meth:`~Context.register`, and :meth:`~Context.steps`: the
iterator that resumes, saves every ``checkpoint.every_steps`` and at each epoch end, and stops
every rank at the same step when SLURM preempts the job (it saves, then raises
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
            if step % 10 == 0:
                ctx.log(ctx.all_reduce({"train/loss": loss.item()}), step)
        return {}

The rank's main module stays ``lance_hpc.run``: DataLoader workers import your module only to
unpickle what they need, never re-running a script's top level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lance_hpc import data
from lance_hpc.data import EvalLoader, TrainLoader
from lance_hpc.errors import UserError
from lance_hpc.runtime import checkpoint
from lance_hpc.runtime.checkpoint import Checkpoint
from lance_hpc.runtime.environment import DistEnv, configure_process
from lance_hpc.runtime.metrics import MetricLogger, build_logger, flatten
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.tasks import Batch, Decoder, Task


@dataclass(frozen=True)
class Summary:
    """How a rank's training ended: completed, or preempted (a checkpoint holds the state);
    ``metrics`` are the last validation values (``val/loss``, ...), empty without validation."""

    status: str
    step: int
    epoch: int
    checkpoint: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def wrap_model(model: nn.Module, device: torch.device, deterministic: bool) -> DistributedDataParallel:
    """DDP over ``model`` (already on ``device``): one device per rank on GPU, gloo on CPU.

    DDP regroups its gradient buckets after the first iteration, which changes the order in which
    all-reduce sums each gradient; a resumed job would sum its first step differently from the
    uninterrupted one. find_unused_parameters keeps the first grouping for good (at the cost of one
    graph traversal per step), so deterministic runs resume bit for bit."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=deterministic)


def precision_context(train_spec: TrainSpec, device: torch.device) -> torch.autocast:
    """bf16 autocast on GPU when train.precision is bf16; fp32 otherwise (and always on CPU)."""
    enabled = device.type == "cuda" and train_spec.precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Preempted(Exception):
    """Raised out of :meth:`Context.steps` once every rank agreed to stop and the state is saved."""

    def __init__(self, step: int, saved: str) -> None:
        super().__init__(f"preempted at step {step}; checkpoint {saved}")
        self.step, self.saved = step, saved


@dataclass
class Context:
    """What a training function gets in every rank; see the module doc for a loop."""

    spec: JobSpec
    env: DistEnv
    device: torch.device
    task: Task
    logger: MetricLogger
    preemption: Preemption = field(repr=False)
    resumed: Checkpoint | None = field(default=None, repr=False)
    step: int = 0  # optimizer steps taken, counting those before a resume
    epoch: int = 0  # the epoch being read
    stepping: TrainLoader | None = field(default=None, repr=False)  # the loader steps() iterates
    registered: dict[str, Stateful] = field(default_factory=dict, repr=False)
    rng_restored: bool = field(default=False, repr=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def steps_per_epoch(self) -> int:
        """Batches of a whole epoch of the loader that steps() iterates, at this world size (0 before)."""
        return self.stepping.steps_per_epoch if self.stepping is not None else 0

    @property
    def progress(self) -> float:
        """Epochs read so far, counted in samples (the same at any world size): drive a learning-rate
        schedule with it, rather than with steps, and a resumed job on another world size keeps its curve."""
        loader = self.stepping
        if loader is None or loader.epoch != self.epoch:
            return float(self.epoch)
        return self.epoch + loader.epoch_fraction()

    def train_loader(self, decoder: Decoder | None = None) -> TrainLoader:
        """This rank's training batches with the spec's strategy; ``decoder`` defaults to the task's."""
        return data.build_train_loader(checkpoint.pinned_data(self.spec.data, self.resumed),
                                       decoder or self.task.decoder(train=True), self.rank, self.world_size,
                                       pin_memory=self.device.type == "cuda")

    def eval_loader(self, decoder: Decoder | None = None) -> EvalLoader:
        """This rank's share of data.val_uri; ranks may get one batch more or less than each other."""
        return data.build_eval_loader(self.spec.data, decoder or self.task.decoder(train=False), self.rank,
                                      self.world_size, pin_memory=self.device.type == "cuda")

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """``model`` on this rank's device, wrapped for DDP (call it before building the optimizer)."""
        return wrap_model(model.to(self.device), self.device, self.spec.train.deterministic)

    def to_device(self, batch: Batch) -> Batch:
        """A batch on this rank's device, as the task prepares it (normalised images, ...)."""
        return self.task.to_device(batch, self.device)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on GPU when train.precision is bf16; a no-op on CPU."""
        return precision_context(self.spec.train, self.device)

    def register(self, **objects: Stateful) -> None:
        """Checkpoint these objects (model, optimizer, scheduler, loader, anything with
        ``state_dict``/``load_state_dict``); when the job resumes, each is restored here, in place."""
        for name, item in objects.items():
            if not (hasattr(item, "state_dict") and hasattr(item, "load_state_dict")):
                raise UserError(f"ctx.register({name}=...): a {type(item).__name__} has no state_dict/load_state_dict "
                                "to checkpoint it with")
            self.registered[name] = item
            if self.resumed is None:
                continue
            if isinstance(item, TrainLoader):
                saved = checkpoint.saved_position(self.resumed, self.env).get("loaders", {}).get(name)
                if saved is not None:
                    item.load_state_dict(saved)
            elif name in self.resumed.state["objects"]:
                checkpoint.restore_object(_unwrapped(item), self.resumed.state["objects"][name], self.resumed, self.spec, name)
            else:
                raise UserError(f"ctx.register: the checkpoint {self.resumed.path} holds no {name!r} "
                                f"(it has {', '.join(self.resumed.state['objects']) or 'nothing'})")

    def steps(self, loader: TrainLoader, epochs: int | None = None, max_steps: int | None = None) -> Iterator[tuple[int, Batch]]:
        """(step, batch) until ``epochs`` (default train.epochs) or ``max_steps``, from where a
        resumed job stopped. After each step it saves every checkpoint.every_steps and at each
        epoch end, and stops all ranks together on preemption (saves, raises :class:`Preempted`)."""
        self.stepping = loader
        if self.resumed is not None and not self.rng_restored:  # now: building the model drew from the generators
            checkpoint.restore_rank(self.resumed, self.env, self.spec.train.seed, None)
            self.rng_restored = True
        epochs = epochs or self.spec.train.epochs
        limit = max_steps or self.spec.train.max_steps

        def finished() -> bool:
            return self.epoch >= epochs or (limit is not None and self.step >= limit)

        while not finished():
            loader.set_epoch(self.epoch)
            left = loader.steps_remaining
            if left == 0:  # nothing left of a resumed epoch
                self.epoch += 1
                continue
            for batch in loader:
                yield self.step, batch
                self.step, left = self.step + 1, left - 1
                if left == 0:
                    self.epoch += 1
                saved = None
                if left == 0 or finished() or self.step % self.spec.checkpoint.every_steps == 0:
                    saved = self.save()
                if finished():
                    return
                if self.preemption.agreed(self.device):
                    raise Preempted(self.step, saved or self.save())
                if left == 0:
                    break

    def save(self) -> str:
        """Collective: checkpoint every registered object now (steps() calls it for you)."""
        loaders = {name: item for name, item in self.registered.items() if isinstance(item, TrainLoader)}
        mid_epoch = any(item.epoch == self.epoch and item.consumed > 0 for item in loaders.values())
        state = {
            "step": self.step,
            "epoch": self.epoch,
            "progress": self.progress,
            "mid_epoch": mid_epoch,
            "world_size": self.world_size,
            "objects": {name: _unwrapped(item).state_dict() for name, item in self.registered.items() if name not in loaders},
            "dataset_version": next(iter(loaders.values())).dataset_version if loaders else None,
            "spec": self.spec.redacted_dict(),
        }
        rank_state = {"loaders": {name: item.state_dict() for name, item in loaders.items()} if mid_epoch else {}}
        return str(checkpoint.save(self.spec.checkpoint.dir, self.step, state, rank_state, self.spec.checkpoint.keep))

    def log(self, scalars: dict[str, float], step: int | None = None) -> None:
        """TensorBoard scalars at ``step`` (default: the current step); rank 0 writes. Values are
        this rank's: reduce them with :meth:`all_reduce` first for all-rank figures."""
        self.logger.log(scalars, self.step if step is None else step)

    def all_reduce(self, values: dict[str, float], op: str = "mean") -> dict[str, float]:
        """Collective: ``values`` summed (``op="sum"``) or averaged over all ranks."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be mean or sum, not {op!r}")
        totals = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        if op == "mean":
            totals /= self.world_size
        return dict(zip(values, totals.tolist()))


def _unwrapped(item: Any) -> Any:
    """The module inside DDP: its state_dict keys do not depend on the wrapper."""
    return item.module if isinstance(item, DistributedDataParallel) else item


def run_script(entry: Callable[[Context], Any], spec: JobSpec, env: DistEnv, device: torch.device,
               preemption: Preemption, task: Task) -> Summary:
    """Run the user's function in this rank; a preemption inside :meth:`Context.steps` ends it."""
    configure_process(spec.train.seed, spec.train.deterministic, env, device)
    resumed = checkpoint.find_resume_point(spec)
    if resumed and env.is_main:
        print(checkpoint.resume_message(resumed, float(resumed.state.get("progress", resumed.epoch)), env.world_size,
                                        spec.data.batch_size, spec.train.grad_accum), flush=True)
    logger = build_logger(spec.logging.tensorboard_dir, env.is_main, purge_step=resumed.step if resumed else None)
    logger.log_hparams({**flatten(spec.redacted_dict()), "world_size": env.world_size}, (f"val/{task.headline_metric}", "val/loss"))
    context = Context(spec, env, device, task, logger, preemption, resumed, step=resumed.step if resumed else 0,
                      epoch=resumed.epoch if resumed else 0)
    try:
        result = entry(context)
    except Preempted as stop:
        return Summary("preempted", stop.step, context.epoch, stop.saved)
    finally:
        logger.close()
    metrics = {key: float(value) for key, value in result.items()} if isinstance(result, dict) else {}
    return Summary("completed", context.step, context.epoch, None, metrics)
