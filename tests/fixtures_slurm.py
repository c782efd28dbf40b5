"""Fixture for the real SLURM test cluster: munged, slurmctld and two slurmd on loopback.

Usage: ``def test_x(slurm_cluster): subprocess.run(["sbatch", ...], env={**os.environ,
**slurm_cluster.env})``. ``slurm_cluster.workdir`` holds the config and the daemons' logs, and
``slurm_cluster.partition`` is the partition to submit to.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from lance_hpc import slurm_cluster as cluster_module


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[cluster_module.SlurmCluster]:
    # Not pytest's tmp_path: munged needs every directory above its socket searchable by all.
    # The directory stays after the session, with the daemons' logs in it.
    cluster = cluster_module.start(Path(tempfile.mkdtemp(prefix="lance_hpc_slurm_")))
    try:
        yield cluster
    finally:
        cluster_module.stop(cluster)
