"""Sweeps: one spec, one run per combination of the values in its ``sweep`` section (or ``--sweep``).

The runs become one SLURM job array. Each run is a complete spec of its own: the sweep's spec with
the run's values set, a name with those values as a suffix (``lr-sweep-lr0.05-batch_size64``), and
checkpoint and TensorBoard directories below the sweep's own, so ``tensorboard --logdir`` on the
sweep's directory compares the runs in the HParams tab. The fields a sweep may not vary (name,
resources, the directories it derives) are refused with the reason.
"""

from __future__ import annotations

import difflib
import itertools
import re
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import yaml
from pydantic import BaseModel

from lance_hpc.spec.problems import Problem
from lance_hpc.spec.schema import JobSpec
from lance_hpc.spec.yaml_text import parse_value

# SLURM's default MaxArraySize is 1001, so array indices run from 0 to 1000.
MAX_RUNS = 1001
# A suffix longer than this, or one that two runs share, gives way to the run's index.
MAX_SUFFIX = 60
# Spec paths a sweep may not vary: path -> (why, fix).
FIXED = {
    "name": ("each run is named after the sweep and its own values", "rename the sweep itself with name: ..."),
    "sweep": ("a sweep cannot sweep itself", "list every swept field directly under sweep:"),
    "slurm": (
        "the runs of an array share one sbatch script, so they share its resources",
        "sweep over train, data, task, checkpoint or logging fields; submit a second job for other resources",
    ),
    "checkpoint.dir": ("each run checkpoints in its own subdirectory of checkpoint.dir", "set checkpoint.dir once for the sweep"),
    "logging.tensorboard_dir": (
        "each run logs to its own subdirectory of logging.tensorboard_dir",
        "set logging.tensorboard_dir once for the sweep",
    ),
}
NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its array index, the values it sets, and its complete spec."""

    index: int
    values: dict[str, Any]
    spec: JobSpec

    def describe(self) -> str:
        return " ".join(f"{key}={_text(value)}" for key, value in self.values.items())


def parse_sweep_option(item: str) -> tuple[str, list[Any]] | Problem:
    """``KEY=V1,V2,...`` (each value read as YAML), or ``KEY=[...]`` for values with commas."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or not text.strip():
        return Problem(f"--sweep {item}", "is not KEY=VALUE,VALUE,...", "write e.g. --sweep train.lr=0.1,0.05")
    parts = [text] if text.strip().startswith("[") else text.split(",")
    parsed = [parse_value(part, f"--sweep {item}") for part in parts]
    problems = [problem for _, found in parsed for problem in found]
    if problems:
        return Problem(
            problems[0].path, problems[0].message, problems[0].fix or "write e.g. --sweep 'task.options.hidden=[32, 64]'"
        )
    values = [value for value, _ in parsed]
    return key, values[0] if text.strip().startswith("[") else values


def merge_sweep_options(raw: dict[str, Any], options: Sequence[str]) -> list[Problem]:
    """Add ``--sweep`` options to ``raw``'s sweep section; one for a key already there replaces it."""
    problems = []
    for item in options:
        parsed = parse_sweep_option(item)
        if isinstance(parsed, Problem):
            problems.append(parsed)
            continue
        if not isinstance(raw.get("sweep"), dict):
            raw["sweep"] = {}
        key, values = parsed
        raw["sweep"][key] = values
    return problems


def sweep_problems(raw: dict[str, Any]) -> list[Problem]:
    """What is wrong with the sweep section's shape, keys and value lists (each run's values are
    checked against the schema by :func:`expand`)."""
    sweep = raw.get("sweep")
    if sweep is None:
        return []
    if not isinstance(sweep, dict):
        return [Problem("sweep", "must map spec fields to lists of values", "write e.g. sweep: {train.lr: [0.1, 0.05]}")]
    problems = []
    for key, values in sweep.items():
        key = str(key)
        problem = _key_problem(key)
        if problem:
            problems.append(problem)
        elif not isinstance(values, list) or not values:
            problems.append(
                Problem(f"sweep.{key}", f"expected a list of values, got {values!r}", f"write e.g. {key}: [{_text(values)}, ...]")
            )
        else:
            seen = [yaml.safe_dump(value) for value in values]
            twice = sorted({_text(value) for value, dump in zip(values, seen) if seen.count(dump) > 1})
            if twice:
                problems.append(
                    Problem(
                        f"sweep.{key}", f"{', '.join(twice)} listed twice: two runs would be the same", "list each value once"
                    )
                )
    count = 1
    for values in sweep.values():
        count *= len(values) if isinstance(values, list) else 1
    if count > MAX_RUNS:
        problems.append(
            Problem(
                "sweep",
                f"{count} runs are more than a SLURM job array holds by default ({MAX_RUNS})",
                "sweep fewer values, or split the sweep into several specs",
            )
        )
    return problems


