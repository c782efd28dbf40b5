"""One measurement in a fresh process: ``python -m lance_hpc.bench._worker CONFIG_JSON``.

Builds the pipeline the configuration names, takes the first batch (its time from the start of
building is the time to first batch), then reads until the measuring window or the epoch ends and
reports the steady rate after the first batch, with the peak memory of this process and of its
DataLoader workers. It writes a :class:`Result` as JSON to ``config.result_path``.

With ``world_size > 1`` this process is one rank of a gloo process group: every step all-reduces
a "still have a batch" flag, as DDP's gradient all-reduce would, so ranks that take different step
counts show up as an error instead of a hang.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.bench.pipeline import batch_images, lance_hpc_loader
from lance_hpc.bench.resources import ResourceSampler, command_line, descendants
from lance_hpc.storage.files import write_file

# Bytes from each end of an image that go into its fingerprint (1.5 rows of a 224 px image): enough
# to tell crops apart, and cheap for the consumer, which reads two pages of each image, not all.
FINGERPRINT_BYTES = 1024
# Images the decode limit cycles through (read once, decoded again and again).
DECODE_SAMPLE = 256


class TrainStep(Protocol):
    """One training step per batch (a model on a device), timed with the loader that feeds it."""

    device_name: str

    def __call__(self, batch: Any) -> None: ...


class StoreWindow(Protocol):
    """An object store's counters over the measured window (requests, bytes, ...)."""

    def start(self) -> None: ...

    def end(self) -> dict[str, float]: ...


def import_lance_hpc(config: Measurement) -> None:
    """Import what the pipeline needs before the clock starts: a training script has torch,
    torchvision and its data library loaded long before it asks for the first batch."""
    import lance  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    import lance_hpc.loading  # noqa: F401


def _no_training(config: Measurement) -> None:
    if config.train_model:
        raise ValueError(f"this worker trains no model ({config.train_model!r}): run it with benchmarks.worker")


@dataclass
class Pipelines:
    """What a worker process can measure. This package's worker measures lance_hpc's loader; the
    repository's comparison benchmarks (``benchmarks/worker.py``) add the peers' pipelines, a
    training step and the benchmark S3 server's counters."""

    build: Callable[[Measurement], Iterable[Any]] = lance_hpc_loader
    prepare: Callable[[Measurement], None] = import_lance_hpc
    # A model trained one step per batch (already warmed up), or None: the loader alone.
    train_step: Callable[[Measurement], TrainStep | None] = lambda config: _no_training(config)
    # The store's counters over the window, or None.
    store_window: Callable[[Measurement], StoreWindow | None] = lambda config: None
    # Kinds measured whole rather than batch by batch (an ingest, say): kind -> its measurement.
    whole: dict[str, Callable[[Measurement], Result]] = field(default_factory=dict)


def queued_per_worker(config: Measurement) -> int:
    """The batches a DataLoader worker holds ready: the measurement's data.prefetch_factor."""
    from lance_hpc.spec import DataSpec

    return int(config.data.get("prefetch_factor", DataSpec.model_fields["prefetch_factor"].default))


def fingerprints(images: Any) -> list[str]:
    """A short hash per image of its first and last bytes: equal images, equal strings. The
    exactly-once check compares multisets of these, so images that happen to be equal still count."""
    import torch

    if images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last):
        images = images.permute(0, 2, 3, 1)  # memory order, so the rows below are views, not copies
    # numpy, not torch: a torch op here would wake the intra-op thread pool, whose spinning threads
    # take CPU from the DataLoader workers being measured.
    flat = images.numpy().reshape(images.shape[0], -1)
    return [
        hashlib.blake2b(row[:FINGERPRINT_BYTES].tobytes() + row[-FINGERPRINT_BYTES:].tobytes(), digest_size=8).hexdigest()
        for row in flat
    ]


def decode_limit(config: Measurement) -> Result:
    """One core decoding and resizing the same image bytes in a tight loop, times ``config.cores``.

    It runs lance_hpc's own decode and resize, the work no loader can avoid, so the ratio to it is
    what the loader costs on top."""
    import numpy as np
    import torch

    from lance_hpc.storage.datasets import open_dataset
    from lance_hpc.storage.options import storage_options
    from lance_hpc.tasks.image_decode import Transform, decode_pixels

    torch.set_num_threads(1)
    options = storage_options(config.lance_uri, config.data.get("storage_options"))  # credentials from the environment
    dataset = open_dataset(config.lance_uri, config.data.get("version"), options)
    rows = min(DECODE_SAMPLE, dataset.count_rows())
    column = config.image_column
    encoded = dataset.take(list(range(rows)), columns=[column]).column(column).to_pylist()
    transform = Transform(config.image_size, augment="none")
    rng = np.random.default_rng(0)

    def decode(data: bytes) -> torch.Tensor:
        return transform(decode_pixels(data), rng)

    decode(encoded[0])  # warm up kernels and allocations
    images, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < config.seconds:
        for data in encoded:
            decode(data)
        images += len(encoded)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=images / elapsed * config.cores,
        first_batch_s=0.0,
        images=images,
        batches=0,
        seconds=elapsed,
        main_rss_mib=0.0,
        worker_rss_mib=0.0,
        worker_growth_mib=0.0,
        cpu_ms_per_image=1000 * cpu / images,
    )


