"""Fixture for the real SLURM test cluster: munged, slurmctld and two slurmd on loopback.

Usage: ``def test_x(slurm_cluster): subprocess.run(["sbatch", ...], env={**os.environ,
**slurm_cluster.env})``. ``slurm_cluster.workdir`` holds the config and the daemons' logs, and
``slurm_cluster.partition`` is the partition to submit to.

Also what the tests do to the cluster's jobs: signal their steps, read a job's fields from
``scontrol``, and wait for jobs to end or for a marker in a job's log.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from lance_hpc.launch.render import write_job_files
from lance_hpc.slurm.queue import FINAL_STATES
from lance_hpc.spec import JobSpec
from tests.support import slurm_cluster as cluster_module
from tests.support.jobs import REPO_ROOT


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[cluster_module.SlurmCluster]:
    # Not pytest's tmp_path: munged needs every directory above its socket searchable by all.
    # The directory stays after the session, with the daemons' logs in it.
    cluster = cluster_module.start(Path(tempfile.mkdtemp(prefix="lance_hpc_slurm_")))
    try:
        yield cluster
    finally:
        cluster_module.stop(cluster)


def signal_steps(env: Mapping[str, str], job_id: str, signal_name: str = "USR2") -> None:
    """Signal the running steps of a job once each, as ``lance-hpc cancel`` does: ``scancel
    --signal`` given the job id keeps retrying while the job requeues itself on that signal, and a
    retry then stops the requeued run too."""
    listed = subprocess.run(
        ["squeue", "--steps", "--jobs", job_id, "-h", "-o", "%i"], env=env, capture_output=True, text=True, check=True
    )
    steps = [step for step in listed.stdout.split() if step.rpartition(".")[2].isdigit()]
    assert steps, f"job {job_id} has no running step to signal: {listed.stdout!r}"
    for step in steps:
        subprocess.run(["scancel", f"--signal={signal_name}", step], env=env, check=True)


def environ(cluster: cluster_module.SlurmCluster) -> dict[str, str]:
    """This process's environment, pointed at ``cluster``, with the repository importable."""
    return {**os.environ, **cluster.env, "PYTHONPATH": str(REPO_ROOT)}


def job_fields(cluster: cluster_module.SlurmCluster, job: str) -> dict[str, str]:
    """What ``scontrol show job`` says of ``job``, field by field (empty once SLURM forgot it)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=environ(cluster), capture_output=True, text=True).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def wait_for_runs(cluster: cluster_module.SlurmCluster, jobs: list[str], timeout_s: float) -> dict[str, str]:
    """Wait until every job in ``jobs`` is in a final state and return the states; past
    ``timeout_s``, cancel the (array) job and fail, showing each job's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {job: job_fields(cluster, job).get("JobState", "UNKNOWN") for job in jobs}
        if all(state in FINAL_STATES for state in states.values()):
            return states
        time.sleep(1)
    logs = "\n".join(job_log(cluster, job) for job in jobs)  # before scancel: SLURM forgets a job soon after
    subprocess.run(["scancel", jobs[0].split("_")[0]], env=environ(cluster))
    raise AssertionError(f"runs {jobs} did not end within {timeout_s} s: {states}\n{logs}")


def job_log(cluster: cluster_module.SlurmCluster, job: str, lines: int = 60) -> str:
    """The end of a job's stdout and stderr, found where SLURM says it writes them (sbatch's and
    submitit's jobs alike), for the message of a test that fails on a cluster job."""
    fields = job_fields(cluster, job)
    shown = []
    for name in dict.fromkeys(fields.get(key, "") for key in ("StdOut", "StdErr")):
        # submitit writes a file per task, JOB_TASK_log.out; scontrol names task 0's (or %t)
        pattern = re.sub(rf"^{re.escape(job)}_(\d+|%t)_log\.", f"{job}_*_log.", Path(name).name.replace("%t", "*"))
        paths = sorted(Path(name).parent.glob(pattern)) if name else []
        for path in paths or [Path(name or "(SLURM shows no log file)")]:
            tail = path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else ["(not written)"]
            shown += [f"--- job {job}: {path}", *tail]
    return "\n".join(shown or [f"--- job {job}: SLURM no longer knows it, so its log cannot be found"])


def wait_for_text(path: Path, marker: str, timeout_s: float = 300, count: int = 1) -> None:
    """Wait until the file at ``path`` (a job's log, say) contains ``marker`` (``count`` times);
    past ``timeout_s``, fail showing the end of the file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(marker) >= count:
            return
        time.sleep(0.5)
    tail = path.read_text(errors="replace").splitlines()[-60:] if path.exists() else ["(not written)"]
    raise AssertionError(f"{marker!r} never appeared {count} time(s) in {path}; its end:\n" + "\n".join(tail))


def sbatch(cluster: cluster_module.SlurmCluster, spec: JobSpec) -> str:
    """Render and submit the job as a user's own sbatch would; returns the job id."""
    _, script = write_job_files(spec)
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=environ(cluster), cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert submitted.returncode == 0, f"sbatch refused {script}: {submitted.stderr}"
    return submitted.stdout.strip().split(";")[0]


def is_rank_command(command: list[bytes]) -> bool:
    """A /proc cmdline (split at NUL) of a rank itself, ``python3 -P -m lance_hpc.run SPEC``: not the
    srun that started it, whose command line names the same and whose environment (the batch
    step's) says SLURM_PROCID=0 as well."""
    return os.path.basename(command[0]).startswith(b"python") and command[1:4] == [b"-P", b"-m", b"lance_hpc.run"]


def is_standby(environ: list[bytes] | set[bytes]) -> bool:
    """Whether a rank's /proc environ (split at NUL) is that of a standby rank, started ahead of a
    restart and waiting (lance_hpc.kinds.standby.wait_if_standby): not one that is running."""
    return any(entry.startswith(b"LANCE_HPC_STANDBY=") for entry in environ)


def lance_hpc(
    cluster: cluster_module.SlurmCluster,
    *args: str,
    check_rc: int | None = 0,
    timeout_s: float = 300,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real command line (``lance-hpc ARGS``) against ``cluster``, as a user on the login
    node would (in ``env``, else :func:`environ`); with ``check_rc``, fail showing its output unless
    it exits so."""
    result = subprocess.run(
        [sys.executable, "-m", "lance_hpc", *args],
        env=dict(env or environ(cluster)),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if check_rc is not None:
        assert result.returncode == check_rc, f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result