def combinations(sweep: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the values, the first key's values varying slowest."""
    keys = list(sweep)
    return [dict(zip(keys, values)) for values in itertools.product(*(sweep[key] for key in keys))]


def run_count(spec: JobSpec) -> int:
    return len(combinations(spec.sweep))


def run_drafts(spec: JobSpec) -> list[tuple[int, dict[str, Any], str, dict[str, Any]]]:
    """Each run of a sweep spec before validation: (index, swept values, run name, raw spec), the
    run's checkpoint and TensorBoard directories under the sweep's, named after the run."""
    chosen = combinations(spec.sweep)
    drafts = []
    for index, (values, name) in enumerate(zip(chosen, _run_names(spec.name, chosen))):
        raw = spec.to_dict()
        raw["sweep"] = {}
        raw["name"] = name
        raw["checkpoint"]["dir"] = f"{spec.checkpoint.dir.rstrip('/')}/{name}"
        raw["logging"]["tensorboard_dir"] = f"{spec.logging.tensorboard_dir.rstrip('/')}/{name}"
        raw["logging"]["group"] = spec.logging.group or spec.name  # the trackers show a sweep's runs together
        for key, value in values.items():
            _set(raw, key, value)
        drafts.append((index, values, name, raw))
    return drafts


def _key_problem(key: str) -> Problem | None:
    parts = key.split(".")
    for fixed, (why, fix) in FIXED.items():
        if key == fixed or key.startswith(f"{fixed}.") or (fixed == "slurm" and parts[0] == "slurm"):
            return Problem(f"sweep.{key}", f"cannot be swept: {why}", fix)
    model: type[BaseModel] = JobSpec
    for depth, part in enumerate(parts):
        if part not in model.model_fields:
            valid = sorted(name for name in model.model_fields if name not in FIXED)
            close = difflib.get_close_matches(part, valid, n=1, cutoff=0.5)
            hint = f"did you mean '{'.'.join([*parts[:depth], close[0], *parts[depth + 1 :]])}'? " if close else ""
            where = f" in {'.'.join(parts[:depth])}" if depth else ""
            return Problem(
                f"sweep.{key}", f"'{key}' is not a field of the job spec", f"{hint}valid keys{where}: {', '.join(valid)}"
            )
        annotation = model.model_fields[part].annotation
        section = _section_model(annotation)
        last = depth == len(parts) - 1
        if section is None:
            if last or _is_mapping(annotation):
                return None  # a field, or a key inside a mapping (task.options.x), checked with each run
            field = ".".join(parts[: depth + 1])
            return Problem(f"sweep.{key}", f"'{field}' is a value, not a section", f"sweep over {field} itself")
        if last:
            example = next(iter(section.model_fields))
            return Problem(
                f"sweep.{key}", f"'{key}' is a whole section; a sweep varies fields", f"name a field, e.g. {key}.{example}"
            )
        model = section
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    candidates = typing.get_args(annotation) or (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    *sections, field = key.split(".")
    node = raw
    for part in sections:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[field] = value


def _text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _run_names(base: str, chosen: list[dict[str, Any]]) -> list[str]:
    """``base-lr0.05-batch_size64`` per run, or ``base-00``.. when such suffixes are long or clash."""
    suffixes = [
        "-".join(NOT_IN_NAME.sub("_", f"{key.rsplit('.', 1)[-1]}{_text(value)}") for key, value in values.items())
        for values in chosen
    ]
    if len(set(suffixes)) < len(suffixes) or any(len(suffix) > MAX_SUFFIX for suffix in suffixes):
        width = len(str(len(chosen) - 1))
        suffixes = [f"{index:0{width}d}" for index in range(len(chosen))]
    return [f"{base}-{suffix}" for suffix in suffixes]


def blame(problem: Problem, values: Mapping[str, Any], name: str) -> Problem:
    """A problem of one run, told against the swept value that caused it when there is one."""
    for key, value in values.items():
        if problem.path == key or problem.path.startswith(f"{key}.") or key.startswith(f"{problem.path}."):
            return Problem(f"sweep.{key}", f"value {_text(value)}: {problem.message}", problem.fix)
    return Problem("sweep", f"run {name}: {problem.path}: {problem.message}", problem.fix)
