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
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from lance_hpc import loading
from lance_hpc.checkpoint import resuming, saving
from lance_hpc.checkpoint.manifests import CHECKPOINT_PATTERN
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.checkpoint.sharded import ShardedSaver, bare, is_tensor_state, load_shards, restore_tensor_state, tensor_state
from lance_hpc.errors import UserError
from lance_hpc.loading import EvalLoader, MixLoader, TrainLoader, selection
from lance_hpc.output import ProgressDisplay, progress_bar
from lance_hpc.parallel import fsdp
from lance_hpc.parallel.fsdp import default_blocks, note_default_blocks
from lance_hpc.parallel.materialise import MetaModel, build_on_meta, materialise, seeded, to_empty
from lance_hpc.parallel.memory import out_of_memory_message
from lance_hpc.runtime.environment import DistEnv, configure_process
from lance_hpc.runtime.metrics import (
    MetricLogger,
    Stopwatch,
    TrainWindow,
    build_logger,
)
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.runtime.profile import StepProfiler
from lance_hpc.runtime.watchdog import Progress, Stragglers, Watchdog, host_name, watch_dir
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.spec.flat import flatten
from lance_hpc.spec.rules import entry_options
from lance_hpc.tasks import ROW_ID, Batch, Decoder, Task


@dataclass(frozen=True)
class Summary:
    """How a rank's job ended: ``completed``, or ``preempted`` (a checkpoint holds the state), or
    ``unsaved`` (a stop signal the loop could not honour: nothing saved); ``metrics`` are what the
    entry returned (the built-in trainer: the last validation values)."""

    status: str
    step: int
    epoch: int
    checkpoint: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def wrap_model(model: nn.Module, device: torch.device, deterministic: bool) -> DistributedDataParallel:
    """DDP over ``model`` (already on ``device``): one device per rank on GPU, gloo on CPU.

    DDP regroups its gradient buckets after the first iteration, in the order the gradients came,
    which changes the order in which all-reduce sums each gradient: a resumed job would sum its
    first step differently from the uninterrupted one. Deterministic runs group the buckets once,
    at the start, in parameter order (:func:`_group_buckets_now`), so every run of the job sums
    gradients alike from its first step and resumes bit for bit.

    Image inputs take the memory format of the model's convolution weights: pixels straight from
    the loader are channels-last, and a convolution over them gives channels-last weight gradients
    that no longer match DDP's gradient buckets (PyTorch warns "Grad strides do not match bucket
    view strides" and copies every step). Inputs the task already prepared pass unchanged."""
    memory_format = _conv_memory_format(model)
    if memory_format is not None:
        model.register_forward_pre_hook(_InputLayout(memory_format))
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    if deterministic:
        _group_buckets_now(wrapped)
    return wrapped


def _group_buckets_now(wrapped: DistributedDataParallel) -> None:
    """Make DDP's one regrouping of its gradient buckets now, before the first step, in parameter
    order: DDP then never regroups (it does so only once), and no step depends on the order in
    which the first backward pass of this particular run produced gradients.

    This is the regrouping DDP's own Join makes for a rank that has run out of inputs; every rank
    calls it here at the same point (it agrees the grouping with one broadcast). Buckets in
    parameter order start their all-reduce only at the end of the backward pass, which costs the
    overlap of communication with backward that ``deterministic: false`` keeps."""
    reducer = wrapped.reducer
    reducer._push_all_rebuilt_params()
    if not reducer._rebuild_buckets():
        raise RuntimeError("DDP did not regroup its gradient buckets before the first step")
    wrapped._has_rebuilt_buckets = True


def _conv_memory_format(model: nn.Module) -> torch.memory_format | None:
    """channels_last or contiguous_format, as the model's first 4-d weight is laid out; None without one."""
    for parameter in model.parameters():
        if parameter.dim() == 4:
            if parameter.is_contiguous():
                return torch.contiguous_format
            if parameter.is_contiguous(memory_format=torch.channels_last):
                return torch.channels_last
            return None
    return None


