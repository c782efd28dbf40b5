"""Checkpoints: atomic save by rank 0, resume from the latest, and preemption (save, then requeue).

A checkpoint is one file ``step-XXXXXXXX.pt`` in checkpoint.dir, a local directory or an
``s3://bucket/prefix`` (see :mod:`lance_hpc.storage.checkpoint_store`), with a small JSON manifest beside it
(:mod:`lance_hpc.storage.checkpoint_index`). Either way a crash at any moment leaves either the new
checkpoint or none: the previous checkpoint stays loadable. One run writes to a directory at a time:
rank 0 holds its lease (:mod:`lance_hpc.runtime.lease`, taken by :func:`writer_lease`).
"""

from __future__ import annotations

import logging
import random
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ValidationError
from torch import nn

from lance_hpc.checkpoint.shard_files import delete_shards, shard_directories
from lance_hpc.checkpoint.sharded import SHARDS_SUFFIX, ShardedSaver, shards_name
from lance_hpc.data.mix import pinned_mix
from lance_hpc.errors import UserError
from lance_hpc.runtime import lease
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.runtime.metrics import flatten
from lance_hpc.spec import DataSpec, JobSpec
from lance_hpc.storage.checkpoint_index import (
    checkpoint_name,
    checkpoint_names,
    checkpoint_steps,
    leftovers,
    manifest,
    manifest_name,
)
from lance_hpc.storage.checkpoint_store import Location, NoSpace, locate, open_store

# The checkpoint layout Context.save writes: named objects, named loaders per rank.
FORMAT = 2
# What the built-in trainer kept at the top of a checkpoint before FORMAT 2.
EARLIER_TRAINER_OBJECTS = ("model", "optimizer")

log = logging.getLogger("lance_hpc.checkpoint")
SHARDS_PATTERN = re.compile(r"^step-(\d+)" + re.escape(SHARDS_SUFFIX) + "$")


def checkpoint_path(directory: str | Path, step: int) -> Location:
    """Where the checkpoint of ``step`` goes: a Path, or an s3:// URI for a directory on object storage."""
    return open_store(directory).location(checkpoint_name(step))


def list_checkpoints(directory: str | Path) -> list[Location]:
    """Complete checkpoints in ``directory``, oldest first (temporary files and unfinished uploads
    are never listed)."""
    store = open_store(directory)
    return [store.location(name) for name in checkpoint_names(store.names())]


def write_atomically(state: dict[str, Any], path: Location) -> None:
    """Write ``state`` to ``path`` so that a reader finds all of it or nothing: locally a temporary
    file, fsync, rename over ``path``, fsync the directory; on object storage one upload."""
    store, name = locate(path)
    store.write(name, state)


def prune(directory: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints with their manifests and shards, and what a
    crash left (temporary files, shards of a save that never completed)."""
    store = open_store(directory)
    names = store.names()
    steps = checkpoint_steps(names)
    pruned = list(steps.items())[:-keep]
    manifests = [manifest_name(step) for step, _ in pruned if manifest_name(step) in names]
    for name in [name for _, name in pruned] + manifests + leftovers(names):
        store.delete(name)
    kept = set(steps) - {step for step, _ in pruned}
    for name in shard_directories(store):  # pruned, or of a save that never completed
        match = SHARDS_PATTERN.match(name)
        if match and int(match.group(1)) not in kept:
            delete_shards(store, name)


def save(
    directory: str | Path,
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
    by every rank into the shards ``step-N.dcp`` first (see :mod:`lance_hpc.checkpoint.sharded`),
    and ``step-N.pt`` names them; in the background, rank 0 writes it when the shards are complete.
    """
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {**rank_state, "rng": capture_rng()})
    path = checkpoint_path(directory, step)
    if sharded is not None:
        state = {**state, "shards": shards_name(step)}

    def publish() -> None:
        held = lease.held(directory)
        if held is not None:
            held.confirm()
        write_atomically({**state, "ranks": ranks}, path)
        open_store(directory).write_bytes(manifest_name(step), manifest({**state, "step": step}, len(ranks)))
        prune(directory, keep)

    if sharded is not None:
        saver, tensors, background = sharded
        saver.save(tensors, directory, shards_name(step), publish, background)
        if background:
            return path
    outcome: list[Any] = [None]  # (message, whether it is a UserError) when rank 0 failed
    if dist.get_rank() == 0:
        try:
            publish()
        except UserError as error:  # the object store's message already names the URI and the fix
            outcome[0] = (str(error), True)
        except NoSpace as full:
            outcome[0] = (no_space_message(directory, full), True)
        except Exception as error:  # reported on every rank below
            outcome[0] = (f"cannot write checkpoint {path}: {type(error).__name__}: {error}", False)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        message, user_error = outcome[0]
        raise UserError(message) if user_error else RuntimeError(message)
    return path


