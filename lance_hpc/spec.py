"""Job spec: YAML in, a frozen, validated :class:`JobSpec` out.

Every user mistake becomes one :class:`SpecError` that lists each problem with its YAML path and
a fix, never a traceback. Placeholders such as ``{name}`` in path fields are resolved once, at load
time, and the resolutions are kept on the spec so the command line can show them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lance_hpc.errors import UserError

STYLES = ("map", "iterable")
SAMPLERS_BY_STYLE = {
    "map": ("distributed",),
    "iterable": ("sharded_batch", "sharded_fragment", "full_scan"),
}
SAMPLERS = tuple(name for names in SAMPLERS_BY_STYLE.values() for name in names)
ARCHS = ("small_cnn", "resnet18", "resnet34", "resnet50")

# Fields whose string values may hold placeholders and name local paths (made absolute on load).
PATH_FIELDS = (
    ("data", "uri"),
    ("data", "val_uri"),
    ("checkpoint", "dir"),
    ("logging", "tensorboard_dir"),
    ("slurm", "log_dir"),
    ("slurm", "template"),
)
# storage_options keys that would put a credential into a file; they must come from the environment.
SECRET_KEY_PATTERN = re.compile(r"secret|access_key|session_token|password|token|credential", re.I)
# The forms sbatch accepts for --time.
TIME_PATTERN = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class SlurmSpec(_Section):
    partition: str | None = Field(None, description="SLURM partition (-p); null uses the cluster default.")
    nodes: int = Field(1, ge=1, description="Number of nodes (-N).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (--gpus-per-node); 0 for CPU jobs.")
    tasks_per_node: int | None = Field(
        None, ge=1, description="Tasks per node; null means one per GPU (or 1 without GPUs)."
    )
    cpus_per_task: int = Field(4, ge=1, description="CPU cores per task, for DataLoader workers.")
    mem_gb: int | None = Field(None, ge=1, description="Memory per node in GiB (--mem); null: cluster default.")
    time: str = Field("01:00:00", description="Time limit, any sbatch form: MM, HH:MM:SS, D-HH:MM:SS.")
    account: str | None = Field(None, description="Account to charge (-A).")
    qos: str | None = Field(None, description="Quality of service (--qos).")
    constraint: str | None = Field(None, description="Node feature constraint (-C).")
    exclusive: bool = Field(False, description="Ask for whole nodes (--exclusive).")
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before launch (module load, venv activate)."
    )
    extra_flags: dict[str, str | int | bool | None] = Field(
        default_factory=dict,
        description="More sbatch flags by long name without dashes, e.g. {reservation: big}.",
    )
    template: str | None = Field(None, description="Path of a site sbatch template; null: built-in.")
    max_requeues: int = Field(3, ge=0, description="How many times a preempted job requeues itself.")
    signal_delay_s: int = Field(
        120, ge=10, description="Seconds before the time limit SLURM sends USR2 to save and requeue."
    )
    log_dir: str = Field("logs/{name}", description="Where job stdout/stderr and rendered files go.")

    @property
    def ntasks_per_node(self) -> int:
        """Tasks launched on each node: explicit, else one per GPU, else one."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node

    @property
    def time_seconds(self) -> int:
        return parse_time_limit(self.time)


class IngestSpec(_Section):
    source: str = Field(
        ...,
        description="What to ingest when data.uri does not exist yet: sklearn-digits, skimage-photos, "
        "imagefolder:<dir> or torchvision:<Name>:<root>.",
    )
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of rows written to data.val_uri.")
    rows_per_fragment: int = Field(1024, ge=1, description="Rows per Lance fragment.")
    seed: int = Field(0, description="Seed of the train/validation split.")