class _InputLayout:
    """Forward pre-hook: 4-d floating-point tensor arguments in ``memory_format`` (a no-op for
    those already in it)."""

    def __init__(self, memory_format: torch.memory_format) -> None:
        self.memory_format = memory_format

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            arg.contiguous(memory_format=self.memory_format)
            if isinstance(arg, torch.Tensor) and arg.dim() == 4 and arg.is_floating_point()
            else arg
            for arg in args
        )


def precision_context(train_spec: TrainSpec, device: torch.device) -> torch.autocast:
    """bf16 autocast on GPU when train.precision is bf16; fp32 otherwise (and always on CPU)."""
    enabled = device.type == "cuda" and train_spec.precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class EqualBatches:
    """An evaluation loader followed by batches of no rows, ``count`` batches in all: every rank of a
    sharded model runs as many forward passes."""

    def __init__(self, loader: EvalLoader, count: int, decoder: Decoder) -> None:
        self.loader, self.count, self.decoder = loader, count, decoder

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Batch]:
        yield from self.loader
        for _ in range(self.count - len(self.loader)):
            yield {name: field.empty(0) for name, field in self.decoder.fields().items()} | {
                ROW_ID: torch.empty(0, dtype=torch.int64)
            }


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


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


class Context:
    """What a job's entry function gets in every rank; see the module doc for a loop.

    ``spec``, ``task`` and ``device`` are plain attributes; everything else is read through
    properties and methods, and the context's own bookkeeping stays private."""

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
        self._env, self._logger, self._preemption, self._resumed = env, logger, preemption, resumed
        self._step = resumed.step if resumed else 0  # optimizer steps taken, counting those before a resume
        self._epoch = resumed.epoch if resumed else 0  # the epoch being read
        self._epochs, self._max_steps = spec.train.epochs, spec.train.max_steps  # of the running steps()
        self._stepping: TrainLoader | None = None  # the loader steps() iterates
        self._in_steps = False
        self._registered: dict[str, Stateful] = {}
        self._meta: dict[int, MetaModel] = {}  # models of build_model() that wrap() initialises on their shards
        self._saver = ShardedSaver(spec.slurm.signal_delay_s if env.launcher == "slurm" else None)
        self._rng_restored = False
        self._step_hooks: list[Callable[[], None]] = []
        self._epoch_hooks: list[Callable[[], None]] = []
        self._saved: str | None = None
        self._accumulating = False
        self._micro_batches = 1
        self._log_due = False
        self._step_time_s = 0.0
        self._warned_direct = False
        self._window = TrainWindow(device, task.metrics)  # reduced once per log point: perf/* and train/*
        self._activity = Progress()  # what this rank is doing, for the watchdog (lance_hpc.runtime.watchdog)
        watchdog = spec.train.watchdog
        self._stragglers = Stragglers(watchdog.straggler_factor) if watchdog is not None else None
        self._hosts: list[str] | None = None
        self._own_s, self._wait_s, self._timed_steps = 0.0, 0.0, 0  # this rank's work and data wait since the last log point
        self._profiler = StepProfiler(spec, env.rank, device)
        self._shown: dict[str, float] = {}  # scalars logged at the current log point: the bar and the log line
        self._bar: ProgressDisplay | None = None

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
        return self._step

    @property
    def epoch(self) -> int:
        """The epoch being read (the next one, once an epoch's last step is taken)."""
        return self._epoch

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from; None for a fresh start."""
        return str(self._resumed.path) if self._resumed is not None else None

    @property
    def last_checkpoint(self) -> str | None:
        """The checkpoint this run saved last."""
        return self._saved

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
        if loader is None or loader.epoch != self._epoch:
            return float(self._epoch)
        return self._epoch + loader.epoch_fraction()

    @property
    def total_steps(self) -> int:
        """The step the running steps() ends at, if this world size reads the rest (exact unless resized again)."""
        left = (self._epochs - self.progress) * self.steps_per_epoch
        estimate = self._step + math.ceil(round(max(left, 0.0), 6))
        return min(estimate, self._max_steps) if self._max_steps is not None else estimate

    @property
    def finished(self) -> bool:
        """The running steps() (or train.epochs and train.max_steps, before it) is done."""
        return self._epoch >= self._epochs or (self._max_steps is not None and self._step >= self._max_steps)

    @property
    def accumulating(self) -> bool:
        """Inside steps(): more batches of this step follow (train.grad_accum > 1); take the optimizer
        step after the batch for which this is False."""
        return self._accumulating

    @property
    def micro_batches(self) -> int:
        """Inside steps(): the batches of the current step (train.grad_accum, or fewer at an epoch's
        end); divide the loss by it for the mean over the step."""
        return self._micro_batches

    @property
    def step_time_s(self) -> float:
        """In a step-end hook: the wall time of the step just taken, from the request for its first
        batch to the end of the loop's work on its last (data wait included)."""
        return self._step_time_s

    @property
    def log_due(self) -> bool:
        """In a step-end hook: this step is a log point (every logging.log_every_steps, each epoch's
        last step and the last step of all)."""
        return self._log_due

    # ---- building blocks -------------------------------------------------------------------------

    def train_loader(self, decoder: Decoder | None = None) -> TrainLoader:
        """This rank's training batches with the spec's strategy; ``decoder`` defaults to the task's."""
        loader = loading.build_train_loader(
            selection.pinned_data(self.spec.data, self._resumed),
            decoder or self.task.decoder(train=True),
            self.rank,
            self.world_size,
            pin_memory=self.device.type == "cuda",
        )
        loader.watch = self._direct_batch
        return loader

    def eval_loader(self, decoder: Decoder | None = None, uri: str | None = None) -> Iterable[Batch]:
        """This rank's share of data.val_uri (or of ``uri``: a mix source's own validation set).
        Under ddp ranks may get one batch more or less than each other; under fsdp, where a forward
        pass gathers the model's shards from every rank, each rank gets as many batches as the rank
        with the most (the extra ones hold no rows)."""
        decoder = decoder or self.task.decoder(train=False)
        loader = loading.build_eval_loader(
            self.spec.data if uri is None else self.spec.data.model_copy(update={"val_uri": uri}),
            decoder,
            self.rank,
            self.world_size,
            pin_memory=self.device.type == "cuda",
        )
        if self.spec.train.parallelism != "fsdp":
            return loader
        most = torch.tensor([len(loader)], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return EqualBatches(loader, int(most.item()), decoder)

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
        if self._resumed is not None:
            resuming.check_same_model(self._resumed, self.spec, self.task.options)
        weights = self._resumed is None and getattr(self.task.options, "weights", None) is not None
        meta = build_on_meta(self.task.build_model)
        problem = meta.problem()
        if problem is None and self.spec.train.parallelism == "fsdp" and not weights:
            self._meta[id(meta.model)] = meta  # wrap() shards it, then initialises each rank's rows
            return meta.model
        if problem is None:
            model = to_empty(meta.model, self.device)
            materialise(meta, self.device, self.spec.train.seed)
        else:
            if self.is_main:
                print(f"lance_hpc: the model is built whole on the CPU: {problem}", file=sys.stderr, flush=True)
            with seeded(self.spec.train.seed):
                model = self.task.build_model()
        if self._resumed is None:
            self.task.load_weights(model)
        if self.spec.train.parallelism == "fsdp":
            return model  # fully_shard moves each shard to the device
        return self.task.prepare_model(model, self.device)

    def wrap(self, model: nn.Module, blocks: list[nn.Module] | None = None) -> nn.Module:
        """``model`` on this rank's device, wrapped for train.parallelism (call it before building the
        optimizer): DDP, or FSDP2 shards of each of ``blocks`` (default: the task's
        :meth:`~lance_hpc.tasks.Task.blocks`) and of the root. A model of :meth:`build_model` under
        fsdp is initialised here, each rank computing only its own shards."""
        if self.spec.train.parallelism == "fsdp":
            return self._shard(model, blocks)
        wrapped = wrap_model(model.to(self.device), self.device, self.spec.train.deterministic)
        activity = self._activity

        def all_reduce_noting_the_first_bucket(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
            activity.first_bucket()  # the watchdog tells a rank waiting for others from a stuck one
            return allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects (this module's are strings)
        all_reduce_noting_the_first_bucket.__annotations__.update(
            {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        )
        wrapped.register_comm_hook(None, all_reduce_noting_the_first_bucket)
        return wrapped

    def _shard(self, model: nn.Module, blocks: list[nn.Module] | None) -> nn.Module:
        chosen = blocks if blocks is not None else self.task.blocks(model)
        if chosen is None:
            chosen, where = default_blocks(model)
            if self.is_main:
                note_default_blocks(self.spec.task.name, where, len(chosen))
        meta = self._meta.pop(id(model), None)
        sharded = fsdp.shard(model, chosen, self.device, self.spec.train, self.world_size)
        if meta is not None:
            offload = self.spec.train.cpu_offload
            sharded.to_empty(device=torch.device("cpu") if offload else self.device)
            if offload:  # parameters live in host memory between uses; buffers stay where the compute is
                for module in sharded.modules():
                    for key, buffer in module._buffers.items():
                        if buffer is not None:
                            module._buffers[key] = buffer.to(self.device)
            materialise(meta, self.device, self.spec.train.seed)
        return sharded

    def to_device(self, batch: Batch) -> Batch:
        """A batch on this rank's device, as the task prepares it (normalised images, ...)."""
        return self.task.to_device(batch, self.device)

    def autocast(self) -> torch.autocast:
        """bf16 autocast on GPU when train.precision is bf16; a no-op on CPU."""
        return precision_context(self.spec.train, self.device)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """DDP's no_sync while :attr:`accumulating` (under fsdp: no gradient reduce-scatter until the
        step's last batch): gradients are reduced once per step."""
        if fsdp.is_sharded(model):
            model.set_requires_gradient_sync(not self._accumulating)  # type: ignore[operator]
            return nullcontext()
        if self._accumulating and isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return nullcontext()

    # ---- checkpoints -----------------------------------------------------------------------------

    def register(self, **objects: Stateful) -> None:
        """Checkpoint these objects (model, optimizer, scheduler, loader, anything with
        ``state_dict``/``load_state_dict``); when the job resumes, each is restored here, in place.
        Register a model together with its optimizer: a sharded checkpoint keys the optimizer's
        state by the model's parameter names."""
        whole: dict[str, Any] = {}  # from a checkpoint of whole tensors into a sharded model
        from_shards: dict[str, Any] = {}  # from a sharded checkpoint
        for name, item in objects.items():
            if not (hasattr(item, "state_dict") and hasattr(item, "load_state_dict")):
                raise UserError(
                    f"ctx.register({name}=...): a {type(item).__name__} has no state_dict/load_state_dict to checkpoint it with"
                )
            self._registered[name] = item
            if isinstance(item, TrainLoader):
                item.watch = self._direct_batch
            if self._resumed is None:
                continue
            if isinstance(item, TrainLoader):
                saved = self._resumed.loader_position(name, self._env)
                if saved is not None:
                    item.load_state_dict(saved)
            elif self._resumed.shards is not None and is_tensor_state(item):
                from_shards[name] = item
            elif name in self._resumed.objects and is_tensor_state(item) and self._sharded():
                whole[name] = item
            elif name in self._resumed.objects:
                resuming.restore_object(bare(item), self._resumed.objects[name], self._resumed, self.spec, name)
            else:
                raise UserError(
                    f"ctx.register: the checkpoint {self._resumed.path} holds no {name!r} "
                    f"(it has {', '.join(self._resumed.objects) or 'nothing'})"
                )
        if from_shards:
            assert self._resumed is not None and self._resumed.shards is not None
            load_shards(from_shards, self._resumed.directory, self._resumed.shards)
        if whole:
            assert self._resumed is not None
            restore_tensor_state(whole, {name: self._resumed.objects[name] for name in whole}, whole=True)

    def save(self) -> str:
        """Collective: checkpoint every registered object now (steps() calls it for you). Under fsdp
        each rank writes its own shards of the model and optimizer (in the background with
        checkpoint.async_save)."""
        self._activity.enter("checkpoint")
        loaders = {name: item for name, item in self._registered.items() if isinstance(item, TrainLoader)}
        mid_epoch = any(item.epoch == self._epoch and item.consumed > 0 for item in loaders.values())
        sharded = self._sharded()
        tensors = {name: item for name, item in self._registered.items() if sharded and is_tensor_state(item)}
        for item in tensors.values():  # fsdp keeps buffers (BatchNorm statistics) per rank: save rank 0's, as DDP does
            if isinstance(item, nn.Module):
                for buffer in item.buffers():
                    dist.broadcast(buffer, src=0)
        state = {
            "format": saving.FORMAT,
            "step": self._step,
            "epoch": self._epoch,
            "progress": self.progress,
            "mid_epoch": mid_epoch,
            "world_size": self.world_size,
            "objects": {
                name: bare(item).state_dict()
                for name, item in self._registered.items()
                if name not in loaders and name not in tensors
            },
            "dataset_version": next(iter(loaders.values())).dataset_version if loaders else None,
            "data_pinned": next(iter(loaders.values())).pinned if loaders else None,
            "spec": self.spec.redacted_dict(),
        }
        rank_state = {"loaders": {name: item.state_dict() for name, item in loaders.items()} if mid_epoch else {}}
        shards = (self._saver, tensor_state(tensors), self.spec.checkpoint.async_save) if sharded else None
        self._saved = str(saving.save(self.spec.checkpoint.dir, self._step, state, rank_state, self.spec.checkpoint.keep, shards))
        if sharded:
            self._logger.log({"checkpoint/blocked_s": self._saver.blocked_s}, self._step)
        return self._saved

    def wait_for_checkpoint(self) -> None:
        """Collective: the checkpoint still being written in the background (checkpoint.async_save)
        complete; steps() calls it before a preemption ends the job, lance_hpc at the end."""
        self._saver.wait()

    def out_of_memory(self, error: BaseException) -> str:
        """What the model's state needs per rank and what to change, for a device out of memory."""
        models = [bare(item) for item in self._registered.values() if isinstance(bare(item), nn.Module)]
        if not models:  # it ran out while the model was built or wrapped: count it on the meta device
            models = [build_on_meta(self.task.build_model).model]
        parameters = sum(parameter.numel() for model in models for parameter in model.parameters())
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        return out_of_memory_message(error, self.spec, parameters, self.world_size, str(self.device), total)

    def _sharded(self) -> bool:
        return any(fsdp.is_sharded(bare(item)) for item in self._registered.values() if isinstance(item, nn.Module))

    # ---- the loop --------------------------------------------------------------------------------

    def on_step_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on every rank after each step, before steps() saves or stops (:attr:`step`
        already counts it; :attr:`log_due` says whether it is a log point)."""
        self._step_hooks.append(hook)

    def on_epoch_end(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on every rank after each epoch's last step, and after the last step of all,
        before the checkpoint saved there (an evaluation, say; it may be a collective)."""
        self._epoch_hooks.append(hook)

    def steps(self, loader: TrainLoader, epochs: int | None = None, max_steps: int | None = None) -> Iterator[tuple[int, Batch]]:
        """(step, batch) until ``epochs`` (default train.epochs) or ``max_steps`` (default
        train.max_steps), from where a resumed job stopped. ``step`` counts the steps taken before
        this batch's. After each step it calls the step-end hooks, logs ``perf/*`` at log points (with
        the task's ``train/*`` values when the loop gives :meth:`add_metric_sums`), calls the
        epoch-end hooks at an epoch's end, saves every checkpoint.every_steps and at each epoch end,
        and stops all ranks together on preemption (saves, raises :class:`Preempted`)."""
        self._stepping = loader
        loader.watch = self._direct_batch
        if self._resumed is not None and not self._rng_restored:  # now: building the model drew from the generators
            resuming.restore_rank(self._resumed, self._env, self.spec.train.seed)
            self._rng_restored = True
        self._epochs = epochs or self.spec.train.epochs
        self._max_steps = max_steps or self.spec.train.max_steps
        if self.finished:
            if self.is_main:
                print(self._already_finished(), flush=True)
            return
        accumulate = self.spec.train.grad_accum
        while not self.finished:
            loader.set_epoch(self._epoch)
            remaining = loader.steps_remaining  # batches; a step takes up to grad_accum of them
            if remaining == 0:  # nothing left of a resumed epoch
                self._epoch += 1
                continue
            total = math.ceil(loader.epoch_steps / accumulate)
            done = math.ceil((loader.epoch_steps - remaining) / accumulate)
            epoch_watch = Stopwatch()
            with self._progress_bar(total, done) as self._bar:
                batches = iter(loader)
                self._activity.new_pass()
                while remaining > 0:
                    self._micro_batches = min(accumulate, remaining)
                    step_watch, data_wait = Stopwatch(), 0.0
                    self._profiler.before_step(self._step)
                    self._in_steps = True
                    try:
                        for index in range(self._micro_batches):
                            wait = Stopwatch()
                            self._activity.wait_for_batch(first_of_step=index == 0)
                            batch = next(batches)
                            data_wait += wait.lap()
                            self._activity.got_batch()
                            self._window.add_samples(len(batch[ROW_ID]))
                            self._accumulating = index < self._micro_batches - 1
                            yield self._step, batch
                    finally:
                        self._in_steps, self._accumulating = False, False
                    remaining -= self._micro_batches
                    self._step += 1
                    self._step_time_s = step_watch.lap()
                    self._window.add_step(self._step_time_s, data_wait)
                    own = self._activity.own_s
                    self._own_s += own if own is not None else self._step_time_s - data_wait
                    self._wait_s += data_wait
                    self._timed_steps += 1
                    self._activity.step_done(self._step, self._step_time_s)
                    self._profiler.after_step(self._step)
                    self._bar.update()
                    epoch_end = remaining == 0
                    if epoch_end:
                        self._epoch += 1
                    done_all = self.finished
                    self._log_due = self._step % self.spec.logging.log_every_steps == 0 or epoch_end or done_all
                    for hook in self._step_hooks:
                        hook()
                    if self._log_due:
                        self._log_window(epoch_watch.lap() if epoch_end else None)
                    if epoch_end or done_all:
                        self._activity.enter("evaluate")
                        for hook in self._epoch_hooks:
                            hook()
                        self._shown.clear()  # an evaluation prints its own line
                    saved = None
                    if epoch_end or done_all or self._step % self.spec.checkpoint.every_steps == 0:
                        saved = self.save()
                    if done_all:
                        return
                    if self._preemption.agreed(self.device):
                        saved = saved or self.save()
                        self.wait_for_checkpoint()  # the requeued job must find it complete
                        raise Preempted(self._step, saved)
                    if epoch_end:
                        break
            self._bar = None

    # ---- metrics ---------------------------------------------------------------------------------

    def log(self, scalars: dict[str, float], step: int | None = None) -> None:
        """TensorBoard scalars at ``step`` (default: the current step); rank 0 writes. Values are
        this rank's: reduce them with :meth:`all_reduce` first for all-rank figures. Inside steps(),
        the ``train/*`` values also show on the progress bar (or, without one, in the log line
        rank 0 prints at each log point)."""
        self._logger.log(scalars, self._step if step is None else step)
        self._shown.update(scalars)

    def add_metric_sums(self, sums: torch.Tensor) -> None:
        """Count a batch's metric sums towards the task's ``train/*`` values: ``sums`` is what
        ``task.forward`` returns beside the loss (one value for each name in ``task.metrics``). Call
        it for every batch inside steps(), on every rank; the sums stay on the device. At each log
        point steps() reduces them together with its ``perf/*`` figures, in the same all-reduce, and
        logs ``task.report(sums, "train", seconds)`` (``train/loss``, ...) beside the ``perf/*`` tags;
        a loop that never calls it logs ``perf/*`` only."""
        self._window.add_sums(sums)

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

    def _log_window(self, epoch_time_s: float | None) -> None:
        """Collective at a log point, one all-reduce: the task's train/* values (if the loop added
        metric sums) and the perf/* tags, the progress bar or log line, a store-retry note."""
        self._activity.enter("log")
        if self._stepping is not None:
            self._window.count_store_retries(self._stepping.stats.retries)
        has_sums = self._window.has_sums
        sums, seconds, perf = self._window.reduce()
        perf.update(self._rank_figures())
        if epoch_time_s is not None:
            perf["perf/epoch_time_s"] = epoch_time_s
        if isinstance(self._stepping, MixLoader):  # the plan knows every rank's draws: no collective
            perf.update(self._stepping.source_figures())
        reported = self.task.report(sums, "train", seconds) if has_sums else {}
        self._logger.log({**reported, **perf}, self._step)
        shown, self._shown = {**reported, **self._shown, **perf}, {}  # the task's values lead the line
        train = {tag: value for tag, value in shown.items() if tag.startswith("train/") and tag != "train/lr"}
        if self._bar is not None:
            self._bar.set_postfix({tag.split("/", 1)[1]: f"{value:.3f}" for tag, value in list(train.items())[:3]})
        if self.is_main and not self.spec.logging.progress:
            values = ", ".join(f"{tag} {value:.4g}" for tag, value in shown.items())
            print(f"step {self._step}/{self.total_steps}: {values}", flush=True)
        if self.is_main and perf["data/store_retries"] > 0:  # one line per log window, however many
            print(
                f"step {self._step}: the store failed {perf['data/store_retries']:.0f} batch read(s) since the previous "
                "log point, all read again (retried up to data.io_timeout_s)",
                file=sys.stderr,
                flush=True,
            )

    def _rank_figures(self) -> dict[str, float]:
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
        figures = {f"perf/rank/{rank}/own_work_s": value for rank, value in enumerate(own)}
        figures.update({f"perf/rank/{rank}/data_wait_s": value for rank, value in enumerate(wait)})
        return figures

    def _progress_bar(self, total: int, done: int) -> ProgressDisplay:
        # epochs counted from 1, as every line that names one (lance_hpc.runtime.trainer.epoch_number)
        enabled = self.is_main and self.spec.logging.progress
        return progress_bar(total, f"epoch {self._epoch + 1}", done=done, unit="steps", enabled=enabled)

    def _already_finished(self) -> str:
        limit = (
            f"train.max_steps ({self._max_steps})"
            if self._max_steps is not None and self._step >= self._max_steps
            else f"train.epochs ({self._epochs})"
        )
        where = f" ({self.last_checkpoint or self.resumed_from})" if (self.last_checkpoint or self.resumed_from) else ""
        return (
            f"already finished: step {self._step}, epoch {self._epoch}, reached {limit}; nothing to train"
            f"{where}\n  fix: raise {limit.split(' ')[0]} to train on from here, or give the job a new "
            "checkpoint.dir to start over"
        )

    def _position_loader(self) -> TrainLoader | None:
        """The loader whose position measures progress: the one steps() iterates, else the first registered."""
        if self._stepping is not None:
            return self._stepping
        return next((item for item in self._registered.values() if isinstance(item, TrainLoader)), None)

    def _direct_batch(self) -> None:
        """Called by a loader of this context for every batch it hands out: outside steps(), a loop
        that holds state is told once that nothing is saved, and a stop signal ends it."""
        if self._in_steps:
            return
        if not self._warned_direct and self._registered and self.is_main:
            warnings.warn(
                "this loop iterates its loader directly, not through ctx.steps(loader): what it registered "
                "is never checkpointed, and a preemption cannot stop it at a step boundary; iterate with "
                "`for step, batch in ctx.steps(loader):`",
                stacklevel=3,
            )
        self._warned_direct = True
        if self._preemption.received is not None:
            raise StopNotHonoured(self._preemption.received, self._step)


def run_entry(
    entry: Callable[[Context], Any], spec: JobSpec, env: DistEnv, device: torch.device, preemption: Preemption, task: Task
) -> Summary:
    """Run a job's entry function in this rank; a preemption inside :meth:`Context.steps` ends it."""
    configure_process(spec.train.seed, spec.train.deterministic, env, device)
    resumed = resuming.find_resume_point(spec)
    if resumed and env.is_main and not _ended(resumed, spec):
        print(
            resuming.resume_message(
                resumed,
                float(resumed.state.get("progress", resumed.epoch)),
                env.world_size,
                spec.data.batch_size,
                spec.train.grad_accum,
            ),
            flush=True,
        )
    logger = build_logger(spec, env.is_main, purge_step=resumed.step if resumed else None)
    logger.log_hparams(
        {**flatten(spec.redacted_dict()), "world_size": env.world_size}, (f"val/{task.headline_metric}", "val/loss")
    )
    context = Context(spec, env, device, task, logger, preemption, resumed, entry_options(entry, spec.entry_options))
    watchdog = start_watchdog(spec, env, context._activity)
    context._profiler.listen()
    try:
        result = entry(context)
        context.wait_for_checkpoint()
    except torch.OutOfMemoryError as error:
        raise UserError(context.out_of_memory(error)) from None
    except Preempted as stop:
        return Summary("preempted", stop.step, context.epoch, stop.saved)
    except StopNotHonoured as stop:
        if env.is_main:
            print(f"lance_hpc.run: {stop}", file=sys.stderr, flush=True)
        return Summary("unsaved", context.step, context.epoch, None)
    finally:
        context._saver.wait_quietly(timeout_s=spec.train.collective_timeout_s)  # after a failure: the shards it was writing
        context._profiler.stop(context.step)
        logger.close()
        if watchdog is not None:
            watchdog.close()
    metrics = {key: float(value) for key, value in result.items()} if isinstance(result, dict) else {}
    if env.is_main:
        print(final_line(task, metrics, context.step), flush=True)
        print(checkpoint_line(context.last_checkpoint, context.resumed_from), flush=True)
    return Summary("completed", context.step, context.epoch, context.last_checkpoint, metrics)


def start_watchdog(spec: JobSpec, env: DistEnv, progress: Progress) -> Watchdog | None:
    """This rank's watchdog thread (train.watchdog), started; None when the spec turns it off."""
    settings = spec.train.watchdog
    if settings is None:
        return None
    directory = watch_dir(spec.slurm.log_dir, spec.name, env.job_ref)
    # fire well before the collective timeout ends the job with nothing said
    ceiling = max(spec.train.collective_timeout_s * 0.5, 1.0)
    watchdog = Watchdog(progress, directory, env.rank, env.world_size, settings.factor, settings.floor_s, ceiling)
    watchdog.start()
    return watchdog


def final_line(task: Task, metrics: dict[str, float], step: int) -> str:
    """``final validation accuracy: 0.9944 (loss 0.0243) after 270 steps``, or what the entry returned."""
    if f"val/{task.headline_metric}" in metrics or "val/loss" in metrics:
        return f"final validation {task.headline(metrics)} after {step} steps"
    values = ", ".join(f"{tag} {value:.4g}" for tag, value in metrics.items())
    return f"training finished after {step} steps" + (f": {values}" if values else "")


def checkpoint_line(saved: str | None, resumed_from: str | None) -> str:
    """Where a finished run left its state: ``checkpoint step 270: checkpoints/digits/step-00000270.pt``."""
    if saved is None and resumed_from is not None:
        return f"checkpoint: none saved by this run; the latest is {resumed_from}"
    if saved is None:
        return "checkpoint: none saved (the entry never called ctx.steps() or ctx.save())"
    named = CHECKPOINT_PATTERN.match(saved.rstrip("/").rsplit("/", 1)[-1])
    return f"checkpoint step {int(named.group(1))}: {saved}" if named else f"checkpoint: {saved}"


def _ended(resumed: Checkpoint, spec: JobSpec) -> bool:
    return resumed.epoch >= spec.train.epochs or (spec.train.max_steps is not None and resumed.step >= spec.train.max_steps)
