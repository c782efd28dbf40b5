"""The refresh section: rows appended to a table whose model columns are written, then the columns
brought up to date by ``infer.refresh: missing`` against a full overwrite of the same columns.

The state both start from, prepared once per output directory: the photos copied, ``job: infer``
(the infer section's small CNN at 64 px, ``embedding`` float16 x 128 and ``predicted``) over every
row, then a tenth as many rows appended (copies of the first rows, their images only: as
``lance-hpc ingest --append`` adds them, with nulls in the model's columns). Each measurement copies
that state and runs one job on one local rank:
- refresh: the same job with ``infer.refresh: missing``, which computes the appended rows only;
- overwrite: the same job with ``infer.overwrite: true``, which computes every row again.

Reported for each: the job command's wall time; its work (that time less the same command run
again at once, which finds its commit and exits: Python's start, the spec and the checks); the
bytes of every file it added to the dataset; and, for the refresh, whether every data file that was
there before is byte for byte the same (the measurement fails otherwise).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from benchmarks import infer, report
from benchmarks.ingest import timed
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result

APPENDED_SHARE = 0.1  # rows appended, as a share of the table
REFRESH = "lance_hpc job: infer, refresh: missing (the appended rows)"
OVERWRITE = "lance_hpc job: infer, overwrite: true (every row again)"
TARGET = 0.15  # the refresh's time and bytes against the overwrite's, at most
WRITTEN: dict[str, int] = {}  # bytes a measurement added to the dataset, by label
WORK_S: dict[str, float] = {}  # the job's work: its command less the command's start and checks
COMMAND_S: dict[str, float] = {}  # the job's command, whole
LOOP_S: dict[str, float] = {}  # the rank's loop over the fragments it computed (read, model, write), from its records


def _run(spec: Path) -> float:
    """One local rank of the job ``spec``; its wall time."""
    root = Path(__file__).parents[1]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", str(spec), "--local", "--nproc", "1"], env=environ, cwd=root
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the job {spec} failed (its output is above)")
    return elapsed


def _spec(uri: Path, out: Path, workers: int, **settings: Any) -> Path:
    """The infer section's job on ``uri``, with ``settings`` in its infer section."""
    path = infer._spec(uri, out, workers)
    raw = yaml.safe_load(path.read_text())
    raw["infer"].update(settings)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _prepared(config: Measurement) -> Path:
    """The dataset both measurements start from, made once: the model's columns on every row,
    then a tenth as many rows appended without them."""
    import lance

    final = Path(config.data["out"]) / "prepared" / "photos.lance"
    if final.exists():
        return final
    work = final.parent.with_name("preparing")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    uri = work / "photos.lance"
    shutil.copytree(config.data["lance_uri"], uri)
    _run(_spec(uri, work, config.num_workers))
    dataset = lance.dataset(str(uri))
    sources = [name for name in dataset.schema.names if name not in ("embedding", "predicted")]
    rows = dataset.to_table(columns=sources, limit=int(dataset.count_rows() * APPENDED_SHARE))
    lance.write_dataset(rows, str(uri), mode="append")
    final.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(uri, final)  # complete before it is seen
    shutil.rmtree(work, ignore_errors=True)
    return final


def _digests(uri: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in (uri / "data").glob("*.lance")}


def _sizes(uri: Path) -> dict[str, int]:
    return {str(path.relative_to(uri)): path.stat().st_size for path in uri.rglob("*") if path.is_file()}


def _measure_job(config: Measurement, out: Path, settings: dict[str, Any]) -> int:
    import lance

    uri = out / "photos.lance"
    shutil.copytree(_prepared(config), uri)
    before, digests = _sizes(uri), _digests(uri)
    rows_before = lance.dataset(str(uri)).count_rows()
    lacking = lance.dataset(str(uri)).to_table(columns=["predicted"]).column("predicted").null_count
    spec = _spec(uri, out, config.num_workers, **settings)
    elapsed = COMMAND_S[config.label] = _run(spec)
    records = [json.loads(path.read_text()) for path in out.glob(".photos.lance.infer/*/fragment-*.json")]
    LOOP_S[config.label] = sum(record["seconds"] for record in records)
    WORK_S[config.label] = elapsed - _run(spec)  # the second run finds the commit and does nothing else
    after = _sizes(uri)
    WRITTEN[config.label] = sum(size for name, size in after.items() if name not in before)
    changed = [name for name, digest in digests.items() if _digests(uri).get(name) != digest]
    if settings.get("refresh") and changed:
        raise RuntimeError(f"the refresh changed data files that were there before: {', '.join(changed)}")
    return lacking if settings.get("refresh") else rows_before


