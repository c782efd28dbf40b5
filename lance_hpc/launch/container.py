"""Container runtimes: how srun starts a task inside ``slurm.container``.

Each runtime is one function from the spec to the srun options it adds and the words that go
before ``python3 -m lance_hpc.run``; :data:`RUNTIMES` implements the names in
:data:`lance_hpc.spec.choices.CONTAINER_RUNTIMES`. Both the
sbatch script and submitit use them, so the two paths start the same container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lance_hpc.spec.choices import CONTAINER_RUNTIMES, check_registry
from lance_hpc.spec.schema import ContainerSpec, SlurmSpec


@dataclass(frozen=True)
class ContainerLaunch:
    """What a runtime adds to the launch: srun options, and a prefix of the task's command."""

    srun_args: tuple[str, ...] = ()
    command_prefix: tuple[str, ...] = ()


def apptainer(container: ContainerSpec, slurm: SlurmSpec) -> ContainerLaunch:
    """``srun apptainer exec [--nv] [--bind ...] [--pwd DIR] IMAGE python3 ...``; apptainer passes
    the host environment, so every SLURM_* variable reaches the rank."""
    options = ["--nv"] if slurm.gpus_per_node else []  # the host's NVIDIA driver inside the container
    if container.mounts:
        options.append(f"--bind={','.join(container.mounts)}")
    if container.workdir:
        options.append(f"--pwd={container.workdir}")
    return ContainerLaunch(command_prefix=("apptainer", "exec", *options, container.image))


def pyxis(container: ContainerSpec, slurm: SlurmSpec) -> ContainerLaunch:
    """pyxis (NVIDIA's SPANK plugin over enroot): ``srun --container-image=IMAGE ... python3 ...``."""
    options = [f"--container-image={container.image}"]
    if container.mounts:
        options.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir:
        options.append(f"--container-workdir={container.workdir}")
    return ContainerLaunch(srun_args=tuple(options))


RUNTIMES: dict[str, Callable[[ContainerSpec, SlurmSpec], ContainerLaunch]] = {"apptainer": apptainer, "pyxis": pyxis}
check_registry(RUNTIMES, CONTAINER_RUNTIMES, "slurm.container.runtime")


def container_launch(slurm: SlurmSpec) -> ContainerLaunch:
    """The launch additions of the spec's container; nothing for a job on the host."""
    if slurm.container is None:
        return ContainerLaunch()
    return RUNTIMES[slurm.container.runtime](slurm.container, slurm)
