"""lance_hpc's loaders measured against the peers a user would otherwise pick.

``python -m benchmarks [--sections local,object_storage,peers,gpu]`` from the repository root (see
the README's Benchmarks section). The measuring machinery (fresh worker processes, interleaved
rounds, the tables) is lance_hpc's own (``lance_hpc.bench``, which also measures a user's job spec);
this package adds the peers' pipelines, the benchmark data sets, the S3 benchmark server and each
section's report.
"""
