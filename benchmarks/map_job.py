"""The map section: ``job: map`` of a cheap function over the photos against the data pipeline it reads through.

Two measurements on the main data set, each in a fresh process, interleaved:
- the data pipeline alone: every fragment's ``image`` column read straight from Lance in batches of
  :data:`BATCH` rows, in row order, as the job reads them (``LanceFragment.to_batches``), nothing else;
- lance_hpc's map job (``job: map`` on one local rank, on a fresh copy of the photos): the same batches
  through :func:`image_bytes` (each image's encoded size, one ``pyarrow.compute`` call), the column
  written as one new data file per fragment and one commit.

Both rates are rows over the loop over the fragments: the pipeline's from its first read to its last
batch, the job's from its fragment records (read, function, write of each fragment), so neither counts
starting Python; the job's whole command (Python's start, the checks, the plan and the commit with it)
is reported beside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import yaml

from benchmarks import report
from benchmarks.ingest import timed
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result

BATCH = 256  # rows per batch, the job's data.batch_size and the pipeline's
COLUMNS = ["image"]
PIPELINE = "the data pipeline alone: image column of each fragment in batches (1 process)"
JOB = "lance_hpc job: map, image_bytes (1 rank)"
TARGET = 0.9  # the job's rows/s against the pipeline alone's, at least
LOOP_S: dict[str, float] = {}  # each measurement's loop over the fragments, by label
COMMAND_S: dict[str, float] = {}  # the job's whole command, by label


def image_bytes(batch: pa.RecordBatch) -> dict[str, Any]:
    """``infer.function`` of the job: each image's encoded size in bytes."""
    return {"image_bytes": pc.binary_length(batch.column("image"))}


def _run_pipeline(config: Measurement, out: Path) -> int:
    import lance

    started = time.perf_counter()
    dataset = lance.dataset(config.data["lance_uri"])
    rows = 0
    for fragment in dataset.get_fragments():
        for batch in fragment.to_batches(batch_size=BATCH, columns=COLUMNS):
            rows += batch.num_rows
    LOOP_S[config.label] = time.perf_counter() - started
    return rows


def _spec(uri: Path, out: Path) -> Path:
    raw = {
        "name": "bench_map",
        "job": "map",
        "slurm": {"tasks_per_node": 1, "log_dir": str(out / "logs")},
        "data": {"uri": str(uri), "batch_size": BATCH},
        "logging": {"tensorboard_dir": str(out / "runs"), "progress": False},
        "infer": {"function": "benchmarks.map_job:image_bytes", "columns": COLUMNS, "outputs": {"image_bytes": "int32"}},
    }
    path = out / "map.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _run_job(config: Measurement, out: Path) -> int:
    uri = out / "photos.lance"
    shutil.copytree(config.data["lance_uri"], uri)
    root = Path(__file__).parents[1]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", str(_spec(uri, out)), "--local", "--nproc", "1"], env=environ, cwd=root
    )
    COMMAND_S[config.label] = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError("the map job failed (its output is above)")
    records = [json.loads(path.read_text()) for path in out.glob(".photos.lance.infer/*/fragment-*.json")]
    LOOP_S[config.label] = sum(record["seconds"] for record in records)
    return sum(record["rows"] for record in records)


RUNNERS: dict[str, Callable[[Measurement, Path], int]] = {"map_pipeline": _run_pipeline, "map_job": _run_job}


def measure(config: Measurement) -> Result:
    result = timed(config, RUNNERS[config.kind])
    if LOOP_S.get(config.label):  # rows/s of the loop over the fragments; seconds the job's whole command
        result.images_per_s = result.images / LOOP_S[config.label]
        result.seconds = COMMAND_S.get(config.label, LOOP_S[config.label])
    return result


def configs(context: Context) -> list[Measurement]:
    data = context.sets[0]
    common: dict[str, Any] = dict(dataset=f"{data.spec.name}-map", num_workers=0)
    work = str(context.out / "map_work")
    return [
        Measurement(label, kind, data={"out": work, "lance_uri": data.lance_uri}, **common)
        for label, kind in ((PIPELINE, "map_pipeline"), (JOB, "map_job"))
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    data = context.sets[0]
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == f"{data.spec.name}-map"}
    pipeline = found.get(PIPELINE)
    header = ["configuration", "rows", "rows/s (min-max)", "x pipeline alone", "command s"]
    cells = []
    for label, summary in found.items():
        ok = bool(summary.ok_runs)
        rows = summary.ok_runs[0][0].images if ok else 0
        command = min(run[0].seconds for run in summary.ok_runs) if ok and label == JOB else 0.0
        cells.append(
            [
                label,
                f"{rows:,}" if ok else "-",
                report.rate_text(summary),
                report.ratio_text(summary.images_per_s, pipeline.images_per_s if pipeline else 0.0),
                f"{command:.1f}" if command else "-",
            ]
        )
    title = (
        f"map: job: map of a cheap function (each image's encoded size, one pyarrow.compute call) over the "
        f"{data.spec.count:,} images of {data.spec.name}, {BATCH} rows a batch, against reading the same column in the same batches alone; "
        "rows/s over the loop over the fragments (the job's from its fragment records: read, function, new data file), "
        "without starting Python; command s is the job's whole command"
    )
    verdicts = []
    job = found.get(JOB)
    if job and job.ok_runs and pipeline and pipeline.images_per_s > 0:
        ratio = job.images_per_s / pipeline.images_per_s
        verdicts.append(Target("job: map vs the data pipeline alone", ratio >= TARGET, f"{ratio:.2f}x (target >= {TARGET}x)"))
    text, markdown = report.section_lines("Map", title, header, cells, [], verdicts)
    return SectionReport(text, markdown, verdicts)
