"""Fixture for the real SLURM test cluster: munged, slurmctld and two slurmd on loopback.

Usage: ``def test_x(slurm_cluster): subprocess.run(["sbatch", ...], env={**os.environ,
**slurm_cluster.env})``. ``slurm_cluster.workdir`` holds the config and the daemons' logs, and
``slurm_cluster.partition`` is the partition to submit to.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from tests.support import slurm_cluster as cluster_module


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
