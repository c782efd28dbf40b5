"""The ``slurm`` section of a job spec, with its ``container``: resources, submission, and the
time limit in every form sbatch accepts."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from lance_hpc.spec.choices import CONTAINER_RUNTIMES
from lance_hpc.spec.section import MAX_INT, Section, choice

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


# A container mount as runtimes take it: /host/path:/container/path, optionally :ro or :rw.
MOUNT_PATTERN = re.compile(r"^/[^:,]*(?::/[^:,]*(?::(?:ro|rw))?)?$")


class ContainerSpec(Section):
    image: str = Field(
        ..., min_length=1, description="Image: an Apptainer .sif path or docker:// URI, or an enroot image for pyxis."
    )
    runtime: str = Field("apptainer", description="apptainer (srun apptainer exec IMAGE ...) or pyxis (srun --container-image).")
    mounts: list[str] = Field(
        default_factory=list,
        description="Host paths visible in the container: /host:/container[:ro]; data, checkpoints and logs.",
    )
    workdir: str | None = Field(None, description="Working directory inside the container; null: the runtime's default.")

    check_runtime = field_validator("runtime")(choice(lambda: CONTAINER_RUNTIMES))

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


class SlurmSpec(Section):
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
