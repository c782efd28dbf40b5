"""The task's model, built where it lives and wrapped for ``train.parallelism``: what
``ctx.build_model()``, ``ctx.wrap(model)`` and ``ctx.no_sync(model)`` do."""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.checkpoint.weights import load_weights
from lance_hpc.parallel import fsdp
from lance_hpc.parallel.ddp import wrap_model
from lance_hpc.parallel.fsdp import default_blocks, note_default_blocks
from lance_hpc.parallel.materialise import MetaModel, build_on_meta, materialise, seeded, to_empty
from lance_hpc.parallel.memory import out_of_memory_message
from lance_hpc.runtime.rank_watch import RankWatch
from lance_hpc.spec import JobSpec, TrainSpec
from lance_hpc.tasks import Task


def precision_context(train_spec: TrainSpec, device: torch.device) -> torch.autocast:
    """bf16 autocast on GPU when train.precision is bf16; fp32 otherwise (and always on CPU)."""
    enabled = device.type == "cuda" and train_spec.precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class ModelSetup:
    """Builds the task's model on the meta device and initialises it where it lives; wraps a model
    in DDP, or shards it (FSDP2)."""

    def __init__(
        self, spec: JobSpec, task: Task, device: torch.device, world_size: int, is_main: bool, resumed: Checkpoint | None
    ) -> None:
        self.spec, self.task, self.device = spec, task, device
        self.world_size, self.is_main, self.resumed = world_size, is_main, resumed
        self._meta: dict[int, MetaModel] = {}  # models of build() that wrap() initialises on their shards

    def build(self) -> nn.Module:
        """The task's model, with the initial weights its options name, as the task prepares it: on
        this rank's device under ddp; under fsdp on the meta device until :meth:`wrap` gives each
        rank its shards. A resumed job checks instead that its checkpoint was written for the same
        task and model."""
        if self.resumed is not None:
            resuming.check_same_model(self.resumed, self.spec, self.task.options)
        weights = None if self.resumed is not None else self.task.weights_file()
        meta = build_on_meta(self.task.build_model)
        problem = meta.problem()
        if problem is None and self.spec.train.parallelism == "fsdp" and weights is None:
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
        if weights is not None:
            load_weights(model, weights)
        if self.spec.train.parallelism == "fsdp":
            return model  # fully_shard moves each shard to the device
        return self.task.prepare_model(model, self.device)

    def wrap(self, model: nn.Module, blocks: list[nn.Module] | None, watch: RankWatch) -> nn.Module:
        """``model`` on this rank's device: DDP (its gradient all-reduce noted on ``watch``), or
        FSDP2 shards of each of ``blocks`` (default: the task's) and of the root."""
        if self.spec.train.parallelism == "fsdp":
            return self._shard(model, blocks)
        wrapped = wrap_model(model.to(self.device), self.device, self.spec.train.deterministic)
        watch.hook(wrapped)
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

    def out_of_memory(self, error: BaseException, models: list[nn.Module]) -> str:
        """What the model's state needs per rank and what to change, for a device out of memory
        (``models``: those registered; none yet, and the task's is counted on the meta device)."""
        if not models:  # it ran out while the model was built or wrapped
            models = [build_on_meta(self.task.build_model).model]
        parameters = sum(parameter.numel() for model in models for parameter in model.parameters())
        total = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        return out_of_memory_message(error, self.spec, parameters, self.world_size, str(self.device), total)


def no_sync(model: nn.Module, accumulating: bool) -> AbstractContextManager[Any]:
    """DDP's no_sync while ``accumulating`` (a sharded model: no gradient reduce-scatter until the
    step's last batch): gradients are reduced once per step."""
    if fsdp.is_sharded(model):
        model.set_requires_gradient_sync(not accumulating)  # type: ignore[operator]
        return nullcontext()
    if accumulating and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return nullcontext()
