"""The job spec: frozen pydantic models, every field with a one-line description. :class:`JobSpec`,
the ``task`` and ``infer`` sections are here; the ``slurm`` section is in
:mod:`~lance_hpc.spec.slurm_section`, ``data`` in :mod:`~lance_hpc.spec.data_section`, ``train``,
``checkpoint`` and ``logging`` in :mod:`~lance_hpc.spec.train_section`, and what they share in
:mod:`~lance_hpc.spec.section`.

Fields that name a strategy, mode or runtime are plain strings checked against the names in
:mod:`lance_hpc.spec.choices` (:func:`~lance_hpc.spec.section.choice`), which the layers that
implement them check in turn.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator

from lance_hpc.spec.choices import ON_ERROR_MODES, OUTPUT_TYPES, REFRESH_MODES
from lance_hpc.spec.command_section import NOT_READ, CommandSpec
from lance_hpc.spec.data_section import CacheSpec, DataSpec, IngestSpec, MixSource
from lance_hpc.spec.kinds import named_kind
from lance_hpc.spec.predicates import check_predicate
from lance_hpc.spec.secrets import redacted
from lance_hpc.spec.section import Section, choice
from lance_hpc.spec.slurm_section import ContainerSpec, SlurmSpec, parse_time_limit
from lance_hpc.spec.train_section import CheckpointSpec, LoggingSpec, TrainSpec

# Every section, importable from here as from the module each lives in.
__all__ = [
    "CacheSpec",
    "CheckpointSpec",
    "CommandSpec",
    "ContainerSpec",
    "DataSpec",
    "IngestSpec",
    "InferSpec",
    "JobSpec",
    "LoggingSpec",
    "MixSource",
    "SlurmSpec",
    "TaskSpec",
    "TrainSpec",
    "entry_note",
    "parse_time_limit",
]


class TaskSpec(Section):
    name: str = Field(
        "image_classification",
        description="image_classification | language_model | columns (script mode), or your Task class: my_pkg.tasks:MyTask or file.py:MyTask.",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="The task's options (see docs/tasks.md).")


# The train fields only the built-in trainer reads: an entry of your own uses them only if it reads
# them from ctx.spec (its context does read epochs, max_steps, precision, grad_accum, seed,
# deterministic and collective_timeout_s).
TRAINER_FIELDS = (
    "lr",
    "lr_scaling",
    "base_batch_size",
    "warmup_epochs",
    "optimizer",
    "momentum",
    "weight_decay",
    "grad_clip",
    "eval_every_epochs",
)


def entry_note(spec: JobSpec) -> str | None:
    """For a spec with an ``entry``: which of the fields only the built-in trainer reads it sets."""
    if spec.entry is None:
        return None
    set_here = [f"train.{name}" for name in TRAINER_FIELDS if name in spec.train.model_fields_set]
    if not set_here:
        return f"entry {spec.entry} runs instead of the built-in trainer"
    return (
        f"entry {spec.entry} runs instead of the built-in trainer: {', '.join(set_here)} "
        f"take effect only if it reads them from ctx.spec (the trainer's own fields)"
    )


class InferSpec(Section):
    checkpoint: str | None = Field(
        None,
        description="The model: a training job's checkpoint.dir (its latest checkpoint is read), with this spec's task "
        "section building the model and decoding the rows as in training.",
    )
    function: str | None = Field(
        None,
        description="Instead of the task's outputs: your function (my_pkg.infer:predict) taking (model, batch) on the "
        "device and returning {column: tensor}; model is None without infer.checkpoint. job: map: your function "
        "(my_pkg.features:sizes) taking a pyarrow RecordBatch of infer.columns and returning {column: array}.",
    )
    columns: list[str] = Field(
        default_factory=list,
        description="job: map: the columns your function reads, in batches of data.batch_size rows; empty: every column.",
    )
    outputs: dict[str, str] = Field(
        default_factory=dict,
        description="job: infer: the new columns and their value types (float16, float32, float64, int32, int64), e.g. "
        "{embedding: float16, predicted: int64}; a vector per row becomes a fixed-size list.",
    )
    overwrite: bool = Field(
        False, description="Columns the dataset has already are replaced in a new version (the earlier versions keep them)."
    )
    filter: str | None = Field(
        None,
        description="A Lance SQL predicate (label = 3 AND score < 0.5): only the rows it selects are read and get values, "
        "the others null (job: evaluate: only they are counted).",
    )
    metrics_file: str = Field(
        "runs/{name}/metrics.json", description="job: evaluate: where the metrics are written as JSON (rank 0)."
    )
    refresh: str | None = Field(
        None,
        description="missing: compute the columns only for the rows that lack them (fragments appended since, or "
        "appended with nulls there), keeping every value and file there, in one commit; refused for columns another "
        "checkpoint or function wrote, unless overwrite.",
    )
    on_error: str = Field(
        "fail",
        description="job: infer and map: a row your function (or the model) raises on: fail (the job stops, naming the "
        "row, no restart) or skip (its new columns null, the row named in the log and counted in the last line).",
    )

    @field_validator("outputs")
    @classmethod
    def check_outputs(cls, outputs: dict[str, str]) -> dict[str, str]:
        unknown = sorted({kind for kind in outputs.values() if kind not in OUTPUT_TYPES})
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: an output's type is one of {', '.join(OUTPUT_TYPES)}")
        bad = sorted(name for name in outputs if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name))
        if bad:
            raise ValueError(f"{', '.join(bad)}: a column name is letters, digits and _, not starting with a digit")
        return outputs

    check_filter = field_validator("filter")(check_predicate)

    @field_validator("refresh")
    @classmethod
    def check_refresh(cls, refresh: str | None) -> str | None:
        return None if refresh is None else choice(lambda: REFRESH_MODES)(refresh)

    check_on_error = field_validator("on_error")(choice(lambda: ON_ERROR_MODES))


class JobSpec(Section):
    """A validated job spec (frozen): what the ranks run (``job``, ``task``, ``entry``), on which data,
    where SLURM runs it, and how it trains, saves checkpoints and logs; one section per attribute."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Job name.")
    job: str = Field(
        "train",
        description="What the ranks run: train (the built-in loop, or entry); ingest (data.ingest's source into data.uri, "
        "its shards split between the ranks, one commit at the end); infer (a model over data.uri, new columns "
        "per fragment, one commit); evaluate (a checkpoint's metrics on data.uri); map (your function over batches "
        "of data.uri's columns, no model, new columns the same way); or an import path to your own "
        "JobKind subclass (my_pkg.kinds:MyKind or path/to/file.py:MyKind); command, implied by command:.",
    )
    command: CommandSpec | None = Field(
        None,
        description="job: command: your program on every task instead of a built-in kind, with torchrun's variables: "
        "[python, train.py, --lr, '${lr}'], one string split like a shell's, or {argv: [...], signal: USR1}.",
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="Resources and submission.")
    data: DataSpec = Field(..., description="Dataset and loading strategy (none for job: command).")
    task: TaskSpec = Field(default_factory=TaskSpec, description="What is trained: columns, model, loss, metrics.")
    entry: str | None = Field(
        None, description="Script mode: your training function (my_pkg.train:main or file.py:main) instead of the built-in loop."
    )
    entry_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Script mode: your entry's own settings (ctx.options), checked against its Options model when it has one.",
    )
    train: TrainSpec = Field(default_factory=TrainSpec, description="Optimisation.")
    infer: InferSpec | None = Field(None, description="job: infer, evaluate and map: the model or function, and the new columns.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="TensorBoard and progress.")
    sweep: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="A sweep as one job array: spec path -> values, e.g. {train.lr: [0.1, 0.05]}; one run per combination.",
    )

    @model_validator(mode="before")
    @classmethod
    def kind_defaults(cls, values: Any) -> Any:
        """What the registered kind the spec names fills in (command: implies job: command, and
        stands for the data section that kind never reads)."""
        return named_kind(values).defaults(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def default_io_timeout(self) -> JobSpec:
        """data.io_timeout_s follows the collective timeout unless set: a rank retrying a read
        must give up before the others, waiting for it in a collective, time out."""
        if self.data.io_timeout_s is None:
            timeout = float(min(120, max(self.train.collective_timeout_s - 30, 1)))
            object.__setattr__(self, "data", self.data.model_copy(update={"io_timeout_s": timeout}))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain values; a command job's without the sections it does not read, so that
        its resolved spec loads again."""
        return self.model_dump(mode="json", exclude=set(NOT_READ) if self.command is not None else None)

    def redacted_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` for copies that leave the job's own spec file (its script, checkpoints,
        TensorBoard's hparams): credential-looking values replaced by a marker."""
        return redacted(self.to_dict())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