def no_space_message(directory: str | Path, full: NoSpace) -> str:
    """What a save that filled the file system tells the user: the file, the space left, and that
    the newest complete checkpoint is untouched (a write goes to a temporary file first)."""
    intact = checkpoint_names(open_store(directory).names())
    reached = f", which had reached {_size(full.written)}" if full.written else ""
    if full.quota:
        problem = f"the disk quota on its file system is used up ({_size(full.free)} free on the file system)"
    else:
        problem = f"the file system is full ({_size(full.free)} free in {directory} after removing the partial file{reached})"
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


@contextmanager
def writer_lease(directory: str | Path, env: DistEnv) -> Iterator[lease.Lease | None]:
    """Collective: rank 0 takes the lease of checkpoint.dir before any rank writes there, and
    yields it (other ranks get None); when another run holds it, every rank raises the same
    UserError, so none waits for the others. On leaving, the lease is released, unless it was
    kept for a requeue (:meth:`lance_hpc.runtime.lease.Lease.keep`)."""
    held: lease.Lease | None = None
    refusal: list[Any] = [None]  # (message, whether it is a UserError) when rank 0 did not get the lease
    if env.rank == 0:
        try:
            held, note = lease.acquire(directory, lease.this_process(env.job_ref, env.restart_count))
            if note:
                print(f"lance_hpc: {note}", file=sys.stderr, flush=True)
        except UserError as error:
            refusal[0] = (str(error), True)
        except Exception as error:  # raised on every rank below, not only on this one
            refusal[0] = (f"cannot take the lease of checkpoint.dir {directory}: {type(error).__name__}: {error}", False)
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


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: what rank 0 saved, plus every rank's own part in ``state["ranks"]``.

    One layout (:data:`FORMAT`): ``objects`` maps each registered name to its ``state_dict`` and each
    rank's part maps loader names to their positions (``loaders``). Checkpoints of the earlier built-in
    trainer, with ``model`` and ``optimizer`` at the top and one ``loader`` per rank, read the same way."""

    path: Location  # a Path, or an s3:// URI
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def epoch(self) -> int:
        """The epoch being read when it was written (the next one, at an epoch end)."""
        return int(self.state["epoch"])

    @property
    def shards(self) -> str | None:
        """The name of its model and optimizer shards beside it (a sharded checkpoint); None for one file."""
        return self.state.get("shards")

    @property
    def directory(self) -> str:
        """The checkpoint.dir that holds it."""
        return str(self.path).rpartition("/")[0] if "://" in str(self.path) else str(Path(self.path).parent)

    @property
    def world_size(self) -> int:
        """How many ranks wrote it."""
        return len(self.state["ranks"])

    def rank_state(self, rank: int) -> dict[str, Any]:
        """What ``rank`` saved (its RNG states, its data position, ...)."""
        return self.state["ranks"][rank]

    @property
    def objects(self) -> dict[str, Any]:
        """The saved ``state_dict`` of each registered object, by name."""
        if "objects" in self.state:
            return self.state["objects"]
        return {name: self.state[name] for name in EARLIER_TRAINER_OBJECTS if name in self.state}

    def loader_position(self, name: str, env: DistEnv) -> dict[str, Any] | None:
        """Where the loader registered as ``name`` stopped, for this rank (None at an epoch boundary)."""
        saved = saved_position(self, env)
        loaders = saved.get("loaders")
        if loaders is None and saved.get("loader") is not None:  # the earlier built-in trainer's one loader
            loaders = {"loader": saved["loader"]}
        return (loaders or {}).get(name)


def load_step(directory: str | Path, step: int) -> Checkpoint:
    """The checkpoint of ``step`` in ``directory``; a UserError listing the steps there when it has none."""
    store = open_store(directory)
    steps = checkpoint_steps(store.names())
    if step not in steps:
        kept = ", ".join(str(kept) for kept in steps) or "none"
        raise UserError(f"{directory} holds no checkpoint of step {step} (it has: {kept})")
    return Checkpoint(store.location(steps[step]), store.read(steps[step]))


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The newest checkpoint that loads; None when there is none."""
    store = open_store(directory)
    for name in reversed(checkpoint_names(store.names())):
        path = store.location(name)
        try:
            return Checkpoint(path, store.read(name))
        except UserError:  # the object store cannot be read at all: no older checkpoint would load either
            raise
        except Exception as error:  # an unreadable file (e.g. a damaged disk): fall back to the previous one
            print(f"lance_hpc: skipping unreadable checkpoint {path}: {error}", file=sys.stderr)
    return None


