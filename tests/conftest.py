"""Shared test setup: fixtures for the real SLURM cluster and the loopback S3 server live in
their own modules and are loaded here as plugins."""

# jobs first: slurm and ranks import it, and a plugin imported before pytest registers it is not
# assertion-rewritten.
pytest_plugins = ["tests.support.jobs", "tests.support.slurm", "tests.support.s3", "tests.support.ranks"]
