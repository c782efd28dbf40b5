"""Fixture for the real SLURM test cluster."""