RUNNERS: dict[str, Callable[[Measurement, Path], int]] = {
    "refresh_missing": lambda config, out: _measure_job(config, out, {"refresh": "missing"}),
    "refresh_overwrite": lambda config, out: _measure_job(config, out, {"overwrite": True}),
}


def measure(config: Measurement) -> Result:
    result = timed(config, RUNNERS[config.kind])
    result.bytes_written = WRITTEN.get(config.label, 0)
    if WORK_S.get(config.label):  # rows/s of the job's work; seconds the job's whole command (no copy, no setup)
        result.images_per_s = result.images / WORK_S[config.label]
        result.seconds = COMMAND_S[config.label]
        result.store = {"loop_s": LOOP_S.get(config.label, 0.0)}
    return result


def configs(context: Context) -> list[Measurement]:
    data = context.sets[0]
    common: dict[str, Any] = dict(dataset=f"{data.spec.name}-refresh", image_size=infer.IMAGE_SIZE, num_workers=context.workers)
    work = str(context.out / "refresh_work")
    return [
        Measurement(label, kind, data={"out": work, "lance_uri": data.lance_uri}, **common)
        for label, kind in ((REFRESH, "refresh_missing"), (OVERWRITE, "refresh_overwrite"))
    ]


def _figures(summary: Any) -> tuple[float, float, float, int, float]:
    """(the command's s, the work's s, MB written, rows computed, the loop's s) of a configuration's
    run with the least work."""
    runs = [run[0] for run in summary.ok_runs]
    result = min(runs, key=lambda found: found.images / found.images_per_s if found.images_per_s else found.seconds)
    work = result.images / result.images_per_s if result.images_per_s else 0.0
    return result.seconds, work, result.bytes_written / 1e6, result.images, result.store.get("loop_s", 0.0)


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    data = context.sets[0]
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == f"{data.spec.name}-refresh"}
    header = ["configuration", "rows computed", "command s", "work s", "loop s", "MB written"]
    cells, figures = [], {}
    for label, summary in found.items():
        if not summary.ok_runs:
            cells.append([label, "-", "-", "-", "-", "-"])
            continue
        figures[label] = command, work, written, rows, loop = _figures(summary)
        cells.append([label, f"{rows:,}", f"{command:.1f}", f"{work:.1f}", f"{loop:.1f}", f"{written:,.2f}"])
    title = (
        f"refresh: {data.spec.count:,} photos with embedding (float16 x {infer.EMBEDDING}) and predicted written by job: "
        f"infer, then {APPENDED_SHARE:.0%} more rows appended; the columns brought up to date on 1 local rank with "
        f"{context.workers} DataLoader workers; work s is the command less the same command run again at once (which "
        "finds its commit: Python's start, the spec, the checks); loop s is the rank's loop over the fragments it "
        "computed (read, model, write), from its records; MB written is every file the job added"
    )
    verdicts = []
    if REFRESH in figures and OVERWRITE in figures:
        refresh, overwrite = figures[REFRESH], figures[OVERWRITE]
        for what, position in (("work time", 1), ("bytes written", 2)):
            ratio = refresh[position] / overwrite[position] if overwrite[position] else float("inf")
            verdicts.append(
                Target(f"refresh vs a full overwrite: {what}", ratio <= TARGET, f"{ratio:.3f}x (target <= {TARGET}x)")
            )
        whole = refresh[0] / overwrite[0] if overwrite[0] else float("inf")
        loop = refresh[4] / overwrite[4] if overwrite[4] else float("inf")
        notes = [
            f"the whole command, Python's start included: {whole:.2f}x; the loop over the fragments: {loop:.2f}x; "
            "old data files byte for byte unchanged: yes"
        ]
    else:
        notes = []
    text, markdown = report.section_lines("Refresh", title, header, cells, notes, verdicts)
    return SectionReport(text, markdown, verdicts)