def check_same_model(resumed: Checkpoint, spec: JobSpec, options: BaseModel) -> None:
    """Refuse, with one message naming both, a checkpoint written for another task or model than the
    task's model this job builds (``options``: this job's validated task options)."""
    saved_task = resumed.state.get("spec", {}).get("task", {})
    saved_name, saved_options = saved_task.get("name", spec.task.name), saved_task.get("options", {})
    saved_model = saved_options.get("model")
    if saved_name == spec.task.name:
        try:  # the same task class fills in the default model the checkpoint's spec left out
            saved_model = getattr(type(options).model_validate(saved_options), "model", saved_model)
        except ValidationError:
            pass
    ours, theirs = _model_text(spec.task.name, getattr(options, "model", None)), _model_text(saved_name, saved_model)
    if ours != theirs:
        back = f"task.options.model: {saved_model}" if saved_name == spec.task.name else f"task.name: {saved_name}"
        raise UserError(
            f"checkpoint {resumed.path} was written for {theirs}, but this job trains {ours}\n"
            f"  fix: {_OTHER_DIRECTORY}, or set {back} to continue that run; {_START_OVER}"
        )


def restore_object(item: Any, saved: Any, resumed: Checkpoint, spec: JobSpec, name: str) -> None:
    """``item.load_state_dict(saved)``: a model (or optimizer) that does not match the checkpoint's is
    one UserError listing a few mismatched keys, instead of torch's list of every one."""
    try:
        item.load_state_dict(saved)
    except (RuntimeError, ValueError) as error:
        if isinstance(item, nn.Module):
            mismatch = _state_mismatch(item, saved)
        else:  # an optimizer over other parameters says so in a ValueError
            mismatch = str(error) if isinstance(item, torch.optim.Optimizer) and isinstance(error, ValueError) else ""
        if not mismatch:
            raise
        changes = _spec_changes(resumed.state.get("spec", {}), spec.redacted_dict())  # as the checkpoint keeps it
        raise UserError(
            f"checkpoint {resumed.path}: its {name!r} does not match this job's {name} ({mismatch})\n"
            + (f"  the checkpoint was written with {changes}\n" if changes else "")
            + f"  fix: {_OTHER_DIRECTORY}, or build the {name} the checkpoint was written for; "
            + _START_OVER
        ) from None


_OTHER_DIRECTORY = "give this job another checkpoint.dir (--set checkpoint.dir=DIR)"
_START_OVER = "checkpoint.resume: false starts over, in a directory without checkpoints"


def _model_text(task: str, model: Any) -> str:
    return f"model {model} (task {task})" if model is not None else f"task {task}"


def _state_mismatch(module: nn.Module, saved: Any) -> str:
    """A few of the keys that differ between ``module``'s state and ``saved``, and how many there are."""
    expected = module.state_dict()
    saved = saved if isinstance(saved, dict) else {}
    resized = [
        f"{key} {list(saved[key].shape)} vs {list(value.shape)}"
        for key, value in expected.items()
        if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape)
    ]
    kinds = (
        ("missing from the checkpoint", [key for key in expected if key not in saved]),
        ("only in the checkpoint", [key for key in saved if key not in expected]),
        ("of another shape (checkpoint vs model)", resized),
    )
    return "; ".join(
        f"{len(keys)} key(s) {label}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}" for label, keys in kinds if keys
    )


