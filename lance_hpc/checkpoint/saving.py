"""Saving a checkpoint: every rank calls :func:`save` with the same step; the state is written so
that a reader finds all of it or nothing.

A checkpoint is one file ``step-XXXXXXXX.pt`` in checkpoint.dir, a local directory or an
``s3://bucket/prefix`` (:mod:`lance_hpc.checkpoint.stores`, opened once and handed to each
function here), with a small JSON manifest beside it
(:mod:`lance_hpc.checkpoint.manifests`); a sharded model adds the directory of its shards
(:mod:`lance_hpc.checkpoint.shards.saver`). Either way a crash at any moment leaves either the new
checkpoint or none: the previous checkpoint stays loadable. One run writes to a directory at a time:
rank 0 holds its lease (:mod:`lance_hpc.checkpoint.lease`, taken by :func:`writer_lease`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch.distributed as dist

from lance_hpc.checkpoint import lease
from lance_hpc.checkpoint.manifests import checkpoint_name, checkpoint_names, checkpoint_steps, leftovers, manifest, manifest_name
from lance_hpc.checkpoint.rng_states import capture_rng
from lance_hpc.checkpoint.shards.saver import SHARDS_SUFFIX, ShardedSaver, shards_name
from lance_hpc.checkpoint.stores import Location, NoSpace, Store
from lance_hpc.errors import UserError

# The checkpoint layout Context.save writes: named objects, named loaders per rank.
FORMAT = 2
SHARDS_PATTERN = re.compile(r"^step-(\d+)(-\d+)?" + re.escape(SHARDS_SUFFIX) + "$")


def checkpoint_path(store: Store, step: int) -> Location:
    """Where the checkpoint of ``step`` goes: a Path, or an s3:// URI for a directory on object storage."""
    return store.location(checkpoint_name(step))


def list_checkpoints(store: Store) -> list[Location]:
    """Complete checkpoints in ``store``, oldest first (temporary files and unfinished uploads
    are never listed)."""
    return [store.location(name) for name in checkpoint_names(store.names())]


def prune(store: Store, keep: int, published: tuple[int, str | None] | None = None) -> None:
    """Delete all but the newest ``keep`` checkpoints with their manifests and shards, and what a
    crash left (temporary files, shards of a save that never completed). ``published``: the step
    whose step file was just written and the shards it names (None: none); that step's other shard
    directories go too (those of an earlier save of the same step, now replaced)."""
    names = store.names()
    steps = checkpoint_steps(names)
    pruned = list(steps.items())[:-keep]
    manifests = [manifest_name(step) for step, _ in pruned if manifest_name(step) in names]
    for name in [name for _, name in pruned] + manifests + leftovers(names):
        store.delete(name)
    kept = set(steps) - {step for step, _ in pruned}
    for name in store.shard_directories():  # pruned, or of a save that never completed
        match = SHARDS_PATTERN.match(name)
        if match is None:
            continue
        replaced = published is not None and int(match.group(1)) == published[0] and name != published[1]
        if int(match.group(1)) not in kept or replaced:
            store.delete_shards(name)


