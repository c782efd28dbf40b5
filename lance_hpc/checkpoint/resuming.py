"""Resuming: the newest checkpoint that loads, what it holds, and the checks that it belongs to this
job (the same task and model, objects that fit), with the message a resumed job prints."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from lance_hpc.checkpoint.manifests import checkpoint_names, checkpoint_steps
from lance_hpc.checkpoint.rng_states import reseed, restore_rng
from lance_hpc.checkpoint.saving import RankPlace, list_checkpoints
from lance_hpc.checkpoint.shards.names import plain_name
from lance_hpc.checkpoint.stores import Location, Store, open_store
from lance_hpc.errors import UserError
from lance_hpc.lineage.checkpoints import source_text
from lance_hpc.spec import JobSpec
from lance_hpc.spec.flat import flatten

# What the built-in trainer kept at the top of a checkpoint before lance_hpc.checkpoint.saving.FORMAT 2.
EARLIER_TRAINER_OBJECTS = ("model", "optimizer")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: what rank 0 saved, plus every rank's own part in ``state["ranks"]``.

    One layout (:data:`FORMAT`): ``objects`` maps each registered name to its ``state_dict`` and each
    rank's part maps loader names to their positions (``loaders``). Checkpoints of the earlier built-in
    trainer, with ``model`` and ``optimizer`` at the top and one ``loader`` per rank, read the same way."""

    path: Location  # a Path, or an s3:// URI
    state: dict[str, Any]
    store: Store  # the checkpoint.dir it was read from, which holds its shards

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def epoch(self) -> int:
        """The epoch being read when it was written (the next one, at an epoch end)."""
        return int(self.state["epoch"])

    @property
    def shards(self) -> str | None:
        """The name of its model and optimizer shards beside it (a sharded checkpoint); None for one
        file. A name that is not a plain one in its directory is refused (the file may come from anyone)."""
        name = self.state.get("shards")
        return None if name is None else plain_name(name, str(self.path))

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

    def loader_position(self, name: str, env: RankPlace) -> dict[str, Any] | None:
        """Where the loader registered as ``name`` stopped, for this rank (None at an epoch boundary)."""
        saved = saved_position(self, env)
        loaders = saved.get("loaders")
        if loaders is None and saved.get("loader") is not None:  # the earlier built-in trainer's one loader
            loaders = {"loader": saved["loader"]}
        return (loaders or {}).get(name)


def load_step(store: Store, step: int) -> Checkpoint:
    """The checkpoint of ``step`` in ``store``; a UserError listing the steps there when it has none."""
    steps = checkpoint_steps(store.names())
    if step not in steps:
        kept = ", ".join(str(kept) for kept in steps) or "none"
        raise UserError(f"{store.where} holds no checkpoint of step {step} (it has: {kept})")
    return Checkpoint(store.location(steps[step]), store.read(steps[step]), store)


def load_latest(store: Store) -> Checkpoint | None:
    """The newest checkpoint in ``store`` that loads; None when there is none."""
    for name in reversed(checkpoint_names(store.names())):
        path = store.location(name)
        try:
            return Checkpoint(path, store.read(name), store)
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
    store = open_store(spec.checkpoint.dir)
    if spec.checkpoint.resume:
        return load_latest(store)
    if list_checkpoints(store):
        raise UserError(
            f"checkpoint.dir {spec.checkpoint.dir} holds checkpoints of an earlier run and checkpoint.resume is false\n"
            "  fix: use a new checkpoint.dir, delete the old checkpoints, or set checkpoint.resume: true"
        )
    return None


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
    sources = pinned.get("sources") or ([pinned] if pinned.get("uri") else [])
    return "; ".join(source_text(source) for source in sources)


def restore_rank(resumed: Checkpoint, env: RankPlace, seed: int) -> None:
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


def saved_position(resumed: Checkpoint, env: RankPlace) -> dict[str, Any]:
    """The per-rank state this rank continues from: its own at the same world size, else rank 0's
    (every rank saved the same data position; only RNG states differ, and those are not reused)."""
    return resumed.rank_state(env.rank if resumed.world_size == env.world_size else 0)