class DataSpec(_Section):
    uri: str = Field(..., description="Training dataset: local path or s3://bucket/path.lance.")
    val_uri: str | None = Field(None, description="Validation dataset; null skips evaluation.")
    version: int | None = Field(None, ge=1, description="Pinned dataset version; null: latest at start.")
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="Object-store options (endpoint, region, allow_http); credentials come from env.",
    )
    image_column: str = Field("image", description="Column of encoded image bytes.")
    label_column: str = Field("label", description="Column of integer labels.")
    style: Literal["map", "iterable"] = Field("map", description="Dataset style: map | iterable.")
    sampler: Literal["distributed", "sharded_batch", "sharded_fragment", "full_scan"] = Field(
        "distributed", description="Sampler: distributed (map) or sharded_batch | sharded_fragment (iterable)."
    )
    val_sampler: Literal["sharded", "full_scan"] = Field(
        "sharded", description="Evaluation split: sharded across ranks, or full_scan on every rank."
    )
    uneven: Literal["drop", "pad"] = Field(
        "drop", description="How ranks get equal steps: drop the surplus rows or pad by repeating rows."
    )
    batch_size: int = Field(64, ge=1, description="Samples per rank per step.")
    num_workers: int = Field(4, ge=0, description="DataLoader worker processes per rank.")
    prefetch_factor: int = Field(2, ge=1, description="Batches each worker keeps ready.")
    shuffle: bool = Field(True, description="Reshuffle every epoch from seed + epoch.")
    seed: int = Field(0, description="Seed of the data order.")
    image_size: int = Field(224, ge=8, description="Side of the square training crop.")
    augment: Literal["crop_flip", "crop", "none"] = Field(
        "crop_flip", description="Train augmentation: random resized crop (+ horizontal flip), or resize only."
    )
    on_corrupt: Literal["skip", "fail"] = Field(
        "skip", description="Undecodable image: skip (counted in logs) or fail naming the row."
    )
    ingest: IngestSpec | None = Field(None, description="Create the dataset on first use from a source.")


class ModelSpec(_Section):
    arch: Literal["small_cnn", "resnet18", "resnet34", "resnet50"] = Field(
        "resnet18", description="Model: small_cnn (tests, demos) or a torchvision ResNet."
    )
    num_classes: int | None = Field(None, ge=2, description="Classes; null reads them from the dataset.")
    channels_last: bool = Field(True, description="Use channels-last memory format on GPU.")


