"""What a checkpoint directory holds, known without loading a checkpoint.

A checkpoint ``step-XXXXXXXX.pt`` carries its step in its name, and a small JSON manifest beside it,
``step-XXXXXXXX.json``, says the rest: epoch, progress, world size, dataset version, when it was
written and its lineage (the data it was trained on, the spec: :mod:`lance_hpc.lineage.checkpoints`).
The manifest is written (atomically) once its checkpoint is complete and pruned with it, so
``lance-hpc status``, ``cancel`` and ``lineage`` list a directory and read a few hundred bytes on a
login node, where loading the newest checkpoint would read, or download, all of it.

A checkpoint directory may be shared, so a manifest is read as a file anyone may have put there:
at most :data:`MANIFEST_BYTES`, only a regular file, and its fields checked against their shape
(:data:`MANIFEST_SHAPE`) before any is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from lance_hpc.checkpoint.stores import SMALL_FILE_FIX, TEMP_SUFFIX, Store
from lance_hpc.errors import UserError
from lance_hpc.lineage.checkpoints import checkpoint_lineage
from lance_hpc.lineage.shapes import COUNT, FLAG, LINEAGE_SHAPE, NUMBER, TEXT, Fields, shape_problem

CHECKPOINT_PATTERN = re.compile(r"^step-(\d+)\.pt$")
MANIFEST_PATTERN = re.compile(r"^step-(\d+)\.json$")
# What the manifest copies from a checkpoint's state, when the state has it.
MANIFEST_FIELDS = ("step", "epoch", "progress", "mid_epoch", "world_size", "dataset_version")
# What :func:`manifest` writes, field by field.
MANIFEST_SHAPE = Fields(
    {
        "step": COUNT,
        "epoch": COUNT,
        "progress": NUMBER,
        "mid_epoch": FLAG,
        "world_size": COUNT,
        "dataset_version": COUNT,
        "saved_at": TEXT,
        "checkpoint": TEXT,
        "lineage": LINEAGE_SHAPE,
    },
    nullable=False,
)
# A manifest is a few hundred bytes (a mix of many sources a few kB): a larger file is not one.
MANIFEST_BYTES = 1 << 20


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


def checkpoint_steps(names: list[str]) -> dict[int, str]:
    """Step -> checkpoint name, for the checkpoints among ``names``, oldest first."""
    found = sorted((int(match.group(1)), name) for name in names if (match := CHECKPOINT_PATTERN.match(name)))
    return dict(found)


def checkpoint_names(names: list[str]) -> list[str]:
    """The checkpoint names among ``names``, oldest first."""
    return list(checkpoint_steps(names).values())


def manifest(state: Mapping[str, Any], world_size: int) -> bytes:
    """The manifest of a checkpoint of ``state``, written by ``world_size`` ranks."""
    fields = {key: state[key] for key in MANIFEST_FIELDS if key in state}
    if isinstance(state.get("spec"), Mapping):  # what it was trained on, read without loading it
        fields["lineage"] = checkpoint_lineage(state["spec"], state.get("data_pinned"))
    fields.update(
        world_size=world_size,
        saved_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        checkpoint=checkpoint_name(int(state["step"])),
    )
    return (json.dumps(fields, indent=1) + "\n").encode()


def leftovers(names: list[str]) -> list[str]:
    """Files a save cut short left behind: temporary files, and manifests whose checkpoint is gone."""
    steps = checkpoint_steps(names)
    temporary = [name for name in names if name.startswith(".step-") and name.endswith(TEMP_SUFFIX)]
    orphans = [name for name in names if (match := MANIFEST_PATTERN.match(name)) and int(match.group(1)) not in steps]
    return temporary + orphans


@dataclass(frozen=True)
class Saved:
    """The newest checkpoint of a directory as its name and manifest describe it; ``epoch`` and
    ``saved_at`` are None without a manifest (one written before manifests, or a save cut short).
    ``epoch`` is the epoch its step read, counted from 1 as the progress bar counts them (the
    manifest's ``epoch`` is the epoch being read, from 0: the count of epochs finished)."""

    step: int
    location: str
    epoch: int | None = None
    world_size: int | None = None
    saved_at: str | None = None


def latest(store: Store) -> Saved | None:
    """The newest checkpoint in ``store`` (local or object storage), from its name and manifest;
    None when there is none. Nothing is loaded: a damaged checkpoint is still reported by its name."""
    names = store.names()
    steps = checkpoint_steps(names)
    if not steps:
        return None
    step, name = max(steps.items())
    fields = read_manifest(store, step) if manifest_name(step) in names else {}
    epoch, world_size = fields.get("epoch"), fields.get("world_size")
    return Saved(
        step,
        str(store.location(name)),
        epoch + 1 if isinstance(epoch, int) and fields.get("mid_epoch") is True else epoch if isinstance(epoch, int) else None,
        int(world_size) if isinstance(world_size, int) else None,
        fields.get("saved_at"),
    )


def read_manifest(store: Store, step: int) -> dict[str, Any]:
    """The manifest of ``step``'s checkpoint; empty when it is gone or cannot be parsed (the name
    still gives the step). A UserError naming it when it is not a regular file, is larger than
    MANIFEST_BYTES or has a field of the wrong type: not a manifest lance_hpc wrote."""
    name = manifest_name(step)
    try:
        fields = json.loads(store.read_bytes(name, MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    problem = shape_problem(fields, MANIFEST_SHAPE)
    if problem:
        raise UserError(f"{store.location(name)}: {problem}, so it is not a manifest lance_hpc wrote\n  fix: {SMALL_FILE_FIX}")
    return fields
