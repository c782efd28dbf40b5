"""Shared test setup: fixtures for the real SLURM cluster and the loopback S3 server live in
their own modules and are loaded here as plugins."""

pytest_plugins = ["tests.support.slurm", "tests.support.s3", "tests.support.jobs", "tests.support.ranks"]
