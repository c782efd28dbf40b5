"""Sharded checkpoints: every rank writes its own shards of the model and optimizer in parallel
(``torch.distributed.checkpoint``, DCP), rank 0 writes the rest, last.

A sharded checkpoint of step N is a directory ``step-N.dcp`` of DCP files beside the file
``step-N.pt`` that every checkpoint has: the step, the epoch, every rank's loader position and RNG
states, the spec, and the name of its shards. ``step-N.pt`` and its manifest are written only once
every shard is complete, so until then the checkpoint is not listed and a crash at any moment
leaves the previous one loadable. A save never writes into shards that exist: a second save of
step N (``ctx.save()`` after the loop saved that step, a restart repeating it) writes
``step-N-1.dcp`` beside them, and the old shards go only once ``step-N.pt`` names the new ones. Loading reshards: DCP gives each rank the rows of its own shards
whatever the world size that wrote them, and a whole (DDP) model loads a sharded checkpoint and
a sharded model a whole one.

With ``checkpoint.async_save`` the step loop waits only while the state is copied to host memory;
a background thread writes the shards and rank 0 then writes ``step-N.pt``. Without it, the loop
waits while every rank writes its shards; on a file system their fsync (the disk's write-back,
the slowest part) and ``step-N.pt`` follow in the background. Either way, the next save, a
preemption and the end of the job wait for the background part.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    import torch.distributed.checkpoint as dcp

    from lance_hpc.checkpoint.stores import Store

# torch.distributed.checkpoint is imported by the functions that use it, as the stores do: a rank
# that never shards does not pay for its import.

SHARDS_SUFFIX = ".dcp"


def shards_name(step: int, generation: int = 0) -> str:
    """The shard directory of a save of ``step``; ``generation`` counts the saves of that step whose
    shards were still there (``step-N-K.dcp``)."""
    return f"step-{step:08d}{f'-{generation}' if generation else ''}{SHARDS_SUFFIX}"


def bare(item: Any) -> Any:
    """The module inside DDP (its state_dict keys do not depend on the wrapper); anything else as is."""
    return item.module if isinstance(item, nn.parallel.DistributedDataParallel) else item


def is_tensor_state(item: Any) -> bool:
    """Objects whose state goes into the shards: modules and optimizers."""
    return isinstance(bare(item), nn.Module) or isinstance(item, torch.optim.Optimizer)


def _owner(optimizer: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    """The registered module whose parameters ``optimizer`` steps."""
    first = next(iter(optimizer.param_groups[0]["params"]), None)
    for module in modules.values():
        if any(parameter is first for parameter in module.parameters()):
            return module
    raise ValueError("the optimizer steps parameters of no registered model: register the model together with it")


def tensor_state(objects: dict[str, Any]) -> dict[str, Any]:
    """The DCP state dicts of the modules and optimizers among ``objects``, by name: DTensor shards
    for a sharded model, whole tensors for another; optimizer state keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    modules = {name: bare(item) for name, item in objects.items() if isinstance(bare(item), nn.Module)}
    state: dict[str, Any] = {name: get_model_state_dict(module) for name, module in modules.items()}
    for name, item in objects.items():
        if isinstance(item, torch.optim.Optimizer):
            state[name] = get_optimizer_state_dict(_owner(item, modules), item)
    return state


