"""Where a job's files go, and how lance_hpc writes them.

:class:`JobPaths` is the one answer for a spec: the resolved spec its tasks read
(``<log_dir>/<name>.spec.yaml``), the sbatch script (``<log_dir>/<name>.sbatch``), a sweep's run
specs (``<log_dir>/<name>.sweep/<index>.spec.yaml``), the restart supervisor the script runs
(``<log_dir>/<name>.restarts.pyz``) and its records (``<log_dir>/<name>.attempts/<job id>/``), the
job's SLURM logs (``%j`` the job id, ``%A_%a`` a sweep's array job and task id, as
:func:`job_reference` names the job at run time; requeues append to them) and submitit's folder.

The resolved spec and the script say everything the job does (its paths, its setup lines), and the
job's tasks run whatever the spec file says: only their owner may read or change them. Files are
written 0600 (:func:`write_private`), and a directory lance_hpc creates for them is 0700.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lance_hpc.spec import JobSpec
from lance_hpc.spec.load import check_owned
from lance_hpc.storage.files import write_file

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# In a sweep's run spec path, where the array task id goes.
ARRAY_INDEX = "{index}"


@dataclass(frozen=True)
class JobPaths:
    """The files of one job (or of one sweep: one job array)."""

    spec_file: Path
    script: Path
    run_specs: str  # a sweep's run specs, with ARRAY_INDEX for the run's index
    stdout: str
    stderr: str
    submitit_folder: Path
    restarts_program: Path  # the supervisor of restarts inside the allocation (lance_hpc.launch.restarts)
    attempts: Path  # its records, one directory per job (or array task) id

    @classmethod
    def of(cls, spec: JobSpec) -> JobPaths:
        log_dir = Path(spec.slurm.log_dir)
        logs = f"{spec.slurm.log_dir}/{spec.name}-{'%A_%a' if spec.sweep else '%j'}"
        return cls(
            spec_file=log_dir / f"{spec.name}.spec.yaml",
            script=log_dir / f"{spec.name}.sbatch",
            run_specs=f"{spec.slurm.log_dir}/{spec.name}.sweep/{ARRAY_INDEX}.spec.yaml",
            stdout=f"{logs}.out",
            stderr=f"{logs}.err",
            submitit_folder=log_dir / "submitit",
            restarts_program=log_dir / f"{spec.name}.restarts.pyz",
            attempts=log_dir / f"{spec.name}.attempts",
        )

    def run_spec(self, index: int) -> Path:
        """The spec file of a sweep's run ``index``."""
        return Path(self.run_specs.replace(ARRAY_INDEX, str(index)))

    def task_spec(self, sweep: bool) -> str:
        """What each task of the job reads: the spec file, or a sweep's run spec by array index."""
        return self.run_specs if sweep else str(self.spec_file)


def job_reference(spec: JobSpec) -> str:
    """The job as its batch script names it at run time (shell text): the job id, or a sweep run's
    ARRAYID_TASKID, as its log files are named."""
    return "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" if spec.sweep else "$SLURM_JOB_ID"


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents readable by their owner alone (0700). One that
    exists keeps the mode its owner chose: a group's shared log directory stays shared, while the
    files lance_hpc writes into it are private anyway."""
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    for path in reversed(missing):
        path.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)


def write_private(path: Path, text: str | bytes) -> None:
    """Replace ``path`` by a file holding ``text``, readable and writable by its owner alone (0600).

    The text is written to a fresh temporary file (0600, an unguessable name, never an existing
    file or link), fsynced and renamed over ``path``: a link planted there is replaced, not
    followed, and an earlier file's mode does not carry over. Another user's file there is refused: in a shared log
    directory it is their job's spec or script, and their requeued job would run ours.
    """
    try:
        check_owned(
            os.lstat(path),
            path,
            "its job reads it when it runs or is requeued, so replacing it would make that job run your spec",
            "set another slurm.log_dir, or give your job another name",
        )
    except FileNotFoundError:
        pass
    write_file(path, text, mode=PRIVATE_FILE_MODE)