def fresh_shards_name(store: Store, step: int) -> str:
    """Collective: a name for the shards of a save of ``step`` that no directory in checkpoint.dir
    has, the same on every rank: ``step-N.dcp``, or ``step-N-K.dcp`` beside the shards of an earlier
    save of that step (the published checkpoint's, until the new step file names the new ones)."""
    chosen = [shards_name(step)]
    if dist.get_rank() == 0:
        taken = set(store.shard_directories())
        generation = 0
        while chosen[0] in taken:
            generation += 1
            chosen[0] = shards_name(step, generation)
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def save(
    store: Store,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep: int,
    sharded: tuple[ShardedSaver, dict[str, Any], bool] | None = None,
) -> Location:
    """Collective: every rank calls it with the same step; rank 0 writes, then all ranks go on.

    ``state`` is rank 0's (the model and optimizer are the same on every rank). ``rank_state``
    and the RNG states of every rank are gathered into ``state["ranks"][rank]``, so each rank gets
    its own back on resume. A failed write raises on every rank (rank 0's error is broadcast)
    instead of leaving the others waiting.

    ``sharded`` (saver, tensor state, in the background): the modules and optimizers are written
    by every rank into the shards ``step-N.dcp`` first (see :mod:`lance_hpc.checkpoint.shards.saver`),
    and ``step-N.pt`` names them; rank 0 writes it when the shards are complete, in the background
    unless they went to object storage without ``checkpoint.async_save``.
    """
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {**rank_state, "rng": capture_rng()})
    path = checkpoint_path(store, step)
    shards = None
    if sharded is not None:
        sharded[0].wait()  # an earlier save still in flight publishes first: its shards are then listed
        shards = fresh_shards_name(store, step)
        state = {**state, "shards": shards}

    def publish() -> None:
        held = lease.held(store)
        if held is not None:
            held.confirm()
        store.write(checkpoint_name(step), {**state, "ranks": ranks})
        store.write_bytes(manifest_name(step), manifest({**state, "step": step}, len(ranks)))
        prune(store, keep, (step, shards))

    if sharded is not None and shards is not None:
        saver, tensors, background = sharded
        if saver.save(tensors, store, shards, publish, background):
            return path  # rank 0 publishes it in the background
    outcome: list[Any] = [None]  # (message, whether it is a UserError) when rank 0 failed
    if dist.get_rank() == 0:
        try:
            publish()
        except UserError as error:  # the object store's message already names the URI and the fix
            outcome[0] = (str(error), True)
        except NoSpace as full:
            outcome[0] = (no_space_message(store, full), True)
        except Exception as error:  # reported on every rank below
            outcome[0] = (f"cannot write checkpoint {path}: {type(error).__name__}: {error}", False)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        message, user_error = outcome[0]
        raise UserError(message) if user_error else RuntimeError(message)
    return path


def no_space_message(store: Store, full: NoSpace) -> str:
    """What a save that filled the file system tells the user: the file, the space left, and that
    the newest complete checkpoint is untouched (a write goes to a temporary file first)."""
    intact = checkpoint_names(store.names())
    reached = f", which had reached {_size(full.written)}" if full.written else ""
    if full.quota:
        problem = f"the disk quota on its file system is used up ({_size(full.free)} free on the file system)"
    else:
        problem = f"the file system is full ({_size(full.free)} free in {store.where} after removing the partial file{reached})"
    if intact:
        kept = (
            f"the newest complete checkpoint, {intact[-1]}, is intact: a checkpoint is written to a temporary file "
            "and renamed into place only when complete"
        )
    else:
        kept = "no earlier checkpoint exists, and nothing was left behind"
    fix = (
        f"free space there or point checkpoint.dir at a larger file system (checkpoint.keep: fewer kept), then run "
        f"again to {'resume from ' + intact[-1] if intact else 'start'}"
    )
    return f"cannot write {full.path}: {problem}\n  {kept}\n  fix: {fix}"


def _size(count: float) -> str:
    for unit in ("bytes", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


class RankPlace(Protocol):
    """What a checkpoint needs of a rank's place in the job (the runtime's DistEnv is one)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def restart_count(self) -> int: ...

    @property
    def job_ref(self) -> str | None: ...

    @property
    def attempt(self) -> int: ...


@contextmanager
def writer_lease(store: Store, env: RankPlace) -> Iterator[lease.Lease | None]:
    """Collective: rank 0 takes the lease of checkpoint.dir before any rank writes there, and
    yields it (other ranks get None); when another run holds it, every rank raises the same
    UserError, so none waits for the others. On leaving, the lease is released, unless it was
    kept for a requeue (:meth:`lance_hpc.checkpoint.lease.Lease.keep`)."""
    held: lease.Lease | None = None
    refusal: list[Any] = [None]  # (message, whether it is a UserError) when rank 0 did not get the lease
    if env.rank == 0:
        try:
            held, note = lease.acquire(store, lease.this_process(env.job_ref, env.restart_count, env.attempt))
            if note:
                print(f"lance_hpc: {note}", file=sys.stderr, flush=True)
        except UserError as error:
            refusal[0] = (str(error), True)
        except Exception as error:  # raised on every rank below, not only on this one
            refusal[0] = (f"cannot take the lease of checkpoint.dir {store.where}: {type(error).__name__}: {error}", False)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        message, user_error = refusal[0]
        raise UserError(message) if user_error else RuntimeError(message)
    try:
        yield held
    finally:
        if held is not None:
            try:
                held.release()
            except Exception as error:  # the run's outcome matters more; a stale lease is taken over later
                print(f"lance_hpc: cannot release the lease {held.store.where} ({error})", file=sys.stderr, flush=True)