def _spec_changes(saved: dict[str, Any], current: dict[str, Any], shown: int = 3) -> str:
    """``task.options.model: small_cnn (this job: resnet18)``, for the spec keys that shape a model."""
    before = {key: value for key, value in flatten(saved).items() if key == "entry" or key.startswith("task.")}
    after = {key: value for key, value in flatten(current).items() if key == "entry" or key.startswith("task.")}
    changed = [key for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
    return ", ".join(f"{key}: {before.get(key, '(unset)')} (this job: {after.get(key, '(unset)')})" for key in changed[:shown])


def find_resume_point(spec: JobSpec) -> Checkpoint | None:
    """The latest checkpoint in checkpoint.dir, unless resume is off (then the directory must hold none:
    pruning would otherwise delete the new run's checkpoints in favour of the old run's later steps)."""
    if spec.checkpoint.resume:
        return load_latest(spec.checkpoint.dir)
    if list_checkpoints(spec.checkpoint.dir):
        raise UserError(
            f"checkpoint.dir {spec.checkpoint.dir} holds checkpoints of an earlier run and checkpoint.resume is false\n"
            "  fix: use a new checkpoint.dir, delete the old checkpoints, or set checkpoint.resume: true"
        )
    return None


def pinned_data(data_spec: DataSpec, resumed: Checkpoint | None) -> DataSpec:
    """A resumed job reads the rows its checkpoint was trained on: the same dataset version (the
    one its tag named at the first start), the same filter, the same mix sources' versions."""
    if resumed is None:
        return data_spec
    version = resumed.state["dataset_version"]
    pinned = resumed.state.get("data_pinned") or {}
    start_over = "start over with checkpoint.resume: false and a new checkpoint.dir"
    if data_spec.version is not None and data_spec.version != version:
        raise UserError(
            f"data.version is {data_spec.version} but the checkpoint was trained on version {version}\n"
            f"  fix: remove data.version to resume, or {start_over}"
        )
    if "filter" in pinned and pinned["filter"] != data_spec.filter:
        raise UserError(
            f"data.filter is {data_spec.filter!r} but the checkpoint was trained on the rows of {pinned['filter']!r}\n"
            f"  fix: set data.filter back to resume, or {start_over}"
        )
    if pinned.get("sources"):
        return data_spec.model_copy(update={"mix": pinned_mix(data_spec, pinned["sources"], start_over)})
    if version is None:
        return data_spec
    if data_spec.tag is not None:
        log.info(
            "resuming on version %s of %s, which data.tag %r named at the first start", version, data_spec.uri, data_spec.tag
        )
    return data_spec.model_copy(update={"version": version, "tag": None})


def restore_rank(resumed: Checkpoint, env: DistEnv, seed: int) -> None:
    """This rank's RNG states.

    At the world size that wrote the checkpoint, each rank gets back its own. At another, the
    saved RNG states belong to ranks that no longer exist (or are missing for new ones): every
    rank reseeds from (seed, step, rank) instead (its loader continues from the position all ranks
    shared, see :meth:`Checkpoint.loader_position`, splitting the rest of the epoch over the new ranks).
    """
    if resumed.world_size == env.world_size:
        restore_rng(resumed.rank_state(env.rank)["rng"])
    else:
        reseed(seed, resumed.step, env.rank)


def saved_position(resumed: Checkpoint, env: DistEnv) -> dict[str, Any]:
    """The per-rank state this rank continues from: its own at the same world size, else rank 0's
    (every rank saved the same data position; only RNG states differ, and those are not reused)."""
    return resumed.rank_state(env.rank if resumed.world_size == env.world_size else 0)


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every generator of this process from (seed, step, rank): deterministic, distinct per rank."""
    value = int(np.random.SeedSequence([seed % 2**32, step, rank]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def resume_message(resumed: Checkpoint, progress: float, world_size: int, batch_size: int, grad_accum: int) -> str:
    """What a resumed job continues from; at a new world size, what changed and what did not."""
    where = f"epoch {resumed.epoch + 1}" + (f" ({progress - int(progress):.0%} read)" if resumed.state["mid_epoch"] else "")
    text = f"resuming from {resumed.path} at step {resumed.step}, {where}"
    pinned = pinned_text(resumed.state.get("data_pinned") or {})
    if pinned:
        text += f"\n  pinned at the first start: {pinned}"
    if resumed.world_size != world_size:
        before = resumed.state.get("spec", {}).get("data", {}).get("batch_size", batch_size)
        text += (
            f"\n  written by {resumed.world_size} ranks, continued by {world_size}: the per-rank batch stays "
            f"{batch_size} (was {before}), so the global batch is now {batch_size * world_size * grad_accum}"
            + "; epochs are counted in samples"
            + (
                "; the rest of the interrupted epoch is split over the new ranks, no row read twice"
                if resumed.state["mid_epoch"]
                else ""
            )
        )
    return text


def pinned_text(pinned: dict[str, Any]) -> str:
    """The data a checkpoint pinned, in a few words: each source's version, tag and filter."""

    def one(source: dict[str, Any]) -> str:
        text = f"{source.get('uri')} version {source.get('version')}"
        if source.get("tag"):
            text += f" (tag {source['tag']!r})"
        if source.get("filter"):
            text += f", rows where {source['filter']}"
        if source.get("weight") is not None:
            text += f", weight {source['weight']:g}"
        return text

    sources = pinned.get("sources") or ([pinned] if pinned.get("uri") else [])
    return "; ".join(one(source) for source in sources)


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states, in types torch.load(weights_only=True) reads."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_key = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_key}},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    numpy_state = states["numpy"]
    np.random.set_state(
        {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].numpy().astype(np.uint32)}}
    )
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