class _Lockstep:
    """Every step, all ranks agree whether each still has a batch (one small all-reduce)."""

    def __init__(self, config: Measurement) -> None:
        import torch
        import torch.distributed as dist

        self.world_size = config.world_size
        self.dist = dist
        self.torch = torch
        if self.world_size > 1:
            dist.init_process_group("gloo", rank=config.rank, world_size=config.world_size, timeout=timedelta(seconds=120))

    def all_have_batch(self, have_batch: bool) -> bool:
        """True when every rank has a batch; raises when some do and some do not."""
        if self.world_size == 1:
            return have_batch
        flag = self.torch.tensor([1 if have_batch else 0])
        self.dist.all_reduce(flag)
        count = int(flag.item())
        if 0 < count < self.world_size:
            raise RuntimeError(
                f"ranks took different numbers of steps: {count} of {self.world_size} still had a batch"
                " (real DDP would hang here in the gradient all-reduce)"
            )
        return count == self.world_size

    def close(self) -> None:
        if self.world_size > 1:
            self.dist.barrier()
            self.dist.destroy_process_group()


def measure(config: Measurement, pipelines: Pipelines) -> Result:
    """Time to first batch, then the steady rate over the window (or the whole epoch)."""
    pipelines.prepare(config)
    lockstep = _Lockstep(config)
    store = pipelines.store_window(config)
    seen: list[str] = []
    train_step = pipelines.train_step(config)  # built before any loader starts
    with ResourceSampler() as resources:
        start = time.perf_counter()
        pipeline = pipelines.build(config)
        batches: Iterator[Any] = iter(pipeline)
        first = next(batches, None)
        if not lockstep.all_have_batch(first is not None):
            raise RuntimeError("the pipeline yielded no batch")
        # After the first all-reduce: in DDP, every rank's clock starts when the slowest has its batch.
        if train_step is not None:
            # The batches the workers queued while the first was on its way are trained on untimed:
            # the window then shows whether the loader keeps up, not how much it had stored.
            train_step(first)
            for _ in range(config.num_workers * queued_per_worker(config)):
                first = next(batches, None)
                if first is None:
                    raise RuntimeError("the epoch ended before the loader's queue was drained")
                train_step(first)
        first_at = time.perf_counter()
        at_first = resources.mark()
        if store:
            store.start()
        if config.fingerprint:
            seen += fingerprints(batch_images(first))
        images = count = 0
        epoch_done = False
        batch = first
        waited = 0.0
        while config.full_epoch or time.perf_counter() - first_at < config.seconds:
            asked = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - asked
            if not lockstep.all_have_batch(batch is not None):
                epoch_done = True
                break
            if train_step is not None:
                train_step(batch)
            image_tensor = batch_images(batch)
            images += int(image_tensor.shape[0])
            count += 1
            if config.fingerprint:
                seen += fingerprints(image_tensor)
        end = time.perf_counter()
        at_end = resources.mark()
        store_window = store.end() if store else {}
    lockstep.close()
    _stop_workers()
    elapsed = end - first_at
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=images / elapsed if elapsed > 0 else 0.0,
        first_batch_s=first_at - start,
        images=images,
        batches=count,
        seconds=elapsed,
        rank=config.rank,
        world_size=config.world_size,
        epoch_done=epoch_done,
        fingerprints=seen,
        worker_rss_timeline=resources.worker_timeline(at_first),
        store=store_window,
        data_wait_share=waited / elapsed if train_step is not None and elapsed > 0 else 0.0,
        device_name=train_step.device_name if train_step is not None else "",
        **resources.summary(at_first, at_end, images),
    )


def _stop_workers() -> None:
    """Kill this process's DataLoader workers once measured: a graceful shutdown takes seconds per
    configuration (worker joins, Lance and torch teardown) and measures nothing. The resource
    tracker is left to clean up after this process exits."""
    workers = [pid for pid in descendants(os.getpid()) if "resource_tracker" not in command_line(pid)]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would report the kills as worker failures
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in workers:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # not a direct child, or already reaped
            pass
    # A worker killed while torch was creating a shared-memory batch leaves its segment behind
    # (torch unlinks it right after creation); the name carries the creating pid.
    for pid in workers:
        for leftover in glob.glob(f"/dev/shm/torch_{pid}_*"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


def run(config: Measurement, pipelines: Pipelines) -> Result:
    if config.kind == "decode_limit":
        return decode_limit(config)
    if config.kind in pipelines.whole:
        return pipelines.whole[config.kind](config)
    return measure(config, pipelines)


def main(argv: list[str] | None = None, pipelines: Pipelines | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = Measurement.from_json(argv[0])
    try:
        result = run(config, pipelines or Pipelines())
        status = 0
    except Exception:  # the parent reports it in the table; the traceback goes to stderr
        traceback.print_exc()
        result = Result(
            config.label,
            config.dataset,
            0.0,
            0.0,
            0,
            0,
            0.0,
            0.0,
            0.0,
            0.0,
            rank=config.rank,
            world_size=config.world_size,
            error=traceback.format_exc(limit=3),
        )
        status = 1
    write_file(Path(config.result_path), json.dumps(asdict(result)))
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch and Lance (a second or two; nothing to measure)
