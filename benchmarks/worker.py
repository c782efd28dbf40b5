"""One comparison measurement in a fresh process: ``python -m benchmarks.worker CONFIG_JSON``.

lance_hpc's measuring worker (``lance_hpc.bench._worker``), given the peers' pipelines, the GPU
section's training step and the benchmark S3 server's counters.
"""

from __future__ import annotations

import os
import sys

from benchmarks import infer, ingest, loader_library, map_job, refresh, restarts, sharded, shuffle_quality, text_ingest
from benchmarks.gpu import TrainStep, synthetic_batches
from benchmarks.pipelines import build_pipeline, import_modules
from benchmarks.s3_server import EpochCounterWindow
from lance_hpc.bench import _worker
from lance_hpc.bench.configs import Measurement

# Run measurements with ``run_rounds(..., worker=WORKER)``.
WORKER = "benchmarks.worker"


def train_step(config: Measurement) -> TrainStep | None:
    """``config.train_model`` built, and its kernels chosen on a synthetic batch, before any loader starts."""
    if not config.train_model:
        return None
    step = TrainStep(config)
    warm_up = next(synthetic_batches(config))
    for _ in range(2):
        step(warm_up)
    return step


def store_window(config: Measurement) -> EpochCounterWindow | None:
    """The S3 server's counters over the window, and (``epoch_*``) since the loader began."""
    return EpochCounterWindow(config.data["storage_options"]["endpoint"]) if config.store_counters else None


PIPELINES = _worker.Pipelines(
    build=build_pipeline,
    prepare=import_modules,
    train_step=train_step,
    store_window=store_window,
    whole={
        **dict.fromkeys(ingest.RUNNERS, ingest.measure),
        **dict.fromkeys(text_ingest.RUNNERS, text_ingest.measure),
        **dict.fromkeys(infer.RUNNERS, infer.measure),
        **dict.fromkeys(refresh.RUNNERS, refresh.measure),
        **dict.fromkeys(map_job.RUNNERS, map_job.measure),
        **dict.fromkeys(loader_library.LOOPS, loader_library.measure),
        shuffle_quality.TRAIN_KIND: shuffle_quality.measure,
        sharded.KIND: sharded.measure,
        restarts.KIND: restarts.measure,
    },
)


if __name__ == "__main__":
    code = _worker.main(sys.argv[1:], PIPELINES)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as lance_hpc's worker: skip the interpreter's teardown of torch and Lance
