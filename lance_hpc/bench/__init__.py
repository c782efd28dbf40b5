"""Loader benchmark: lance_hpc's strategies against the peers, or one job spec's data pipeline.

``python -m lance_hpc.bench [job.yaml]``; ``main(argv)`` is what ``lance-hpc bench`` calls.
"""

from lance_hpc.bench.cli import main

__all__ = ["main"]
