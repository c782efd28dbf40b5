"""The job spec's sections: frozen pydantic models, every field with a one-line description.

Fields that name a strategy, mode or runtime are plain strings checked against the names in
:mod:`lance_hpc.spec.choices` (:func:`_choice`), which the layers that implement them check in turn.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from lance_hpc.spec.choices import (
    CONTAINER_RUNTIMES,
    EVAL_MODES,
    INGEST_COLUMNS,
    ON_CORRUPT,
    OUTPUT_TYPES,
    REFRESH_MODES,
    SAMPLERS,
    STYLES,
    UNEVEN_MODES,
)
from lance_hpc.spec.limits import DEFAULT_RECORD_MB, MAX_PIXELS, MAX_RECORD_MB, MAX_SEQUENCE_LENGTH
from lance_hpc.spec.predicates import check_predicate
from lance_hpc.spec.secrets import redacted
from lance_hpc.storage.options import is_remote

# The largest weight of a mix over its smallest: a source below 2**-62 of the largest would not be
# drawn once in the largest epoch (mix_epoch_rows <= 2**62), and its share would underflow.
MAX_WEIGHT_RATIO = 2.0**62
# Bounds of every count and seed: what SLURM's and numpy's 32-bit fields hold. Past them a value
# passes validation and then fails on every rank (numpy refuses a seed of -1 or 2**32).
MAX_INT = 2**31 - 1
MAX_SEED = 2**32 - 1
# A node-local cache's size in GiB: 2**20 GiB (1 PiB) is past any node's local disk.
MAX_CACHE_GB = float(2**20)
# The forms sbatch accepts for --time.
TIME_PATTERN = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


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


def _choice(names: Callable[[], Any]) -> Callable[[str], str]:
    """A validator: the value must be one of ``names()`` (imported when first checked)."""

    def check(value: str) -> str:
        valid = list(names())
        if value not in valid:
            raise PydanticCustomError("choice", "'{value}' is not a valid choice", {"value": value, "expected": ", ".join(valid)})
        return value

    return check


class _Section(BaseModel):
    # allow_inf_nan=False: every float field is finite (a cache of .inf GiB never evicts).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)


# A container mount as runtimes take it: /host/path:/container/path, optionally :ro or :rw.
MOUNT_PATTERN = re.compile(r"^/[^:,]*(?::/[^:,]*(?::(?:ro|rw))?)?$")


class ContainerSpec(_Section):
    image: str = Field(
        ..., min_length=1, description="Image: an Apptainer .sif path or docker:// URI, or an enroot image for pyxis."
    )
    runtime: str = Field("apptainer", description="apptainer (srun apptainer exec IMAGE ...) or pyxis (srun --container-image).")
    mounts: list[str] = Field(
        default_factory=list,
        description="Host paths visible in the container: /host:/container[:ro]; data, checkpoints and logs.",
    )
    workdir: str | None = Field(None, description="Working directory inside the container; null: the runtime's default.")

    check_runtime = field_validator("runtime")(_choice(lambda: CONTAINER_RUNTIMES))

    @field_validator("mounts")
    @classmethod
    def check_mounts(cls, mounts: list[str]) -> list[str]:
        for mount in mounts:
            if not MOUNT_PATTERN.match(mount):
                raise ValueError(
                    f"mount {mount!r} is not /host/path or /host/path:/container/path[:ro]\n"
                    "  fix: write absolute paths without commas, e.g. /scratch/data:/data:ro"
                )
        return mounts


class SlurmSpec(_Section):
    partition: str | None = Field(None, description="SLURM partition (-p); null uses the cluster default.")
    nodes: int = Field(1, ge=1, le=MAX_INT, description="Number of nodes (-N).")
    gpus_per_node: int = Field(0, ge=0, le=MAX_INT, description="GPUs per node (--gpus-per-node); 0 for CPU jobs.")
    tasks_per_node: int | None = Field(
        None, ge=1, le=MAX_INT, description="Tasks per node; null means one per GPU (or 1 without GPUs)."
    )
    cpus_per_task: int = Field(4, ge=1, le=MAX_INT, description="CPU cores per task, for DataLoader workers.")
    mem_gb: int | None = Field(None, ge=1, le=MAX_INT, description="Memory per node in GiB (--mem); null: cluster default.")
    time: str = Field("01:00:00", description="Time limit, any sbatch form: MM, HH:MM:SS, D-HH:MM:SS.")
    account: str | None = Field(None, description="Account to charge (-A).")
    qos: str | None = Field(None, description="Quality of service (--qos).")
    constraint: str | None = Field(None, description="Node feature constraint (-C).")
    exclusive: bool = Field(False, description="Ask for whole nodes (--exclusive).")
    setup: list[str] = Field(default_factory=list, description="Shell lines run before launch (module load, venv activate).")
    extra_flags: dict[str, str | int | bool | None] = Field(
        default_factory=dict,
        description="More sbatch flags by long name without dashes, e.g. {reservation: big}.",
    )
    template: str | None = Field(None, description="Path of a site sbatch template; null: built-in.")
    max_requeues: int = Field(3, ge=0, le=MAX_INT, description="How many times a preempted job requeues itself.")
    signal_delay_s: int = Field(
        120, ge=10, le=MAX_INT, description="Seconds before the time limit SLURM sends USR2 to save and requeue."
    )
    log_dir: str = Field("logs/{name}", description="Where job stdout/stderr and rendered files go.")
    array_parallelism: int = Field(
        4, ge=1, le=MAX_INT, description="Sweeps: how many runs of the job array may run at once (--array=0-N%this)."
    )
    container: ContainerSpec | None = Field(None, description="Run every task in a container; null: on the host.")

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
        "torchvision:<Name>:<root>; or, by shards: imagefolder:<dir>, text:<glob>, python-stdlib, parquet:, jsonl:, "
        "webdataset:, hf:.",
    )
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of rows written to data.val_uri.")
    rows_per_fragment: int = Field(1024, ge=1, le=MAX_INT, description="Rows per Lance fragment.")
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="sklearn-digits, skimage-photos, torchvision: seed of the split and row order (sharded sources split "
        "by a hash of each row's key).",
    )
    sequence_length: int = Field(256, ge=2, le=MAX_SEQUENCE_LENGTH, description="Text sources: tokens per training sequence.")
    tokenizer: str = Field(
        "bytes",
        description="Text sources: bytes (UTF-8, nothing to download), hf:<tokenizer.json> (e.g. one trained by "
        "lance-hpc tokenizer train) or pkg.mod:factory.",
    )
    tokenize: bool | None = Field(
        None,
        description="Pack the source's text into token sequences for a language model: by default yes for text: and "
        "python-stdlib (no: one row per document), no for other sources (yes: tokenise their text column).",
    )
    files_per_shard: int = Field(
        1000, ge=1, le=MAX_INT, description="imagefolder: and text: sources: files per shard (a worker's unit of work)."
    )
    overwrite: bool = Field(
        False,
        description=(
            "Write over Lance datasets already at data.uri / data.val_uri as new versions (other files are never touched); "
            "a job's start still skips a complete one."
        ),
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="parquet:, jsonl:, webdataset:, hf: sources: which field is image, label, text or key, e.g. {image: png}; "
        "'' for none; other fields are kept as columns.",
    )
    append: bool = Field(
        False, description="parquet:, jsonl:, webdataset:, hf: sources: add the rows to the dataset at data.uri as a new version."
    )
    on_corrupt: str = Field(
        "skip",
        description="An image that cannot be read, or a sample past max_record_mb or the field limit, at ingest: skip "
        "(counted in the summary) or fail the ingest.",
    )
    max_pixels: int = Field(
        MAX_PIXELS,
        ge=1,
        le=MAX_PIXELS,
        description="Images with more pixels are skipped at ingest (at most what training decodes, the default).",
    )
    max_record_mb: int = Field(
        DEFAULT_RECORD_MB,
        ge=1,
        le=MAX_RECORD_MB,
        description="webdataset:, imagefolder:, text: sources: a member or file larger than this many MiB is skipped "
        "(counted) or fails the ingest, as on_corrupt says.",
    )

    check_on_corrupt = field_validator("on_corrupt")(_choice(lambda: ON_CORRUPT))

    @field_validator("columns")
    @classmethod
    def check_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(INGEST_COLUMNS))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: the columns a field can map to are {', '.join(INGEST_COLUMNS)}")
        return columns


class CacheSpec(_Section):
    dir: str = Field(
        ...,
        min_length=1,
        description="Node-local directory for cached data files, shared by every rank and worker on the node; $VARS expand there.",
    )
    max_gb: float = Field(
        ..., gt=0, le=MAX_CACHE_GB, description="Size limit in GiB; beyond it the least recently used files are deleted."
    )

    @field_validator("dir")
    @classmethod
    def check_dir(cls, directory: str) -> str:
        if "://" in directory or not directory.startswith(("/", "$", "~")):
            raise ValueError(
                f"{directory!r} is not an absolute local path\n"
                "  fix: name a directory on each node's local disk, e.g. /local/nvme/lance-cache or $TMPDIR/lance-cache"
            )
        return directory


class MixSource(_Section):
    uri: str = Field(..., description="One dataset of the mix: local path or s3://bucket/path.lance.")
    weight: float = Field(..., gt=0, description="Its share of every step's rows, relative to the other sources' weights.")
    filter: str | None = Field(None, min_length=1, description="Lance SQL predicate choosing the source's rows.")
    version: int | None = Field(None, ge=1, le=MAX_INT, description="Pinned version of the source.")
    tag: str | None = Field(None, min_length=1, description="Pinned by tag name instead of version.")
    storage_options: dict[str, str] | None = Field(None, description="Object-store options of this source [default: data's].")
    val_uri: str | None = Field(None, description="This source's own validation set, reported as val/<source>/* beside val/*.")

    @model_validator(mode="after")
    def one_pin(self) -> MixSource:
        if self.version is not None and self.tag is not None:
            raise ValueError("set version or tag, not both")
        return self

    check_filter = field_validator("filter")(check_predicate)


class DataSpec(_Section):
    uri: str = Field(
        ..., description="Training dataset: local path or s3://bucket/path.lance [default with mix: the first source]."
    )
    val_uri: str | None = Field(None, description="Validation dataset; null skips evaluation.")
    version: int | None = Field(None, ge=1, le=MAX_INT, description="Pinned dataset version; null: latest at start.")
    tag: str | None = Field(
        None, min_length=1, description="Pinned by tag name (a version the dataset's owner named) instead of data.version."
    )
    filter: str | None = Field(
        None,
        min_length=1,
        description="Train on the rows matching this Lance SQL predicate (e.g. quality > 0.8 AND lang = 'en'), pinned at first start.",
    )
    mix: list[MixSource] | None = Field(
        None,
        min_length=1,
        description="Several datasets drawn by weight in every step, each with its own epoch (docs: data-loading.md#mixes).",
    )
    mix_epoch_rows: int | None = Field(
        None,
        ge=1,
        le=2**62,
        description="Rows an epoch of a mix draws over all ranks [default: the sources' selected rows together].",
    )
    block_kb: int = Field(
        2048,
        ge=1,
        le=2**20,
        description="sampler: block: KiB of neighbouring rows read as one run (a worker holds 2 windows of block_window runs).",
    )
    block_window: int = Field(
        32, ge=1, le=2**16, description="sampler: block: runs whose rows are shuffled together (each worker holds one window)."
    )
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="Object-store options (endpoint, region, allow_http); credentials come from env.",
    )
    style: str = Field("map", description="Dataset style: map | iterable.")
    sampler: str = Field(
        "distributed",
        description=(
            "Sampler: distributed or block (map), sharded_batch | sharded_fragment | block (iterable) "
            "[default: block for a dataset on object storage (s3://, gs://, az://), else distributed]."
        ),
    )
    val_sampler: str = Field("sharded", description="Evaluation split: sharded across ranks, or full_scan on every rank.")
    uneven: str = Field("drop", description="How ranks get equal steps: drop the surplus rows or pad by repeating rows.")
    batch_size: int = Field(64, ge=1, le=MAX_INT, description="Samples per rank per step.")
    num_workers: int = Field(4, ge=0, le=MAX_INT, description="DataLoader worker processes per rank.")
    prefetch_factor: int = Field(2, ge=1, le=MAX_INT, description="Batches each worker keeps ready.")
    io_depth: int = Field(
        4,
        ge=0,
        le=64,
        description=(
            "Batches each worker reads ahead from the store while it decodes (hides object-storage latency; "
            "each costs one batch of encoded bytes in memory); 0: read on demand."
        ),
    )
    shuffle: bool = Field(True, description="Reshuffle every epoch from seed + epoch.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the data order and of augmentation.")
    on_corrupt: str = Field("skip", description="A row the task cannot decode: skip (counted in logs) or fail naming it.")
    ingest: IngestSpec | None = Field(None, description="Create the dataset on first use from a source.")
    io_timeout_s: float | None = Field(
        None,
        gt=0,
        le=MAX_INT,
        description=(
            "Seconds a read keeps retrying a failing store before the job stops; at most train.collective_timeout_s - 30 "
            "[default: that, up to 120]."
        ),
    )
    cache: CacheSpec | None = Field(None, description="Node-local cache of fetched data files; null reads the store every epoch.")

    @model_validator(mode="before")
    @classmethod
    def defaults_of_uri(cls, values: Any) -> Any:
        """With a mix, data.uri is the first source's (where a dataset's files and checks are named).
        An unset sampler over object storage is block: runs of block_kb per request instead of about
        one request per sample (see docs/data-loading.md, "Shuffled reads that stay cheap")."""
        if not isinstance(values, dict):
            return values
        if "uri" not in values and isinstance(values.get("mix"), list) and values["mix"]:
            first = values["mix"][0]
            uri = first.get("uri") if isinstance(first, dict) else getattr(first, "uri", None)
            if isinstance(uri, str):
                values = {**values, "uri": uri}
        if "sampler" not in values and isinstance(values.get("uri"), str) and is_remote(values["uri"]):
            values = {**values, "sampler": "block"}
        return values

    @model_validator(mode="after")
    def one_selection(self) -> DataSpec:
        if self.version is not None and self.tag is not None:
            raise ValueError("set data.version or data.tag, not both")
        if self.mix is not None and (self.filter or self.version is not None or self.tag):
            raise ValueError("with data.mix, set filter, version and tag on each source, not on data")
        if self.mix is not None and self.uri != self.mix[0].uri:
            raise ValueError("with data.mix, leave data.uri out: it is the first source's uri")
        return self

    check_style = field_validator("style")(_choice(lambda: STYLES))
    check_sampler = field_validator("sampler")(_choice(lambda: SAMPLERS))
    check_val_sampler = field_validator("val_sampler")(_choice(lambda: EVAL_MODES))
    check_uneven = field_validator("uneven")(_choice(lambda: UNEVEN_MODES))
    check_on_corrupt = field_validator("on_corrupt")(_choice(lambda: ON_CORRUPT))
    check_filter = field_validator("filter")(check_predicate)

    @field_validator("mix")
    @classmethod
    def check_weights(cls, mix: list[MixSource] | None) -> list[MixSource] | None:
        weights = [source.weight for source in mix or ()]
        if weights and max(weights) > MAX_WEIGHT_RATIO * min(weights):
            raise ValueError(
                f"the weights {min(weights):g} and {max(weights):g} are more than 2**62 apart: the lighter source "
                "would never be drawn\n  fix: remove that source, or give the weights as shares of a few units (0.9, 0.1)"
            )
        return mix


class TaskSpec(_Section):
    name: str = Field(
        "image_classification",
        description="image_classification | language_model, or your Task class: my_pkg.tasks:MyTask or file.py:MyTask.",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="The task's options (see docs/tasks.md).")


# Optimisation choices; the trainer reads the same tuples.
LR_SCALING = ("linear", "none")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("bf16", "fp32")
# train.parallelism: ddp keeps a whole copy of the model on every rank; fsdp shards it (FSDP2)
PARALLELISMS = ("ddp", "fsdp")


class WatchdogSpec(_Section):
    factor: float = Field(
        10.0, gt=1, le=10_000, description="A step this many times the recent median step time is a hang (at least floor_s)."
    )
    floor_s: float = Field(60.0, gt=0, le=MAX_INT, description="The shortest step that counts as a hang, in seconds.")
    straggler_factor: float = Field(
        1.5, gt=1, le=1_000, description="A rank whose own work per step is this many times the ranks' median is a straggler."
    )


class ProfileSpec(_Section):
    start_step: int = Field(10, ge=0, le=MAX_INT, description="The step at which the PyTorch profiler starts.")
    steps: int = Field(5, ge=1, le=1_000, description="Steps recorded (also what `lance-hpc profile JOB` records).")


class TrainSpec(_Section):
    epochs: int = Field(10, ge=1, le=MAX_INT, description="Passes over the training data.")
    max_steps: int | None = Field(None, ge=1, le=MAX_INT, description="Stop after this many optimizer steps (quick runs).")
    lr: float = Field(0.1, gt=0, description="Learning rate at base_batch_size.")
    lr_scaling: str = Field("linear", description="linear: lr * global_batch / base_batch_size; none: lr as given.")
    base_batch_size: int = Field(256, ge=1, le=MAX_INT, description="Global batch size at which lr applies.")
    warmup_epochs: float = Field(1.0, ge=0, le=MAX_INT, description="Linear warmup length, then cosine decay.")
    optimizer: str = Field("sgd", description="sgd (momentum, nesterov) or adamw.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(5e-5, ge=0, description="Weight decay.")
    precision: str = Field("bf16", description="bf16 autocast on GPU; CPU runs fp32.")
    grad_accum: int = Field(1, ge=1, le=MAX_INT, description="Micro-batches per optimizer step.")
    grad_clip: float | None = Field(
        None, gt=0, description="Clip the gradients' global norm to this before each optimizer step (none: no clipping)."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of model init and augmentation.")
    deterministic: bool = Field(False, description="Deterministic kernels (slower), for exact resume checks.")
    collective_timeout_s: int = Field(
        180, ge=10, le=MAX_INT, description="Seconds a collective may wait before the job fails with a clear error."
    )
    eval_every_epochs: int = Field(1, ge=1, le=MAX_INT, description="Evaluate every N epochs (and at the end).")
    watchdog: WatchdogSpec | None = Field(
        default_factory=WatchdogSpec,
        description="Name a stuck or slow rank, with every rank's stacks, before the collective timeout; null turns it off.",
    )
    profile: ProfileSpec | None = Field(
        None,
        description="Record a PyTorch profiler trace of a few steps (TensorBoard's profiler, Perfetto); null: only on request.",
    )
    parallelism: str = Field(
        "ddp",
        description="ddp: a whole model on every rank; fsdp: parameters, gradients and optimizer state sharded over the ranks (FSDP2).",
    )
    activation_checkpointing: bool = Field(
        False, description="fsdp: recompute each block's activations in the backward pass instead of keeping them."
    )
    compile: bool = Field(False, description="fsdp: torch.compile each block (the first steps are slower while it compiles).")
    cpu_offload: bool = Field(
        False, description="fsdp: keep parameters, gradients and optimizer state in host memory between uses."
    )

    check_parallelism = field_validator("parallelism")(_choice(lambda: PARALLELISMS))
    check_lr_scaling = field_validator("lr_scaling")(_choice(lambda: LR_SCALING))
    check_optimizer = field_validator("optimizer")(_choice(lambda: OPTIMIZERS))
    check_precision = field_validator("precision")(_choice(lambda: PRECISIONS))


class CheckpointSpec(_Section):
    dir: str = Field("checkpoints/{name}", description="Checkpoint directory.")
    every_steps: int = Field(500, ge=1, le=MAX_INT, description="Save every N optimizer steps (and at epoch end).")
    keep: int = Field(3, ge=1, le=MAX_INT, description="Checkpoints kept; older ones are deleted.")
    resume: bool = Field(True, description="Start from the latest checkpoint in dir if there is one.")
    async_save: bool = Field(
        False,
        description="train.parallelism fsdp: write sharded checkpoints in the background; the loop waits only for the copy off the device.",
    )


# logging.trackers: the package each needs (lance_hpc.runtime.trackers)
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class LoggingSpec(_Section):
    tensorboard_dir: str = Field("runs/{name}", description="TensorBoard event directory (rank 0 writes).")
    log_every_steps: int = Field(20, ge=1, le=MAX_INT, description="Log scalars every N steps.")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where rank 0 logs: tensorboard, wandb, mlflow (credentials and servers from their environment variables).",
    )
    group: str | None = Field(None, description="Groups runs in the trackers (a sweep sets it to the sweep's name).")

    @field_validator("trackers")
    @classmethod
    def check_trackers(cls, trackers: list[str]) -> list[str]:
        import importlib.util

        for tracker in trackers:
            if tracker not in TRACKERS:
                raise ValueError(f"unknown tracker {tracker!r}\n  fix: use some of {', '.join(TRACKERS)}")
            if importlib.util.find_spec(TRACKERS[tracker]) is None:
                raise ValueError(
                    f"the {tracker} tracker needs the {TRACKERS[tracker]} package, which is not installed here\n"
                    f"  fix: pip install {TRACKERS[tracker]} (on the cluster's Python too), or remove {tracker}"
                )
        if len(set(trackers)) != len(trackers):
            raise ValueError("a tracker is named twice")
        return trackers


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


class InferSpec(_Section):
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
        description="missing: compute the columns only for the rows that lack them (fragments appended since, or whose "
        "values are all null), keeping every value and file there, in one commit; refused for columns another "
        "checkpoint or function wrote, unless overwrite.",
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
        return None if refresh is None else _choice(lambda: REFRESH_MODES)(refresh)


class JobSpec(_Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Job name.")
    job: str = Field(
        "train",
        description="What the ranks run: train (the built-in loop, or entry); ingest (data.ingest's source into data.uri, "
        "its shards split between the ranks, one commit at the end); infer (a model over data.uri, new columns "
        "per fragment, one commit); evaluate (a checkpoint's metrics on data.uri); map (your function over batches "
        "of data.uri's columns, no model, new columns the same way); or an import path to your own "
        "JobKind subclass (my_pkg.kinds:MyKind or path/to/file.py:MyKind).",
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="Resources and submission.")
    data: DataSpec = Field(..., description="Dataset and loading strategy.")
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

    @model_validator(mode="after")
    def default_io_timeout(self) -> JobSpec:
        """data.io_timeout_s follows the collective timeout unless set: a rank retrying a read
        must give up before the others, waiting for it in a collective, time out."""
        if self.data.io_timeout_s is None:
            timeout = float(min(120, max(self.train.collective_timeout_s - 30, 1)))
            object.__setattr__(self, "data", self.data.model_copy(update={"io_timeout_s": timeout}))
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def redacted_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` for copies that leave the job's own spec file (its script, checkpoints,
        TensorBoard's hparams): credential-looking values replaced by a marker."""
        return redacted(self.to_dict())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
