"""Shared test setup: fixtures for the real SLURM cluster and the loopback S3 server live in
their own modules and are loaded here as plugins."""

import pytest

# jobs first: slurm and ranks import it, and a plugin imported before pytest registers it is not
# assertion-rewritten.
pytest_plugins = ["tests.support.jobs", "tests.support.slurm", "tests.support.s3", "tests.support.ranks", "tests.support.cpu"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the group marks this adds
def pytest_collection_modifyitems(items: list) -> None:
    """Under ``pytest -n`` (tests/run_all.sh), every test of the SLURM test cluster runs in one
    test process, which starts the cluster once; the other process runs the rest meanwhile."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))
