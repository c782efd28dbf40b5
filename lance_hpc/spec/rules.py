"""Rules that span fields of a spec, and keys that moved; the job kind, task and entry a spec names
are checked in :mod:`~lance_hpc.spec.named_code`.

They read the raw mapping, so they run (and report) even when other fields are wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from lance_hpc.spec.choices import SAMPLERS, SHARD_FORMATS, STDLIB_SOURCE, STYLES
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
    if raw.get("command") is None:  # a command job's infer section is refused with its other sections
        problems += infer_problems(raw)
    if raw.get("job") == "ingest":
        ingest = data.get("ingest")
        source = ingest.get("source") if isinstance(ingest, Mapping) else None
        if not isinstance(source, str) or (
            source.split(":", 1)[0] not in SHARD_FORMATS and source.partition(":")[0] != STDLIB_SOURCE
        ):
            problems.append(
                Problem(
                    "data.ingest.source",
                    f"job: ingest splits its source into shards between the ranks, which {source!r} is not",
                    "use parquet:<glob>, jsonl:<glob>, webdataset:<glob>, hf:<dir>, imagefolder:<dir>, text:<glob> or "
                    f"{STDLIB_SOURCE}; "
                    "other sources are ingested by a training job's start or by lance-hpc ingest",
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


def infer_problems(raw: Mapping[str, Any]) -> list[Problem]:
    """job: infer and job: evaluate need an infer section naming a model (and, to infer, columns);
    other jobs do not read one."""
    job, infer = raw.get("job", "train"), raw.get("infer")
    if job not in ("infer", "evaluate", "map"):
        if infer is not None:
            return [Problem("infer", f"job: {job} does not read it", "set job: infer, evaluate or map, or remove the section")]
        return []
    if not isinstance(infer, Mapping):
        example = "{checkpoint: checkpoints/<training job>, outputs: {embedding: float16, predicted: int64}}"
        if job == "map":
            example = "{function: my_pkg.features:sizes, columns: [image], outputs: {width: int32}}"
        return [Problem("infer", f"job: {job} needs an infer section", f"add infer: {example}")]
    if job == "map":
        return map_problems(infer)
    problems = []
    if infer.get("columns"):
        problems.append(
            Problem("infer.columns", f"job: {job} reads the columns its task names", "remove the key (job: map reads it)")
        )
    if not infer.get("checkpoint") and not infer.get("function"):
        problems.append(
            Problem(
                "infer.checkpoint",
                "no model to run",
                "name a training job's checkpoint.dir (its latest checkpoint is read), or infer.function",
            )
        )
    if job == "infer" and not infer.get("outputs"):
        problems.append(
            Problem(
                "infer.outputs",
                "job: infer writes no column",
                "name the new columns and their types, e.g. {embedding: float16, predicted: int64}; job: evaluate reports "
                "metrics without writing",
            )
        )
    if job == "evaluate" and infer.get("outputs"):
        problems.append(Problem("infer.outputs", "job: evaluate writes no column", "use job: infer to write them"))
    if job == "evaluate" and infer.get("refresh"):
        problems.append(
            Problem("infer.refresh", "job: evaluate writes no column to refresh", "use job: infer, or remove the key")
        )
    if job == "evaluate" and not infer.get("checkpoint"):
        problems.append(Problem("infer.checkpoint", "job: evaluate needs a checkpoint", "name a training job's checkpoint.dir"))
    outputs = infer.get("outputs")
    if job == "infer" and isinstance(outputs, Mapping):
        problems += output_name_problems([str(name) for name in outputs], infer.get("filter"))
    return problems


def map_problems(infer: Mapping[str, Any]) -> list[Problem]:
    """job: map runs a function and no model: it needs the function and the columns it writes."""
    problems = []
    if not infer.get("function"):
        problems.append(Problem("infer.function", "job: map has no function to run", "name it, e.g. my_pkg.features:sizes"))
    if infer.get("checkpoint"):
        problems.append(
            Problem("infer.checkpoint", "job: map runs no model", "use job: infer to run a checkpoint, or remove the key")
        )
    outputs = infer.get("outputs")
    if not outputs:
        problems.append(
            Problem("infer.outputs", "job: map writes no column", "name the new columns and their types, e.g. {width: int32}")
        )
    elif isinstance(outputs, Mapping):
        problems += output_name_problems([str(name) for name in outputs], infer.get("filter"))
        columns = infer.get("columns") or []
        clash = [name for name in outputs if name in columns]
        if clash:
            problems.append(
                Problem(
                    "infer.outputs",
                    f"{', '.join(clash)} is a column the function reads (infer.columns): the job would replace its own input",
                    f"write the output under another name, e.g. {clash[0]}_mapped",
                )
            )
    return problems


# Columns Lance computes for a scan (a stored column of such a name breaks every later scan); every
# name beginning with "_" is left to Lance, which adds such names over time.
LANCE_RESERVED = (
    "_rowid",
    "_rowaddr",
    "_rowoffset",
    "_row_created_at_version",
    "_row_last_updated_at_version",
    "_distance",
    "_score",
)


def output_name_problems(outputs: list[str], filter: Any) -> list[Problem]:
    """An output named like a column Lance computes (or any name beginning with "_"), and a filter
    that names an output: it would choose rows by the values the job writes."""
    problems = []
    for name in outputs:
        if name.startswith("_"):
            why = (
                "Lance computes a column of this name for its scans"
                if name.lower() in LANCE_RESERVED
                else ("names beginning with _ are Lance's own (" + ", ".join(LANCE_RESERVED[:3]) + ", ...)")
            )
            problems.append(
                Problem(
                    f"infer.outputs.{name}",
                    f"{why}: a stored column of that name breaks every scan of the dataset",
                    f"name the output without the leading _, e.g. {name.lstrip('_') or 'output'}",
                )
            )
    named = filter_columns(filter) if isinstance(filter, str) else set()
    written = sorted(name for name in outputs if name.lower() in named)
    if written:
        problems.append(
            Problem(
                "infer.filter",
                f"names {', '.join(written)}, which this job writes (infer.outputs): it would choose the rows by the values "
                "the job replaces",
                "filter on columns the job does not write, or write the outputs under other names",
            )
        )
    return problems


def filter_columns(filter: str) -> set[str]:
    """The identifiers a SQL predicate names, lower-cased: bare words and quoted (\"x\", `x`) names
    outside string literals. Keywords and functions are among them, which only matters for an
    output named like one."""
    without_strings = re.sub(r"'(?:[^']|'')*'", " ", filter)
    quoted = re.findall(r'"((?:[^"]|"")*)"|`([^`]*)`', without_strings)
    bare = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r'"(?:[^"]|"")*"|`[^`]*`', " ", without_strings))
    return {name.lower() for name in bare} | {(double or back).lower() for double, back in quoted}


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
