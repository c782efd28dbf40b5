"""Sharded training with FSDP2: parameters, gradients and optimizer state split over the ranks.

Each block the task declares (a transformer block, an image model's stage) is one FSDP unit: its
parameters are gathered just before its forward and backward and freed again after, so a rank
holds whole only the block it is computing. The root unit takes what is left (embeddings, head).
On GPU with bf16, parameters are gathered in bf16 and gradients reduced in fp32; on CPU all is fp32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lance_hpc.spec import TrainSpec


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 module (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model: nn.Module, blocks: list[nn.Module], device: torch.device, train: TrainSpec, world_size: int) -> nn.Module:
    """``fully_shard`` each block, then the root, with the spec's precision, recomputation, compile
    and offload settings; returns ``model`` itself (FSDP2 changes it in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    bf16 = device.type == "cuda" and train.precision == "bf16"
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if train.cpu_offload else OffloadPolicy()
    for block in blocks:
        if train.activation_checkpointing:
            recompute_activations(block)
        if train.compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)
    return model


def recompute_activations(block: nn.Module) -> None:
    """Keep only ``block``'s inputs in the forward pass and recompute the rest in the backward pass.
    The block's forward is replaced on the instance, so its state_dict keys stay the same and a
    checkpoint loads with or without recomputation."""
    from torch.utils.checkpoint import checkpoint

    forward: Callable[..., Any] = block.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


def default_blocks(model: nn.Module) -> tuple[list[nn.Module], str]:
    """Blocks for a model whose task declares none: the modules of its largest ModuleList or
    Sequential (by parameters), else its direct children that hold parameters; and where they came from."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and module is not model and len(module) > 1:
            size = sum(parameter.numel() for parameter in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, list(module))
    if best is not None:
        return [block for block in best[2] if any(True for _ in block.parameters())], f"the modules of {best[1]}"
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    return children, "its direct children"


def note_default_blocks(task_name: str, where: str, count: int) -> None:
    """Said once, by rank 0: what fsdp wraps when the task declared nothing, and how to declare."""
    print(
        f"lance_hpc: task {task_name} declares no blocks to shard; fsdp wraps {where} ({count} units) and the rest at "
        "the root\n  to choose: give the task a method blocks(self, model) returning the repeated blocks "
        "(e.g. list(model.layers)), or pass them in a loop of your own: ctx.wrap(model, blocks=[...])",
        file=sys.stderr,
        flush=True,
    )