def restore_tensor_state(objects: dict[str, Any], state: dict[str, Any], whole: bool = False) -> None:
    """Put ``state`` (from :func:`tensor_state`'s layout; ``whole``: full tensors on every rank, as a
    DDP checkpoint holds them) into ``objects``, each rank keeping its own rows."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=whole)
    modules = {name: bare(item) for name, item in objects.items() if isinstance(bare(item), nn.Module)}
    for name, module in modules.items():
        set_model_state_dict(module, state[name], options=options)
    for name, item in objects.items():
        if isinstance(item, torch.optim.Optimizer):
            owner = _owner(item, modules)
            saved = by_parameter_name(state[name], owner, item) if whole else state[name]
            set_optimizer_state_dict(owner, item, saved, options=options)


def by_parameter_name(saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain ``optimizer.state_dict()`` (state keyed by parameter position) keyed by parameter
    name instead, the layout DCP's optimizer state uses."""
    if not any(isinstance(key, int) for key in saved.get("state", {})) and not any(
        isinstance(index, int) for group in saved.get("param_groups", []) for index in group["params"]
    ):
        return saved
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    order = [names[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    return {
        "state": {order[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [order[index] for index in group["params"]]} for group in saved["param_groups"]],
    }


def load_shards(objects: dict[str, Any], store: Store, name: str) -> None:
    """Collective: every rank reads its own rows of the shards ``name`` in ``store`` into
    ``objects``, as data only (:mod:`lance_hpc.checkpoint.shards.reading`)."""
    from lance_hpc.checkpoint.shards import reading

    state = tensor_state(objects)
    reading.load(state, store.shard_reader(name))
    restore_tensor_state(objects, state)


def _flushed(store: Store, shards: str, group: Any, publish: Callable[[], None] | None) -> float:
    """In the background: this rank's shard files on disk; once every rank's are, (rank 0) the
    step file that makes them a checkpoint. Returns when that was done (time.monotonic)."""
    failed = torch.tensor([0], dtype=torch.int64)
    try:
        store.flush_shards(shards)
    except OSError as error:
        failed[0] = 1
        where = store.location(shards)
        print(f"lance_hpc: cannot flush the shards {where} to disk: {error}", file=sys.stderr, flush=True)
    dist.all_reduce(failed, group=group)  # sums: no rank publishes while another's files may be lost
    if int(failed.item()):
        raise RuntimeError(f"the shards {store.location(shards)} could not be written to disk on every rank")
    if publish is not None:
        publish()
    return time.monotonic()


def _published(written: Future, publish: Callable[[], None] | None) -> float:
    """In the background: the shards complete, then (rank 0) the step file that makes them a
    checkpoint; returns when that was done (time.monotonic)."""
    written.result()
    if publish is not None:
        publish()
    return time.monotonic()


class ShardedSaver:
    """Writes sharded checkpoints for one run; holds the one background write in flight.

    ``finish`` is rank 0's last act of a save: write ``step-N.pt``, the manifest, prune (given by
    :func:`lance_hpc.checkpoint.saving.save`)."""

    def __init__(self, signal_delay_s: float | None) -> None:
        self.signal_delay_s = signal_delay_s
        self.blocked_s = 0.0  # the step loop's wait in the last save
        self.write_s = 0.0  # the last save's whole time, background write included
        self._group: Any = None
        self._pending: tuple[Future, float] | None = None
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lance_hpc-checkpoint")
        self._writer: dcp.FileSystemWriter | None = None  # of background saves: its staging memory is reused
        self._where = ""  # the store that writer writes to
        self._warned = False

    def save(self, tensors: dict[str, Any], store: Store, name: str, finish: Callable[[], None], background: bool) -> bool:
        """Collective: write ``tensors`` into the shards ``name`` of ``store``. Returns whether
        rank 0 calls ``finish`` in the background, once every shard is complete and on disk;
        otherwise (object storage, without ``background``) the caller publishes.

        ``background`` (checkpoint.async_save): the loop waits only while the state is copied to
        host memory. Without it, on a file system, the loop waits until every rank has written its
        shards, and the fsync of their files runs in the background: the disk's write-back is the
        slowest part of a save, and a crash before it ends leaves the checkpoint unlisted."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        started = time.monotonic()
        if self._group is None:  # the background thread's collectives must not mix with the loop's
            self._group = dist.new_group(backend="gloo")
        publish = finish if dist.get_rank() == 0 else None
        if not background:
            dcp.save(tensors, storage_writer=store.shard_writer(name, synced=False))
            self.blocked_s = self.write_s = time.monotonic() - started
            if not store.needs_flush:
                self._warn_if_slow()
                return False
            flushed = self._publisher.submit(_flushed, store, name, self._group, publish)
            self._pending = (flushed, started)
            return True
        self._writer = store.shard_writer(name, reuse=self._writer if self._where == store.where else None)
        self._where = store.where
        future = dcp.async_save(tensors, storage_writer=self._writer, process_group=self._group)
        assert isinstance(future, Future)
        self.blocked_s = time.monotonic() - started
        self._pending = (self._publisher.submit(_published, future, publish), started)
        return True

    def wait(self) -> None:
        """Collective: the background write in flight, if any, complete and published on every rank;
        a failure on any rank is raised on all of them."""
        if self._pending is None:
            return
        future, started = self._pending
        self._pending = None
        error: BaseException | None = None
        done = time.monotonic()
        try:
            done = future.result()
        except BaseException as failed:  # reported on every rank below
            error = failed
        outcome = [None if error is None else f"{type(error).__name__}: {error}"]
        flags = torch.tensor([0 if outcome[0] is None else 1], dtype=torch.int64)
        dist.all_reduce(flags, group=self._group)
        if int(flags.item()):
            raise RuntimeError(f"a background checkpoint write failed: {outcome[0] or 'on another rank'}")
        self.write_s = done - started
        self._warn_if_slow()

    def wait_quietly(self, timeout_s: float) -> None:
        """After a failure: this rank's own write given ``timeout_s`` to end, with no collective
        (another rank may be gone); what it had written stays on disk, published or not."""
        if self._pending is not None:
            try:
                self._pending[0].result(timeout=timeout_s)
            except BaseException:  # the job is already failing with its own error
                pass
            self._pending = None

    def _warn_if_slow(self) -> None:
        """Said once: a save longer than the preemption warning would not finish before the job is killed."""
        if self._warned or self.signal_delay_s is None or self.write_s <= self.signal_delay_s or dist.get_rank() != 0:
            return
        self._warned = True
        print(
            f"lance_hpc: a checkpoint took {self.write_s:.0f} s to write, longer than the {self.signal_delay_s:.0f} s "
            "that SLURM's preemption warning gives (slurm.signal_delay_s): a preempted job would lose the steps since "
            "its previous checkpoint\n  fix: raise slurm.signal_delay_s, use a faster checkpoint.dir, or "
            "checkpoint.async_save: true",
            file=sys.stderr,
            flush=True,
        )