class TrainSpec(_Section):
    epochs: int = Field(10, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (quick runs).")
    lr: float = Field(0.1, gt=0, description="Learning rate at base_batch_size.")
    lr_scaling: Literal["linear", "none"] = Field(
        "linear", description="linear: lr * global_batch / base_batch_size; none: lr as given."
    )
    base_batch_size: int = Field(256, ge=1, description="Global batch size at which lr applies.")
    warmup_epochs: float = Field(1.0, ge=0, description="Linear warmup length, then cosine decay.")
    optimizer: Literal["sgd", "adamw"] = Field("sgd", description="sgd (momentum, nesterov) or adamw.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(5e-5, ge=0, description="Weight decay.")
    precision: Literal["bf16", "fp32"] = Field("bf16", description="bf16 autocast on GPU; CPU runs fp32.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seed: int = Field(0, description="Seed of model init and augmentation.")
    deterministic: bool = Field(False, description="Deterministic kernels (slower), for exact resume checks.")
    collective_timeout_s: int = Field(
        180, ge=10, description="Seconds a collective may wait before the job fails with a clear error."
    )
    eval_every_epochs: int = Field(1, ge=1, description="Evaluate every N epochs (and at the end).")


class CheckpointSpec(_Section):
    dir: str = Field("checkpoints/{name}", description="Checkpoint directory.")
    every_steps: int = Field(500, ge=1, description="Save every N optimizer steps (and at epoch end).")
    keep: int = Field(3, ge=1, description="Checkpoints kept; older ones are deleted.")
    resume: bool = Field(True, description="Start from the latest checkpoint in dir if there is one.")


class LoggingSpec(_Section):
    tensorboard_dir: str = Field("runs/{name}", description="TensorBoard event directory (rank 0 writes).")
    log_every_steps: int = Field(20, ge=1, description="Log scalars every N steps.")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")


class JobSpec(_Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Job name.")
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="Resources and submission.")
    data: DataSpec = Field(..., description="Dataset and loading strategy.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="Model.")
    train: TrainSpec = Field(default_factory=TrainSpec, description="Optimisation.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="TensorBoard and progress.")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where, what, and how to fix it."""

    path: str
    message: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"  {self.path or '<spec>'}: {self.message}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


class SpecError(UserError):
    """Every problem found in a spec, reported together."""

    def __init__(self, source: str, problems: Sequence[Problem]):
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        header = f"{source}: {count} problem{'s' if count != 1 else ''} in the job spec"
        super().__init__("\n".join([header, *map(str, self.problems)]))


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


def parse_time_limit(text: str) -> int:
    """Seconds in an sbatch time limit; raises ValueError for a malformed one."""
    match = TIME_PATTERN.match(str(text).strip())
    if not match:
        raise ValueError(text)
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if third is not None:  # HH:MM:SS
        return (int(first) * 60 + int(second)) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60  # MM


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
            node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    return problems


def load_spec(
    path: str | Path,
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
) -> LoadedSpec:
    """Read, override, resolve and validate a job spec; raises SpecError listing every problem."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(source, [Problem("", f"spec file {source} does not exist", "check the path")]) from None
    except OSError as error:
        raise SpecError(source, [Problem("", f"cannot read {source}: {error.strerror}")]) from None
    return load_spec_text(text, source, overrides, base_dir)


def load_spec_text(
    text: str,
    source: str = "<spec>",
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
) -> LoadedSpec:
    """Like load_spec, from YAML text."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise SpecError(source, [Problem("", f"not valid YAML at {where}: {getattr(error, 'problem', error)}")]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(source, [Problem("", "the spec must be a mapping of sections", "start with 'name: ...'")])
    return validate_spec(raw, source, overrides, base_dir)


def validate_spec(
    raw: Mapping[str, Any],
    source: str = "<spec>",
    overrides: Sequence[str] = (),
    base_dir: str | Path | None = None,
) -> LoadedSpec:
    """Validate a spec mapping (a deep copy is modified); raises SpecError listing every problem."""
    raw = yaml.safe_load(yaml.safe_dump(dict(raw)))  # deep copy through plain YAML types
    problems = apply_overrides(raw, overrides)
    resolutions, resolve_problems = _resolve_paths(raw, Path(base_dir) if base_dir else Path.cwd())
    problems += resolve_problems
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as error:
        spec = None
        problems += [_problem_from_pydantic(item, raw) for item in error.errors()]
    problems += _cross_field_problems(raw)
    if problems:
        raise SpecError(source, _unique(problems))
    assert spec is not None
    return LoadedSpec(spec=spec, resolutions=tuple(resolutions), source=source)


def _resolve_paths(raw: dict[str, Any], base_dir: Path) -> tuple[list[Resolution], list[Problem]]:
    name = raw.get("name") if isinstance(raw.get("name"), str) else None
    values = {"name": name}
    resolutions, problems = [], []
    for section, key in PATH_FIELDS:
        node = raw.get(section)
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
        dotted = f"{section}.{key}"
        resolved = value
        for placeholder in re.findall(r"\{([^{}]*)\}", value):
            if placeholder not in values:
                problems.append(
                    Problem(dotted, f"unknown placeholder {{{placeholder}}}", f"valid placeholders: {{name}}")
                )
            elif values[placeholder] is None:
                problems.append(Problem(dotted, "uses {name} but the spec has no valid name", "set name: ..."))
            else:
                resolved = resolved.replace(f"{{{placeholder}}}", values[placeholder])
        if "://" not in resolved and not Path(resolved).is_absolute():
            resolved = str((base_dir / resolved).resolve())
        if resolved != value:
            node[key] = resolved
            resolutions.append(Resolution(dotted, value, resolved))
    return resolutions, problems


_FIELD_DEFAULTS = {
    ("checkpoint", "dir"): CheckpointSpec.model_fields["dir"].default,
    ("logging", "tensorboard_dir"): LoggingSpec.model_fields["tensorboard_dir"].default,
    ("slurm", "log_dir"): SlurmSpec.model_fields["log_dir"].default,
}


def _model_at(location: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = JobSpec
    for part in location:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        candidates = getattr(annotation, "__args__", (annotation,))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _problem_from_pydantic(item: Mapping[str, Any], raw: Mapping[str, Any]) -> Problem:
    location = list(item["loc"])
    path = ".".join(str(part) for part in location)
    kind = item["type"]
    value = item.get("input")
    context = item.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _model_at(location[:-1])
        valid = sorted(parent.model_fields) if parent else []
        key = str(location[-1])
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return Problem(path, f"unknown key '{key}'", f"{hint}valid keys: {', '.join(valid)}")
    if kind == "missing":
        return Problem(path, "required key is missing", f"add '{location[-1]}: ...'")
    if kind == "literal_error":
        return Problem(path, f"'{value}' is not a valid choice", f"use one of: {context.get('expected', '')}")
    if kind in ("greater_than_equal", "greater_than", "less_than", "less_than_equal"):
        bound = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}[kind]
        limit = next(iter(context.values()), "")
        return Problem(path, f"must be {bound} {limit}, got {value!r}", f"set a value {bound} {limit}")
    if kind == "string_pattern_mismatch":
        return Problem(path, f"{value!r} has characters that are not allowed", "use letters, digits, '.', '_', '-'")
    if kind.endswith("_type") or kind.endswith("_parsing"):
        expected = kind.split("_")[0]
        return Problem(path, f"expected {expected}, got {type(value).__name__} {value!r}", f"write a value of type {expected}")
    return Problem(path, item["msg"])


def _cross_field_problems(raw: Mapping[str, Any]) -> list[Problem]:
    """Rules that span fields; read from the raw mapping so they run even when fields are wrong."""
    problems = []
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    slurm = raw.get("slurm") if isinstance(raw.get("slurm"), dict) else {}
    style = data.get("style", "map")
    sampler = data.get("sampler", "distributed" if style == "map" else "sharded_batch")
    if style == "iterable" and "sampler" not in data:
        sampler = None  # validated below with an explicit message
        problems.append(
            Problem("data.sampler", "iterable style needs a sampler", "use one of: sharded_batch, sharded_fragment")
        )
    if style in SAMPLERS_BY_STYLE and sampler in SAMPLERS and sampler not in SAMPLERS_BY_STYLE[style]:
        valid = ", ".join(SAMPLERS_BY_STYLE[style])
        problems.append(
            Problem("data.sampler", f"sampler '{sampler}' does not work with style '{style}'", f"with style '{style}' use: {valid}")
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
                Problem("slurm.signal_delay_s", f"{delay}s is not shorter than the time limit ({limit}s)", "lower it or raise slurm.time")
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
    template = slurm.get("template")
    if isinstance(template, str) and not Path(template).is_file():
        problems.append(Problem("slurm.template", f"template file {template} does not exist", "fix the path or remove the key"))
    options = data.get("storage_options")
    if isinstance(options, dict):
        for key in options:
            if SECRET_KEY_PATTERN.search(str(key)):
                problems.append(
                    Problem(
                        f"data.storage_options.{key}",
                        "credentials must not be written in the spec (they would land in scripts and logs)",
                        "export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_SESSION_TOKEN) in the environment",
                    )
                )
    return problems


def _unique(problems: Sequence[Problem]) -> list[Problem]:
    seen, result = set(), []
    for problem in problems:
        key = (problem.path, problem.message)
        if key not in seen:
            seen.add(key)
            result.append(problem)
    return result
