"""A model built where it will live: constructed on the meta device, its initialisation recorded,
then replayed on each rank's own rows of every tensor.

Constructing a model on the meta device allocates nothing and draws no random numbers, so a model
of any size is "built" in milliseconds. What its constructor did to each parameter and buffer
(``uniform_``, ``normal_``, ``fill_``, ``zero_``, ``mul_`` and other element-wise in-place
operations with plain numbers as arguments) is recorded by :class:`InitRecorder`; the recording is
replayed later on real memory: the whole tensor under DDP, only this rank's shard of it under FSDP.

Random values are drawn per block of rows, from a generator seeded by (seed, tensor name, block),
so a tensor's values do not depend on how it is sharded: a model initialised on 2 ranks, on 3,
or whole under DDP holds the same numbers for the same seed, and each rank draws only its rows.
A constructor that does something else to a tensor (copies another tensor into it, writes a slice,
leaves it uninitialised) cannot be replayed; :func:`replay_problem` names the tensor, and the model
is then built on the CPU as a whole, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# In-place operations that give every element of their tensor a value regardless of what it held.
OVERWRITES = {aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.zero_.default}
# In-place operations that change each element on its own: replayed on any block of rows.
ELEMENTWISE = OVERWRITES | {
    aten.mul_.Scalar,
    aten.div_.Scalar,
    aten.add_.Scalar,
    aten.sub_.Scalar,
    aten.clamp_.default,
    aten.clamp_min_.default,
    aten.clamp_max_.default,
    aten.erfinv_.default,
    aten.exp_.default,
    aten.log_.default,
    aten.neg_.default,
    aten.sqrt_.default,
    aten.abs_.default,
}
# Factories whose values do not depend on memory: a buffer made by one is replayed whole.
FACTORIES = {aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default, aten.arange.start}
# Elements per block of rows drawn from one generator: a block is the unit a shard starts at.
BLOCK_ELEMENTS = 1 << 20


@dataclass
class History:
    """What the constructor did to one tensor: how it was made, and the in-place operations since the
    last one that overwrote every element; ``problem`` says why it cannot be replayed."""

    factory: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
    operations: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    overwritten: bool = False
    problem: str | None = None


class InitRecorder(TorchDispatchMode):
    """Records, per meta tensor, the operations a model's constructor applies to it."""

    def __init__(self) -> None:
        super().__init__()
        self.histories: dict[int, History] = {}
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        if func in FACTORIES and not tensors and isinstance(result, torch.Tensor):
            self._history(result).factory = (func, args, kwargs)
            return result
        schema_arguments = func._schema.arguments
        writes = bool(schema_arguments) and schema_arguments[0].alias_info is not None and schema_arguments[0].alias_info.is_write
        if not writes or not tensors or args[0] is not tensors[0]:
            return result
        target = args[0]
        history = self._history(target._base if target._base is not None else target)
        if target._base is not None:
            history.problem = f"{func} writes part of it"
        elif len(tensors) > 1 or any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            history.problem = f"{func} gives it values from another tensor"
        elif func not in ELEMENTWISE:
            history.problem = f"{func} is not an element-wise initialisation"
        elif func in OVERWRITES:
            history.operations = [(func, args[1:], kwargs)]
            history.overwritten = True
        else:
            history.operations.append((func, args[1:], kwargs))
        return result

    def _history(self, tensor: torch.Tensor) -> History:
        key = id(tensor)
        if key not in self.histories:
            self.histories[key] = History()
            self._alive.append(tensor)
        return self.histories[key]

    def of(self, tensor: torch.Tensor) -> History:
        return self.histories.get(id(tensor), History(problem="the constructor never initialised it"))


@dataclass(frozen=True)
class MetaModel:
    """A model on the meta device and what its constructor did to each tensor, by the tensor's
    name (sharding replaces the tensors but keeps their names)."""

    model: nn.Module
    histories: dict[str, History]

    def problem(self) -> str | None:
        """Why this model cannot be replayed (the first tensor that cannot, and why), or None."""
        for name, history in self.histories.items():
            reason = history.problem
            if reason is None and not history.overwritten and history.factory is None:
                reason = "it is made uninitialised and never given values"
            if reason is not None:
                return f"{name}: {reason}"
        return None


