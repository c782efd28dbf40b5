"""One manager of what a job checkpoints: the objects its loop registers, saved together at a
step and restored in place when a resumed job registers them again.

Each object is named and has ``state_dict``/``load_state_dict``: models, optimizers, schedulers,
anything of the loop's own, and the training loaders, whose position every rank saves for itself
(exact on any world size). A model and its optimizer go into one file from rank 0 (DDP), or into
shards that every rank writes (FSDP, :mod:`lance_hpc.checkpoint.shards.saver`, in the background with
``checkpoint.async_save``); either way loads into either. The RNG states of every rank come back
once, before the first step."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist
from torch import nn

from lance_hpc.checkpoint import resuming, saving
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.checkpoint.shards.saver import ShardedSaver, bare, is_tensor_state, load_shards, restore_tensor_state, tensor_state
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.parallel import fsdp
from lance_hpc.spec import JobSpec

if TYPE_CHECKING:
    from lance_hpc.runtime.environment import DistEnv


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class LoaderPosition(Stateful, Protocol):
    """A training loader, as a checkpoint sees it: where it is, and what it reads."""

    epoch: int
    consumed: int  # batches of ``epoch`` handed out
    dataset_version: int

    @property
    def pinned(self) -> dict[str, Any]: ...


class CheckpointManager:
    """The registered objects of one rank, and the checkpoints saved of them (see the module doc)."""

    def __init__(self, spec: JobSpec, env: DistEnv, resumed: Checkpoint | None) -> None:
        self.spec, self.env, self.resumed = spec, env, resumed
        self.objects: dict[str, Stateful] = {}
        self.loaders: dict[str, LoaderPosition] = {}  # those of the objects whose position each rank saves
        self.last: str | None = None  # the checkpoint saved last
        self.saver = ShardedSaver(spec.slurm.signal_delay_s if env.launcher == "slurm" else None)
        self.store = open_store(spec.checkpoint.dir)  # every save of the run writes there
        self._rng_restored = False

    def register(self, objects: Mapping[str, Any], loaders: Collection[str]) -> None:
        """Checkpoint ``objects`` from now on, and restore each from the checkpoint resumed from;
        ``loaders`` names the training loaders among them."""
        whole: dict[str, Any] = {}  # from a checkpoint of whole tensors into a sharded model
        from_shards: dict[str, Any] = {}  # from a sharded checkpoint
        resumed = self.resumed
        for name, item in objects.items():
            if not (hasattr(item, "state_dict") and hasattr(item, "load_state_dict")):
                raise UserError(
                    f"ctx.register({name}=...): a {type(item).__name__} has no state_dict/load_state_dict to checkpoint it with"
                )
            self.objects[name] = item
            if name in loaders:
                self.loaders[name] = item
            if resumed is None:
                continue
            if name in loaders:
                saved = resumed.loader_position(name, self.env)
                if saved is not None:
                    item.load_state_dict(saved)
            elif resumed.shards is not None and is_tensor_state(item):
                from_shards[name] = item
            elif name in resumed.objects and is_tensor_state(item) and self.sharded:
                whole[name] = item
            elif name in resumed.objects:
                resuming.restore_object(bare(item), resumed.objects[name], resumed, self.spec, name)
            else:
                raise UserError(
                    f"ctx.register: the checkpoint {resumed.path} holds no {name!r} "
                    f"(it has {', '.join(resumed.objects) or 'nothing'})"
                )
        if from_shards:
            assert resumed is not None and resumed.shards is not None
            load_shards(from_shards, resumed.store, resumed.shards)
        if whole:
            assert resumed is not None
            restore_tensor_state(whole, {name: resumed.objects[name] for name in whole}, whole=True)

    @property
    def sharded(self) -> bool:
        """A registered model is sharded (FSDP): models and optimizers go into shards."""
        return any(fsdp.is_sharded(bare(item)) for item in self.objects.values() if isinstance(item, nn.Module))

    def models(self) -> list[nn.Module]:
        """The registered models, outside DDP."""
        return [bare(item) for item in self.objects.values() if isinstance(bare(item), nn.Module)]

    def restore_rng(self) -> None:
        """Once, before the first step: this rank's RNG states as the checkpoint saved them."""
        if self.resumed is not None and not self._rng_restored:
            resuming.restore_rank(self.resumed, self.env, self.spec.train.seed)
            self._rng_restored = True

    def save(self, step: int, epoch: int, progress: float) -> str:
        """Collective: checkpoint every registered object now, as of ``step`` in ``epoch``
        (``progress``: epochs read). Under fsdp each rank writes its own shards of the model and
        optimizer (in the background with checkpoint.async_save)."""
        loaders = self.loaders
        mid_epoch = any(item.epoch == epoch and item.consumed > 0 for item in loaders.values())
        sharded = self.sharded
        tensors = {name: item for name, item in self.objects.items() if sharded and is_tensor_state(item)}
        for item in tensors.values():  # fsdp keeps buffers (BatchNorm statistics) per rank: save rank 0's, as DDP does
            if isinstance(item, nn.Module):
                for buffer in item.buffers():
                    dist.broadcast(buffer, src=0)
        first = next(iter(loaders.values()), None)
        state = {
            "format": saving.FORMAT,
            "step": step,
            "epoch": epoch,
            "progress": progress,
            "mid_epoch": mid_epoch,
            "world_size": self.env.world_size,
            "objects": {
                name: bare(item).state_dict()
                for name, item in self.objects.items()
                if name not in loaders and name not in tensors
            },
            "dataset_version": first.dataset_version if first is not None else None,
            "data_pinned": first.pinned if first is not None else None,
            "spec": self.spec.redacted_dict(),
        }
        rank_state = {"loaders": {name: item.state_dict() for name, item in loaders.items()} if mid_epoch else {}}
        shards = (self.saver, tensor_state(tensors), self.spec.checkpoint.async_save) if sharded else None
        self.last = str(saving.save(self.store, step, state, rank_state, self.spec.checkpoint.keep, shards))
        return self.last

    def wait(self) -> None:
        """Collective: the checkpoint still being written in the background complete."""
        self.saver.wait()

    def wait_quietly(self, timeout_s: float) -> None:
        """After a failure: this rank's own background write given ``timeout_s`` to end, with no collective."""
        self.saver.wait_quietly(timeout_s)
