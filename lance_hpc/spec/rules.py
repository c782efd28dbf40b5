"""Rules that span fields of a spec, and keys that moved; the job kind, task and entry a spec names
are checked in :mod:`~lance_hpc.spec.named_code`, and what each kind needs of a spec by the kind
itself (:mod:`~lance_hpc.spec.kinds`).

They read the raw mapping, so they run (and report) even when other fields are wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from lance_hpc.spec.choices import SAMPLERS, STYLES
from lance_hpc.spec.problems import Problem, section_of
from lance_hpc.spec.restarts import restart_problems
from lance_hpc.spec.schema import SlurmSpec, TrainSpec, parse_time_limit
from lance_hpc.storage.options import unsupported

# Keys that moved into task.options when tasks became pluggable: old path -> new key.
MOVED = {
    ("model", "arch"): "model",
    ("model", "num_classes"): "num_classes",
    ("model", "channels_last"): "channels_last",
    ("data", "image_column"): "image_column",
    ("data", "label_column"): "label_column",
    ("data", "image_size"): "image_size",
    ("data", "augment"): "augment",
}


def moved_key_problems(raw: dict[str, Any]) -> list[Problem]:
    """Take the keys that moved out of ``raw`` (so they are not reported twice as unknown), and
    say where each went."""
    problems = []
    for (section, key), new_key in MOVED.items():
        node = raw.get(section)
        if isinstance(node, dict) and key in node:
            value = node.pop(key)
            problems.append(
                Problem(
                    f"{section}.{key}",
                    f"moved to task.options.{new_key}",
                    f"write it under task: {{name: image_classification, options: {{{new_key}: {value}}}}}",
                )
            )
    if isinstance(raw.get("model"), dict):
        leftover = raw.pop("model")
        if leftover:
            problems.append(
                Problem(
                    "model",
                    "the model section moved into task.options",
                    "set the model with task.options.model (image_classification)",
                )
            )
    return problems


def cross_field_problems(raw: Mapping[str, Any]) -> list[Problem]:
    """Rules that span fields; read from the raw mapping so they run even when fields are wrong."""
    problems = []
    data = section_of(raw, "data")
    slurm = section_of(raw, "slurm")
    style = data.get("style", "map")
    sampler = data.get("sampler", "distributed" if style == "map" else "sharded_batch")
    if style == "iterable" and "sampler" not in data:
        sampler = None  # validated below with an explicit message
        problems.append(Problem("data.sampler", "iterable style needs a sampler", "use one of: sharded_batch, sharded_fragment"))
    if style in STYLES and sampler in SAMPLERS and sampler not in STYLES[style]:
        valid = ", ".join(STYLES[style])
        problems.append(
            Problem(
                "data.sampler", f"sampler '{sampler}' does not work with style '{style}'", f"with style '{style}' use: {valid}"
            )
        )
    if sampler == "full_scan":
        problems.append(
            Problem(
                "data.sampler",
                "full_scan gives every rank every row, so all ranks would train on the same data",
                "train with sharded_batch or sharded_fragment; full_scan is for evaluation (data.val_sampler: full_scan)",
            )
        )
    time_value = slurm.get("time", SlurmSpec.model_fields["time"].default)
    try:
        limit = parse_time_limit(str(time_value))
    except ValueError:
        problems.append(
            Problem("slurm.time", f"{time_value!r} is not a SLURM time limit", "use MM, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00")
        )
    else:
        delay = slurm.get("signal_delay_s", SlurmSpec.model_fields["signal_delay_s"].default)
        if limit <= 0:
            problems.append(Problem("slurm.time", "time limit must be positive", "e.g. 01:00:00"))
        elif isinstance(delay, int) and delay >= limit:
            problems.append(
                Problem(
                    "slurm.signal_delay_s",
                    f"{delay}s is not shorter than the time limit ({limit}s)",
                    "lower it or raise slurm.time",
                )
            )
    gpus, tasks = slurm.get("gpus_per_node", 0), slurm.get("tasks_per_node")
    if isinstance(gpus, int) and isinstance(tasks, int) and gpus > 0 and tasks != gpus:
        problems.append(
            Problem(
                "slurm.tasks_per_node",
                f"{tasks} tasks per node with {gpus} GPUs per node: DDP runs one task per GPU",
                f"set tasks_per_node: {gpus} or remove it",
            )
        )
    problems += restart_problems(slurm)
    template = slurm.get("template")
    if isinstance(template, str) and not Path(template).is_file():
        problems.append(Problem("slurm.template", f"template file {template} does not exist", "fix the path or remove the key"))
    checkpoint = section_of(raw, "checkpoint")
    if isinstance(checkpoint.get("dir"), str):
        problem = unsupported(checkpoint["dir"])
        if problem:
            message, _, fix = problem.partition("\n  fix: ")
            problems.append(Problem("checkpoint.dir", message, fix))
    problems += io_timeout_problems(data, section_of(raw, "train"))
    problems += sharding_problems(section_of(raw, "train"), checkpoint)
    return problems


# What only a sharded model does: train.<key> (or checkpoint.<key>) needs train.parallelism: fsdp.
FSDP_ONLY = {
    "train.activation_checkpointing": "recomputes the blocks that fsdp wraps",
    "train.compile": "compiles the blocks that fsdp wraps",
    "train.cpu_offload": "offloads the shards that fsdp keeps",
    "checkpoint.async_save": "writes the shards of a sharded checkpoint in the background",
}


def sharding_problems(train: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> list[Problem]:
    """Settings of a sharded model asked for under ddp: refused rather than silently ignored."""
    if train.get("parallelism", "ddp") == "fsdp":
        return []
    sections = {"train": train, "checkpoint": checkpoint}
    return [
        Problem(path, f"is true, but train.parallelism is ddp: it {what}", "set train.parallelism: fsdp, or remove the key")
        for path, what in FSDP_ONLY.items()
        if sections[path.split(".")[0]].get(path.split(".")[1]) is True
    ]


# Seconds between a read giving up and its rank leaving: the last attempt, decoding, the step.
IO_TIMEOUT_MARGIN_S = 30


def io_timeout_problems(data: Mapping[str, Any], train: Mapping[str, Any]) -> list[Problem]:
    """A data.io_timeout_s the user set must end before the collective timeout: ranks that already
    have their batch wait in a collective for a rank still retrying its read, and would otherwise
    fail first, with "lost contact" instead of the store's own message."""
    io_timeout = data.get("io_timeout_s")
    collective = train.get("collective_timeout_s", TrainSpec.model_fields["collective_timeout_s"].default)
    if not isinstance(io_timeout, (int, float)) or not isinstance(collective, (int, float)):
        return []
    if io_timeout + IO_TIMEOUT_MARGIN_S <= collective:
        return []
    return [
        Problem(
            "data.io_timeout_s",
            f"{io_timeout:g} s leaves less than {IO_TIMEOUT_MARGIN_S} s before train.collective_timeout_s ({collective:g} s): "
            "ranks waiting in a collective for a rank still retrying a read would time out first",
            f"lower data.io_timeout_s to {collective - IO_TIMEOUT_MARGIN_S:g} or raise train.collective_timeout_s to "
            f"{io_timeout + IO_TIMEOUT_MARGIN_S:g}",
        )
    ]
