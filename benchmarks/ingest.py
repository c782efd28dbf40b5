"""The ingest section: image rows per second into a new Lance dataset.

The main data set's JPEG bytes, four times over (once with ``--tiny``), copied as WebDataset
tars, as Parquet files (several row groups each) and as an ImageFolder tree, are ingested by
``lance-hpc ingest`` with 1, 2 and 4 workers, against the single-process ingest lance_hpc had for
ImageFolder trees before ``imagefolder:`` became a source of many workers (one Lance write of
every file, on the ImageFolder copy), and against the peers that convert
in parallel into their own formats with the same worker count: MosaicML streaming's ``MDSWriter`` (one process per worker,
then ``merge_index``) and LitData's ``optimize()``. Each measurement is a fresh process, timed from
the command's start to its last commit (or index); rows/s is the rows written over that time.
lance_hpc also reads every image's header for its width and height and checks its end for
truncation; the peers store the bytes as they are.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import shutil
import statistics
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks import report
from benchmarks.datasets import DataSet
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.bench.resources import ResourceSampler
from lance_hpc.bench.runner import Summary

WORKER_COUNTS = (1, 2, 4)
SOURCES = ("webdataset", "parquet", "imagefolder")
REPEAT = 4  # the data set's rows, this many times over (--tiny: once, and 1 and 2 workers only)
PEER_WORKERS = 2  # the peers are compared at the machine's two cores, with lance_hpc at the same count
SAMPLES_PER_TAR = 256
ROWS_PER_GROUP = 256
GROUPS_PER_FILE = 4
TODAY = "lance_hpc one-process write of an image folder"
MDS = f"MosaicML MDSWriter + merge_index ({PEER_WORKERS} processes)"
LITDATA = f"LitData optimize() ({PEER_WORKERS} workers)"
SCALING_TARGET = 1.8  # 2 workers vs the single-process ingest
PEER_TARGET = 1.2  # lance_hpc at PEER_WORKERS vs the faster peer


def label(source: str, workers: int) -> str:
    return f"lance_hpc {source}: ({workers} worker{'s' if workers > 1 else ''})"


def dataset_name(data: DataSet) -> str:
    return f"{data.spec.name}-ingest"


# ---- the sources --------------------------------------------------------------------------------


def prepare_sources(data: DataSet, root: Path, repeat: int) -> dict[str, Path]:
    """The data set's rows (key, JPEG, class) ``repeat`` times over, as WebDataset tars, as Parquet
    files and as an ImageFolder tree (hard links to the data set's own), made once. Repeating makes
    an ingest long enough that starting the workers does not dominate it."""
    import os

    import lance
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / f"{data.spec.name}-{data.spec.count}x{repeat}-sources"
    paths = {"webdataset": folder / "webdataset", "parquet": folder / "parquet", "imagefolder": folder / "imagefolder"}
    if (folder / "done").exists():
        return paths
    shutil.rmtree(folder, ignore_errors=True)
    for path in paths.values():
        path.mkdir(parents=True)
    table = lance.dataset(data.lance_uri).to_table(columns=["image", "label"])
    images = table.column("image").to_pylist() * repeat
    labels = table.column("label").to_pylist() * repeat
    keys = [f"{index:08d}" for index in range(len(images))]
    for start in range(0, len(images), SAMPLES_PER_TAR):
        with tarfile.open(paths["webdataset"] / f"{start // SAMPLES_PER_TAR:05d}.tar", "w") as tar:
            for index in range(start, min(start + SAMPLES_PER_TAR, len(images))):
                for extension, payload in (("jpg", images[index]), ("cls", str(labels[index]).encode())):
                    info = tarfile.TarInfo(f"{keys[index]}.{extension}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    per_file = ROWS_PER_GROUP * GROUPS_PER_FILE
    for start in range(0, len(images), per_file):
        part = pa.table(
            {
                "key": keys[start : start + per_file],
                "image": pa.array(images[start : start + per_file], pa.binary()),
                "label": labels[start : start + per_file],
            }
        )
        pq.write_table(part, paths["parquet"] / f"{start // per_file:05d}.parquet", row_group_size=ROWS_PER_GROUP)
    for class_dir in sorted(Path(data.folder).iterdir()):
        (paths["imagefolder"] / class_dir.name).mkdir()
        for image in sorted(class_dir.iterdir()):
            for copy in range(repeat):
                os.link(image, paths["imagefolder"] / class_dir.name / f"{copy}_{image.name}")
    (folder / "done").write_text(json.dumps({"rows": len(images)}))
    return paths


def _tar_samples(path: str) -> Iterator[dict[str, Any]]:
    """A WebDataset tar's samples as the peers' writers take them: the JPEG bytes and the class."""
    sample: dict[str, Any] = {}
    with tarfile.open(path, "r|*") as tar:
        for member in tar:
            handle = tar.extractfile(member)
            if handle is None:
                continue
            key, _, extension = member.name.partition(".")
            if sample and sample["key"] != key:
                yield {"image": sample["jpg"], "label": int(sample["cls"])}
                sample = {}
            sample["key"] = key
            sample[extension] = handle.read()
    if sample:
        yield {"image": sample["jpg"], "label": int(sample["cls"])}


# ---- the measurements (in benchmarks.worker processes) -------------------------------------------


def _run_today(config: Measurement, out: Path) -> int:
    """The one-process ingest lance_hpc had for ImageFolder trees: every file read (by a thread
    pool) in a seeded random order and written by one Lance write, no image checked."""
    import numpy as np

    from lance_hpc.ingest.dataset import write_split
    from lance_hpc.ingest.sources import ImageSource
    from lance_hpc.ingest.target import COMMAND_LINE_NAMES, Target

    root = Path(config.data["source"])
    classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    files = [(path, label) for label, name in enumerate(classes) for path in sorted((root / name).iterdir())]
    items = ImageSource(str(root), tuple(classes), len(files), lambda index: (files[index][0].read_bytes(), files[index][1]))
    target = Target(str(out / "train.lance"), {}, COMMAND_LINE_NAMES.train)
    write_split(items, np.random.default_rng(0).permutation(len(files)), target, rows_per_fragment=1024)
    return len(files)


def _run_lance_hpc(config: Measurement, out: Path) -> int:
    import lance

    from lance_hpc.cli.ingest import main

    arguments = [config.data["source"], str(out / "train.lance"), "--nproc", str(config.num_workers)]
    if main([*arguments, "--rows-per-fragment", "1024"]) != 0:
        raise RuntimeError("lance-hpc ingest failed (its error is above)")
    return lance.dataset(str(out / "train.lance")).count_rows()


def _mds_part(tars: list[str], out: str) -> int:
    from streaming import MDSWriter

    rows = 0
    with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit="64mb") as writer:
        for tar in tars:
            for sample in _tar_samples(tar):
                writer.write(sample)
                rows += 1
    return rows


def _run_mds(config: Measurement, out: Path) -> int:
    from streaming.base.util import merge_index

    tars = sorted(str(path) for path in Path(config.data["source"]).glob("*.tar"))
    workers = config.num_workers
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        counts = pool.starmap(_mds_part, [(tars[rank::workers], str(out / f"part{rank}")) for rank in range(workers)])
    merge_index(str(out), keep_local=True)
    return sum(counts)


def _run_litdata(config: Measurement, out: Path) -> int:
    from litdata import optimize

    tars = sorted(str(path) for path in Path(config.data["source"]).glob("*.tar"))
    optimize(fn=_tar_samples, inputs=tars, output_dir=str(out / "litdata"), num_workers=config.num_workers, chunk_bytes="64MB")
    index = json.loads((out / "litdata" / "index.json").read_text())
    return sum(chunk["chunk_size"] for chunk in index["chunks"])


RUNNERS: dict[str, Callable[[Measurement, Path], int]] = {
    "ingest_today": _run_today,
    "ingest_lance_hpc": _run_lance_hpc,
    "ingest_mds": _run_mds,
    "ingest_litdata": _run_litdata,
}
PEER_PACKAGES = {"ingest_mds": "streaming", "ingest_litdata": "litdata"}


def measure(config: Measurement) -> Result:
    return timed(config, RUNNERS[config.kind])


def timed(config: Measurement, run: Callable[[Measurement, Path], int]) -> Result:
    """One ingest, timed whole, into a fresh directory that is removed afterwards; ``run`` returns
    the rows (or tokens) it wrote."""
    out = Path(config.data["out"]) / config.label.replace(" ", "_").replace("/", "_").replace(":", "")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    try:
        with ResourceSampler() as resources:
            first = resources.mark()
            started = time.perf_counter()
            rows = run(config, out)
            elapsed = time.perf_counter() - started
            last = resources.mark()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=rows / elapsed if elapsed > 0 else 0.0,
        first_batch_s=0.0,
        images=rows,
        batches=0,
        seconds=elapsed,
        epoch_done=True,
        **resources.summary(first, last, rows),
    )


# ---- the section --------------------------------------------------------------------------------


def _installed(kind: str) -> bool:
    import importlib.util

    return kind not in PEER_PACKAGES or importlib.util.find_spec(PEER_PACKAGES[kind]) is not None


def configs(context: Context) -> list[Measurement]:
    data = context.sets[0]
    sources = prepare_sources(data, context.data_dir, 1 if context.tiny else REPEAT)
    common: dict[str, Any] = dict(dataset=dataset_name(data), image_size=data.spec.image_size)
    work = str(context.out / "ingest_work")
    found = [
        Measurement(TODAY, "ingest_today", num_workers=1, data={"out": work, "source": str(sources["imagefolder"])}, **common)
    ]
    for source in SOURCES:
        path = sources[source]
        glob = {
            "webdataset": f"webdataset:{path}/*.tar",
            "parquet": f"parquet:{path}/*.parquet",
            "imagefolder": f"imagefolder:{path}",
        }[source]
        for workers in WORKER_COUNTS[:2] if context.tiny else WORKER_COUNTS:
            found.append(
                Measurement(
                    label(source, workers),
                    "ingest_lance_hpc",
                    num_workers=workers,
                    data={"out": work, "source": glob},
                    **common,
                )
            )
    for name, kind in ((MDS, "ingest_mds"), (LITDATA, "ingest_litdata")):
        if _installed(kind):
            found.append(
                Measurement(
                    name, kind, num_workers=PEER_WORKERS, data={"out": work, "source": str(sources["webdataset"])}, **common
                )
            )
    return found


def _row(summary: Summary, today: Summary | None, peer: Summary | None) -> list[str]:
    rate = summary.images_per_s
    return [
        summary.label,
        report.rate_text(summary),
        report.ratio_text(rate, today.images_per_s if today else 0.0),
        report.ratio_text(rate, peer.images_per_s if peer else 0.0),
        f"{statistics.median(r.seconds for run in summary.ok_runs for r in run):.1f}" if summary.ok_runs else "-",
        f"{summary.cpu_ms_per_image:.2f}" if summary.ok_runs else "-",
        f"{summary.main_rss_mib:,.0f}" if summary.ok_runs else "-",
        f"{summary.worker_rss_mib:,.0f}" if summary.ok_runs and summary.worker_rss_mib else "-",
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    data = context.sets[0]
    name = dataset_name(data)
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == name}
    today = found.get(TODAY)
    peers = [found[label] for label in (MDS, LITDATA) if label in found and found[label].ok_runs]
    faster_peer = max(peers, key=lambda summary: summary.images_per_s, default=None)
    header = ["configuration", "rows/s (min-max)", "x 1-process", "x faster peer", "s", "CPU ms/row", "main MiB", "worker MiB"]
    cells = [_row(summary, today, faster_peer) for summary in found.values()]
    rows = next((s.ok_runs[0][0].images for s in found.values() if s.ok_runs), 0)
    title = (
        f"ingest: {rows:,} rows ({data.describe().split(';')[0]}, repeated) into a new Lance dataset; "
        f"{SAMPLES_PER_TAR} per tar, {ROWS_PER_GROUP * GROUPS_PER_FILE} per Parquet file"
    )
    verdicts = []
    for source in SOURCES:
        two = found.get(label(source, 2))
        if two and today and today.images_per_s > 0:
            ratio = two.images_per_s / today.images_per_s
            verdicts.append(
                Target(
                    f"{source}, 2 workers vs the single-process ingest",
                    ratio >= SCALING_TARGET,
                    f"{ratio:.2f}x (target >= {SCALING_TARGET}x)",
                )
            )
    ours = found.get(label("webdataset", PEER_WORKERS))
    if ours and faster_peer and faster_peer.images_per_s > 0:
        ratio = ours.images_per_s / faster_peer.images_per_s
        verdicts.append(
            Target(
                f"webdataset, {PEER_WORKERS} workers vs the faster peer ({faster_peer.label})",
                ratio >= PEER_TARGET,
                f"{ratio:.2f}x (target >= {PEER_TARGET}x)",
            )
        )
    missing = [kind for kind in PEER_PACKAGES if not _installed(kind)]
    notes = [f"left out, package not installed: {', '.join(PEER_PACKAGES[kind] for kind in missing)}"] if missing else []
    chart_path = context.out / "ingest.png"
    charts = [chart_path] if report.chart(chart_path, lambda: _chart(found, chart_path, title)) else []
    text = ["", title, report.format_text(header, cells), *notes, "", "Targets (ingest):", *("  " + v.line() for v in verdicts)]
    markdown = [
        "",
        "## Ingest",
        "",
        title,
        "",
        report.format_markdown(header, cells),
        *notes,
        "",
        *(f"- {verdict.line()}" for verdict in verdicts),
    ]
    scaling = {
        source: {
            workers: found[label(source, workers)].images_per_s for workers in WORKER_COUNTS if label(source, workers) in found
        }
        for source in SOURCES
    }
    return SectionReport(text, markdown, verdicts, charts, {"ingest_scaling": scaling})


def _chart(found: dict[str, Summary], path: Path, title: str) -> None:
    """rows/s against workers, one line per source; the single-process ingest and the peers as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for source, color in zip(SOURCES, ("#1f77b4", "#2ca02c", "#ff7f0e")):
        points = [
            (workers, found[label(source, workers)].images_per_s) for workers in WORKER_COUNTS if label(source, workers) in found
        ]
        if points:
            axis.plot(*zip(*points), marker="o", color=color, label=f"lance_hpc {source}:")
    if TODAY in found:
        axis.axhline(found[TODAY].images_per_s, color="#9e9e9e", linestyle="--", label=TODAY)
    for name, marker in ((MDS, "s"), (LITDATA, "^")):
        if name in found:
            axis.plot([PEER_WORKERS], [found[name].images_per_s], marker=marker, color="#d62728", linestyle="", label=name)
    axis.set_xlabel("workers")
    axis.set_ylabel("rows/s (median)")
    axis.set_xticks(list(WORKER_COUNTS))
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=7)
    axis.set_title(title[:90], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
