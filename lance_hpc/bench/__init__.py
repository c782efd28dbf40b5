"""Loader benchmark: one job spec's data pipeline measured and tuned (:mod:`lance_hpc.bench.job`),
and the measurement machinery the comparison with the peers (``benchmarks/``) shares.

``lance-hpc bench`` (and ``python -m lance_hpc.bench``) is :mod:`lance_hpc.cli.bench`. The
measurement and server processes (``python -m lance_hpc.bench._worker``) import this package
first, so it imports nothing itself.
"""
