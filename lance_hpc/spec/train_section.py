"""The ``train``, ``checkpoint`` and ``logging`` sections of a job spec: optimisation, the
watchdog and profiler, checkpoints, and where metrics go."""

from __future__ import annotations

from pydantic import Field, field_validator

from lance_hpc.spec.section import MAX_INT, MAX_SEED, Section, choice

# Optimisation choices; the trainer reads the same tuples.
LR_SCALING = ("linear", "none")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("bf16", "fp32")
# train.parallelism: ddp keeps a whole copy of the model on every rank; fsdp shards it (FSDP2)
PARALLELISMS = ("ddp", "fsdp")


class WatchdogSpec(Section):
    factor: float = Field(
        10.0, gt=1, le=10_000, description="A step this many times the recent median step time is a hang (at least floor_s)."
    )
    floor_s: float = Field(60.0, gt=0, le=MAX_INT, description="The shortest step that counts as a hang, in seconds.")
    straggler_factor: float = Field(
        1.5, gt=1, le=1_000, description="A rank whose own work per step is this many times the ranks' median is a straggler."
    )


class ProfileSpec(Section):
    start_step: int = Field(10, ge=0, le=MAX_INT, description="The step at which the PyTorch profiler starts.")
    steps: int = Field(5, ge=1, le=1_000, description="Steps recorded (also what `lance-hpc profile JOB` records).")


class TrainSpec(Section):
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

    check_parallelism = field_validator("parallelism")(choice(lambda: PARALLELISMS))
    check_lr_scaling = field_validator("lr_scaling")(choice(lambda: LR_SCALING))
    check_optimizer = field_validator("optimizer")(choice(lambda: OPTIMIZERS))
    check_precision = field_validator("precision")(choice(lambda: PRECISIONS))


class CheckpointSpec(Section):
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


class LoggingSpec(Section):
    tensorboard_dir: str = Field("runs/{name}", description="TensorBoard event directory (rank 0 writes).")
    log_every_steps: int = Field(20, ge=1, le=MAX_INT, description="Log scalars every N steps.")
    progress: bool = Field(
        True,
        description="Show progress on rank 0: a bar on a terminal; in a log file, a plain line every 30 s and at each epoch's end.",
    )
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
