"""DDP copies of the model, one per rank, with gradient buckets that sum alike in every run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


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
