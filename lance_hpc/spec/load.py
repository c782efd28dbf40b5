"""Loading a spec: YAML (duplicate keys, self-containing anchors and alias bombs refused, see
:mod:`~lance_hpc.spec.yaml_text`), ``--set`` overrides, placeholders and relative paths resolved
once, then validation that reports every problem.

Placeholders such as ``{name}`` in path fields are resolved at load time, and the resolutions are
kept on the spec so the command line can show them. A relative path, and the file of an import
path (``tasks/my_task.py:MyTask``), resolve against the base directory (by default the one
lance-hpc runs in).
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import ValidationError

from lance_hpc.errors import UserError
from lance_hpc.spec.choices import BARE_FORMATS, SHARD_FORMATS, source_format
from lance_hpc.spec.command_section import reference_problems
from lance_hpc.spec.kinds import job_problems, spec_kind
from lance_hpc.spec.problems import Problem, SpecError, from_pydantic, unique
from lance_hpc.spec.rules import cross_field_problems, moved_key_problems
from lance_hpc.spec.schema import CheckpointSpec, InferSpec, JobSpec, LoggingSpec, SlurmSpec
from lance_hpc.spec.secrets import secret_problems
from lance_hpc.spec.sweep import (
    SweepRun,
    blame,
    merge_sweep_options,
    run_drafts,
    sweep_problems,
)
from lance_hpc.spec.yaml_text import duplicate_keys, parse_value, parse_yaml

__all__ = [
    "LoadedSpec",
    "NotYourFile",
    "Resolution",
    "apply_overrides",
    "check_owned",
    "duplicate_keys",
    "load_spec",
    "load_spec_text",
    "read_own_text",
    "validate_spec",
]

# Fields whose string values may hold placeholders and name local paths (made absolute on load);
# section None is the top level.
PATH_FIELDS: tuple[tuple[str | None, str], ...] = (
    ("data", "uri"),
    ("data", "val_uri"),
    ("checkpoint", "dir"),
    ("logging", "tensorboard_dir"),
    ("slurm", "log_dir"),
    ("slurm", "template"),
    ("task", "name"),
    (None, "entry"),
    (None, "job"),
    ("infer", "checkpoint"),
    ("infer", "function"),
    ("infer", "metrics_file"),
)
# Of those, the ones holding import paths: only a file path before the colon is resolved.
IMPORT_PATH_FIELDS = (("task", "name"), (None, "entry"), (None, "job"), ("infer", "function"))


@dataclass(frozen=True)
class Resolution:
    """A placeholder or relative path that load_spec replaced, shown to the user."""

    path: str
    before: str
    after: str


@dataclass(frozen=True)
class LoadedSpec:
    spec: JobSpec
    resolutions: tuple[Resolution, ...]
    source: str


def _resolve_import_path(value: str, base_dir: Path) -> str:
    """``file.py:Name`` with the file made absolute; module paths and registered names as they are."""
    module, sep, name = value.rpartition(":")
    if not sep or not module.endswith(".py") or Path(module).is_absolute():
        return value
    return f"{(base_dir / module).resolve()}:{name}"


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> list[Problem]:
    """Apply ``section.key=value`` overrides in place; values are parsed as YAML scalars."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(Problem(f"--set {item}", "override is not KEY=VALUE", "write e.g. --set train.lr=0.05"))
            continue
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(Problem(key, f"cannot set inside '{part}', which is not a section"))
                break
            node = child
        else:
            parsed, value_problems = parse_value(value, f"--set {item}") if value.strip() else (None, [])
            problems += value_problems
            if not value_problems:
                node[parts[-1]] = parsed
    return problems


class NotYourFile(UserError):
    """A job file another user owns. A spec names the code a job imports and the paths it reads
    and writes, so lance_hpc neither runs nor replaces someone else's."""

    def __init__(self, path: str | Path, uid: int, reason: str, fix: str) -> None:
        self.path, self.uid, self.owner = Path(path), uid, owner_name(uid)
        super().__init__(f"{path} belongs to {self.owner}, not to you: {reason}\n  fix: {fix}")


# What the rank says when its spec belongs to someone else: whoever owns it chooses what runs.
RUN_REASON = "lance_hpc never runs code from a file another user owns (a spec names the task and entry the job imports)"
RUN_FIX = "submit your own spec (lance-hpc submit writes it into slurm.log_dir as yours) and run that"


def owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_owned(info: os.stat_result, path: str | Path, reason: str = RUN_REASON, fix: str = RUN_FIX) -> None:
    """Raise NotYourFile unless the caller owns the file ``info`` describes (a stat of ``path``)."""
    if info.st_uid != os.getuid():
        raise NotYourFile(path, info.st_uid, reason, fix)


def read_own_text(path: str | Path, follow_links: bool = True, reason: str = RUN_REASON, fix: str = RUN_FIX) -> str:
    """The text of the regular file at ``path``, read only if the caller owns it. Raises
    NotYourFile for another user's file, SpecError for a missing, unreadable or special one."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        descriptor = os.open(path, flags)  # O_NONBLOCK: a FIFO planted in its place cannot hang us
    except FileNotFoundError:
        raise SpecError(str(path), [Problem("", f"spec file {path} does not exist", "check the path")]) from None
    except OSError as error:
        raise SpecError(str(path), [Problem("", f"cannot read {path}: {error.strerror}")]) from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())  # of what was opened, not of what the path names a moment later
        check_owned(info, path, reason, fix)
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(str(path), [Problem("", f"{path} is not a regular file", "name the job's spec file")])
        return file.read().decode("utf-8", errors="replace")


def load_spec(
    path: str | Path,
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
    sweeps: Sequence[str] = (),
    *,
    imports: bool = True,
) -> LoadedSpec:
    """Read, override, resolve and validate a job spec; raises SpecError listing every problem.

    ``sweeps`` are ``--sweep KEY=V1,V2`` options, added to the spec's sweep section. With
    ``imports=False`` nothing the spec names is imported (see :func:`validate_spec`).
    """
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(source, [Problem("", f"spec file {source} does not exist", "check the path")]) from None
    except OSError as error:
        raise SpecError(source, [Problem("", f"cannot read {source}: {error.strerror}")]) from None
    return load_spec_text(text, source, overrides, base_dir, sweeps, imports=imports)


def load_spec_text(
    text: str,
    source: str = "<spec>",
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
    sweeps: Sequence[str] = (),
    *,
    imports: bool = True,
) -> LoadedSpec:
    """Like load_spec, from YAML text."""
    raw, problems = parse_yaml(text)
    if problems:
        raise SpecError(source, problems)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(source, [Problem("", "the spec must be a mapping of sections", "start with 'name: ...'")])
    return validate_spec(raw, source, overrides, base_dir, sweeps, imports=imports)


def validate_spec(
    raw: Mapping[str, Any],
    source: str = "<spec>",
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
    sweeps: Sequence[str] = (),
    *,
    imports: bool = True,
) -> LoadedSpec:
    """Validate a spec mapping (a deep copy is modified); raises SpecError listing every problem.

    A sweep's runs are validated too, once the spec they start from is valid. ``imports=True``
    imports task.name and entry to check them (and fills in the task's option defaults): that
    runs the code they name. ``imports=False`` checks only their form, for reading the spec of a
    job that may not be yours to run; lance_hpc's own modules are still imported.
    """
    copied: dict[str, Any] = yaml.safe_load(
        yaml.safe_dump(dict(raw), sort_keys=False)
    )  # a deep copy in plain YAML types, in order
    raw = copied
    problems = apply_overrides(raw, overrides)
    problems += merge_sweep_options(raw, sweeps)
    malformed_sweep = sweep_problems(raw)
    if malformed_sweep:
        problems += malformed_sweep
        raw["sweep"] = {}  # reported above; the schema would only repeat it
    problems += moved_key_problems(raw)
    resolutions, resolve_problems = _resolve_paths(raw, Path(base_dir) if base_dir else Path.cwd())
    problems += resolve_problems
    kind = spec_kind(raw, imports=imports)  # a kind of one's own by its resolved path
    kind_problems = kind.spec_problems(raw)  # read before the checks below fill in sections it may refuse
    problems += job_problems(raw, imports=imports)
    problems += kind.named_code_problems(raw, imports)
    try:
        spec = JobSpec.model_validate(raw)
        problems += reference_problems(spec.to_dict())
    except ValidationError as error:
        spec = None
        problems += [from_pydantic(item, JobSpec) for item in error.errors()]
    problems += cross_field_problems(raw) + kind_problems  # the kind's rules after the schema's problems
    problems += secret_problems(raw)
    if not problems and spec is not None and spec.sweep:
        try:
            expand(spec, source, imports=imports)
        except SpecError as error:
            problems += error.problems
    if problems:
        raise SpecError(source, unique(problems))
    assert spec is not None
    return LoadedSpec(spec=spec, resolutions=tuple(resolutions), source=source)


def _resolve_paths(raw: dict[str, Any], base_dir: Path) -> tuple[list[Resolution], list[Problem]]:
    name = raw.get("name") if isinstance(raw.get("name"), str) else None
    values: dict[str, str | None] = {"name": name}
    resolutions, problems = [], []
    for section, key in PATH_FIELDS:
        node = raw if section is None else raw.get(section)
        if not isinstance(node, dict) and section in ("checkpoint", "logging", "slurm"):
            if node is not None:
                continue
            node = raw[section] = {}
        if not isinstance(node, dict):
            continue
        if key not in node:
            default = _FIELD_DEFAULTS.get((section, key))
            if default is None:
                continue
            node[key] = default
        value = node[key]
        if not isinstance(value, str):
            continue
        dotted = key if section is None else f"{section}.{key}"
        resolved = value
        for placeholder in re.findall(r"\{([^{}]*)\}", value):
            if placeholder not in values:
                problems.append(Problem(dotted, f"unknown placeholder {{{placeholder}}}", "valid placeholders: {name}"))
            elif (value_of := values[placeholder]) is None:
                problems.append(Problem(dotted, "uses {name} but the spec has no valid name", "set name: ..."))
            else:
                resolved = resolved.replace(f"{{{placeholder}}}", value_of)
        if (section, key) in IMPORT_PATH_FIELDS:
            resolved = _resolve_import_path(resolved, base_dir)
        elif "://" not in resolved and not Path(resolved).is_absolute():
            resolved = str((base_dir / resolved).resolve())
        if resolved != value:
            node[key] = resolved
            resolutions.append(Resolution(dotted, value, resolved))
    data = raw.get("data")
    mix = data.get("mix") if isinstance(data, dict) else None
    for index, source in enumerate(mix if isinstance(mix, list) else []):
        for key in ("uri", "val_uri"):  # each source's datasets, like data.uri
            value = source.get(key) if isinstance(source, dict) else None
            if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
                source[key] = str((base_dir / value).resolve())
                resolutions.append(Resolution(f"data.mix[{index}].{key}", value, source[key]))
    ingest = data.get("ingest") if isinstance(data, dict) else None
    if isinstance(ingest, dict) and isinstance(ingest.get("source"), str):
        source_text = ingest["source"]
        ingest["source"] = _absolute_source(source_text, base_dir)
        if ingest["source"] != source_text:
            resolutions.append(Resolution("data.ingest.source", source_text, ingest["source"]))
    return resolutions, problems


def _absolute_source(text: str, base_dir: Path) -> str:
    """A shard source's local path or glob (``jsonl:./*.jsonl``) made absolute like the spec's other
    paths: a worker lists it from wherever it runs. A format of one's own has its file made absolute
    (``formats.py:CsvRows:...``, as task.name's), and its location as written: the format reads it."""
    parts = source_format(text)
    if parts is None:
        return text
    kind, pattern = parts
    if kind not in SHARD_FORMATS:
        return f"{_resolve_import_path(kind, base_dir)}:{pattern}"
    if kind in BARE_FORMATS or not pattern or "://" in pattern or Path(pattern).is_absolute():
        return text
    return f"{kind}:{os.path.normpath(base_dir.resolve() / pattern)}"


_FIELD_DEFAULTS: dict[tuple[str | None, str], Any] = {
    ("checkpoint", "dir"): CheckpointSpec.model_fields["dir"].default,
    ("logging", "tensorboard_dir"): LoggingSpec.model_fields["tensorboard_dir"].default,
    ("slurm", "log_dir"): SlurmSpec.model_fields["log_dir"].default,
    ("infer", "metrics_file"): InferSpec.model_fields["metrics_file"].default,
}


def expand(spec: JobSpec, source: str = "<spec>", imports: bool = True) -> list[SweepRun]:
    """The runs of a sweep spec, each validated (``imports``: as :func:`validate_spec` takes it);
    raises SpecError naming the swept value at fault."""
    runs, problems = [], []
    for index, values, name, raw in run_drafts(spec):
        try:
            runs.append(SweepRun(index, values, validate_spec(raw, source, imports=imports).spec))
        except SpecError as error:
            problems += [blame(problem, values, name) for problem in error.problems]
    if problems:
        raise SpecError(source, list(dict.fromkeys(problems)))
    return runs