def build_on_meta(build: Callable[[], nn.Module]) -> MetaModel:
    """``build()`` on the meta device, recording its initialisation."""
    recorder = InitRecorder()
    with torch.device("meta"), recorder:
        model = build()
    return MetaModel(model, {name: recorder.of(tensor) for name, tensor in named_tensors(model)})


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied one once, under its first name) and buffer of ``model``."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def to_empty(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to_empty(device)`` that keeps tied parameters tied (``nn.Module.to_empty`` gives each
    name its own tensor, which would untie a language model's head from its embedding)."""
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            for key, parameter in module._parameters.items():
                if parameter is not None:
                    if id(parameter) not in made:
                        made[id(parameter)] = nn.Parameter(
                            torch.empty_like(parameter, device=device), requires_grad=parameter.requires_grad
                        )
                    module._parameters[key] = made[id(parameter)]  # type: ignore[assignment]
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    if id(buffer) not in made:
                        made[id(buffer)] = torch.empty_like(buffer, device=device)
                    module._buffers[key] = made[id(buffer)]
    return model


def materialise(meta: MetaModel, device: torch.device, seed: int) -> None:
    """Give every tensor of ``meta.model`` its values on ``device``, in place: the model's tensors
    must already be real memory (``to_empty``), whole or sharded on their first dimension (FSDP2's
    DTensors); only this rank's rows are computed."""
    with torch.no_grad():
        for name, tensor in named_tensors(meta.model):
            history = meta.histories[name]
            local, first_row = _local_rows(tensor)
            if history.overwritten:
                _replay_rows(history, local, first_row, _tensor_seed(seed, name))
            else:  # made by a factory, with in-place operations after: small buffers, computed whole
                func, args, kwargs = history.factory  # type: ignore[misc]
                whole = func(*args, **{**kwargs, "device": local.device})
                for operation, operation_args, operation_kwargs in history.operations:
                    operation(whole, *operation_args, **operation_kwargs)
                local.copy_(whole.reshape(tensor.shape)[first_row : first_row + local.shape[0]] if local.dim() else whole)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``tensor`` and the global row it starts at (0 for a whole tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor.data, 0
    local = tensor.to_local()
    placements = tensor.placements
    if not any(isinstance(placement, Shard) for placement in placements):
        return local, 0
    if len(placements) != 1 or placements[0] != Shard(0):
        raise NotImplementedError(f"initialising a tensor placed as {placements} (only Shard(0) is)")
    mesh = tensor.device_mesh
    rows, ranks, index = tensor.shape[0], mesh.size(), mesh.get_local_rank()
    per_rank = -(-rows // ranks)  # torch.chunk's split: ceil(rows / ranks) each, the last ones shorter
    return local, min(index * per_rank, rows)


def _replay_rows(history: History, local: torch.Tensor, first_row: int, seed: int) -> None:
    """The recorded operations on rows [first_row, first_row + len(local)) of the whole tensor,
    block by block, each block with its own generator: the rows come out the same however the
    tensor is split."""
    if local.numel() == 0:
        return
    if local.dim() == 0:
        _apply(history, local, _generator(local.device, seed, 0))
        return
    row_elements = max(local[0].numel(), 1)
    block_rows = max(BLOCK_ELEMENTS // row_elements, 1)
    end = first_row + local.shape[0]
    block = first_row // block_rows
    while block * block_rows < end:
        start, stop = block * block_rows, min((block + 1) * block_rows, end)
        generator = _generator(local.device, seed, block)
        rows = torch.empty((stop - start, *local.shape[1:]), dtype=local.dtype, device=local.device)
        _apply(history, rows, generator)
        keep_from, keep_to = max(start, first_row), stop
        local[keep_from - first_row : keep_to - first_row].copy_(rows[keep_from - start : keep_to - start])
        block += 1


def _apply(history: History, rows: torch.Tensor, generator: torch.Generator) -> None:
    for func, args, kwargs in history.operations:
        if any(argument.name == "generator" for argument in func._schema.arguments):
            func(rows, *args, **{**kwargs, "generator": generator})
        else:
            func(rows, *args, **kwargs)


def _generator(device: torch.device, seed: int, block: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + block * 0x9E3779B97F4A7C15) % (1 << 63))
    return generator


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """The global generators seeded with ``seed`` inside, restored after (a CPU build falls back to them)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
