"""Where the time and the requests of ``sampler: block`` go over object storage.

``python -m benchmarks.block_profile [--rounds 5] [--latency-ms 25]`` reads one epoch of the
benchmark's photos set (8,192 JPEGs, 224 px, batch 64, 2 workers) with block on local disk, block
over the S3 benchmark server and the default strategy on local disk, in interleaved rounds, each in
a fresh process. Per run: the steady rate after the first batch, the time to the first batch, and
the whole epoch. Over S3 the server writes a line per request
(``--request-log``), from which come the GET requests per image split by kind (runs of rows,
64 KiB footer reads when a worker opens a data file, and small reads of page metadata), and the
share of the epoch during which any request was in flight: a loader that waits for the store has
requests in flight most of the time, one bound by its decode has them only while it fills its
windows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.datasets import DataSetSpec, prepare
from benchmarks.s3_server import start_server

PHOTOS = DataSetSpec("photos", count=8192, image_size=224, batch_size=64)
WORKERS = 2
RUN_BYTES = 256 * 1024  # a GET at least this big reads a run of rows
FOOTER_BYTES = 64 * 1024  # what a worker reads of a data file's end when it opens it
# (label, storage, sampler)
CONFIGS = (
    ("block on local disk", "local", "block"),
    ("block over S3", "s3", "block"),
    ("default on local disk", "local", "distributed"),
)


def measure(fields: dict[str, Any]) -> dict[str, float]:
    """One epoch of the loader over ``fields`` (a DataSpec) in this process."""
    from lance_hpc.loading import build_train_loader
    from lance_hpc.spec import DataSpec
    from lance_hpc.tasks.image import ImageDecoder
    from lance_hpc.tasks.image_decode import Transform

    decoder = ImageDecoder("image", "label", Transform(PHOTOS.image_size, train=True, augment="none"))
    loader = build_train_loader(DataSpec.model_validate(fields), decoder, 0, 1)
    loader.set_epoch(0)
    started = time.perf_counter()
    first = last = 0.0
    images = 0
    for batch in loader:
        last = time.perf_counter()
        first = first or last
        images += len(batch["image"])
    after_first = images - PHOTOS.batch_size
    return {
        "images": images,
        "first_batch_s": first - started,
        "images_per_s": after_first / max(last - first, 1e-9),
        "epoch_s": last - started,
    }


def requests_of(log: Path, images: int) -> dict[str, float]:
    """GET requests per image by kind, and the share of time any request was in flight."""
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    gets = [int(row[4]) for row in rows if row[2] == "GET"]
    spans = np.array([[float(row[0]), float(row[1])] for row in rows])
    grid = np.arange(spans[:, 0].min(), spans[:, 1].max(), 0.01)
    busy = np.mean([np.any((spans[:, 0] <= moment) & (spans[:, 1] > moment)) for moment in grid]) if len(grid) else 0.0
    return {
        "gets_per_image": len(gets) / images,
        "run_gets_per_image": sum(size >= RUN_BYTES for size in gets) / images,
        "footer_gets_per_image": sum(size == FOOTER_BYTES for size in gets) / images,
        "small_gets_per_image": sum(size < RUN_BYTES and size != FOOTER_BYTES for size in gets) / images,
        "mb_per_run_get": float(np.median([size for size in gets if size >= RUN_BYTES] or [0])) / 2**20,
        "requests_in_flight_share": float(busy),
    }


def run_one(
    label: str, storage: str, sampler: str, lance_uri: str, data_dir: Path, latency_ms: float, work: Path
) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        uri=lance_uri, style="map", sampler=sampler, batch_size=PHOTOS.batch_size, num_workers=WORKERS, seed=0
    )
    server, log = None, work / "requests.log"
    if storage == "s3":
        log.unlink(missing_ok=True)
        server = start_server(data_dir, latency_ms=latency_ms, request_log=log)
        fields["uri"] = server.uri(str(Path(lance_uri).relative_to(data_dir)))
        fields["storage_options"] = server.storage_options()
    try:
        environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.block_profile", "--measure", json.dumps(fields)],
            capture_output=True,
            text=True,
            env=environment,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{label}: {done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if server is not None:
            result["server_cpu_s"] = server.cpu_seconds()
    finally:
        if server is not None:
            server.stop()
    if server is not None:
        result.update(requests_of(log, result["images"]))
    return {"label": label, **result}


def report(runs: list[dict[str, Any]], rounds: int) -> list[str]:
    by_label: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_label.setdefault(run["label"], []).append(run)
    lines = [f"{'configuration':24s} {'images/s (min-max)':>22s} {'first batch s':>14s} {'epoch s':>8s}"]
    for label, found in by_label.items():
        rates = [run["images_per_s"] for run in found]
        lines.append(
            f"{label:24s} {np.median(rates):>9,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) "
            f"{np.median([run['first_batch_s'] for run in found]):>14.2f} {np.median([run['epoch_s'] for run in found]):>8.1f}"
        )
    own, s3, default = (by_label[label] for label, _, _ in CONFIGS)
    for name, base in (("block over S3 vs block on local disk", own), ("block over S3 vs default on local disk", default)):
        ratios = [one["images_per_s"] / other["images_per_s"] for one, other in zip(s3, base)]
        lines.append(f"{name}: median {np.median(ratios):.2f}x; by round {', '.join(f'{r:.2f}x' for r in ratios)}")
    keys = ("gets_per_image", "run_gets_per_image", "footer_gets_per_image", "small_gets_per_image")
    parts = ", ".join(
        f"{key.replace('_per_image', '').replace('_', ' ')} {np.median([run[key] for run in s3]):.3f}" for key in keys
    )
    lines.append(f"block over S3, GET requests per image over the epoch: {parts}")
    lines.append(
        f"block over S3: {np.median([run['mb_per_run_get'] for run in s3]):.2f} MB per run GET; requests in flight "
        f"{np.median([run['requests_in_flight_share'] for run in s3]):.0%} of the epoch; server CPU "
        f"{np.median([run['server_cpu_s'] for run in s3]):.1f} s per epoch ({rounds} rounds)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.block_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory (default bench_out/)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--latency-ms", type=float, default=25.0, help="the S3 server's first-byte latency")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one run, in a process of its own
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return 0
    data_dir = (args.out / "data").resolve()
    data = prepare(PHOTOS, data_dir)
    work = args.out / "block_profile"
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_index in range(args.rounds):
        for label, storage, sampler in CONFIGS:
            runs.append(run_one(label, storage, sampler, data.lance_uri, data_dir, args.latency_ms, work))
            print(f"round {round_index + 1}/{args.rounds}: {label}: {runs[-1]['images_per_s']:,.0f} images/s", flush=True)
    lines = report(runs, args.rounds)
    print("\n".join(lines))
    (work / "results.json").write_text(json.dumps({"runs": runs, "report": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
