"""Loader benchmark: lance_hpc's strategies against the peers, or one job spec's data pipeline.

``python -m lance_hpc.bench [job.yaml]``; ``main(argv)`` is what ``lance-hpc bench`` calls.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # Imported on call: the measurement and server processes (``python -m lance_hpc.bench._worker``,
    # ``.s3_server``) import this package first and need none of the command line's modules.
    from lance_hpc.bench.cli import main as run

    return run(argv)


__all__ = ["main"]
