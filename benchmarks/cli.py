"""``python -m benchmarks`` (from the repository root; ``lance-hpc bench`` without a job spec hands
over to it).

It generates (or reuses) the benchmark data sets, gathers the configurations of the chosen sections
(``SECTIONS``: local disk, object storage, ...), measures each in a fresh process, interleaved,
``--runs`` times, and writes each section's tables (terminal and markdown) and charts and the raw
results to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from benchmarks import (
    choose,
    gpu,
    infer,
    ingest,
    loader_library,
    local,
    map_job,
    object_storage,
    peer_loaders,
    refresh,
    report,
    restarts,
    sharded,
    shuffle_quality,
    text_ingest,
)
from benchmarks.datasets import DataSetSpec, prepare
from benchmarks.sections import Context, Section
from benchmarks.worker import WORKER
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import run_rounds
from lance_hpc.cli.arguments import int_list
from lance_hpc.cli.bench import DEFAULT_OUT

# The sections of the benchmark, in the order they are reported; --sections picks some.
SECTIONS: dict[str, Section] = {
    "local": Section(
        "every pipeline reading from local disk: the decode limit, pylance's reference map-style and iterable "
        "pipelines, torchvision ImageFolder and each lance_hpc strategy, on the photos and on 64x64 images, and a "
        "2-rank DDP run that checks every row is read exactly once",
        local.configs,
        local.section_report,
        runs=2,
    ),
    "object_storage": Section(
        "each lance_hpc strategy reading the photos over the S3 protocol from a loopback server with 0, 25 and "
        "50 ms first-byte latency, against the same strategy on local disk: images/s, GET requests and bytes per "
        "image (what a store bills), the loader's CPU per image and the server's apart; and the default strategy's "
        "second epoch at 25 ms from a node-local cache (data.cache) the first filled",
        object_storage.configs,
        object_storage.section_report,
        runs=2,
    ),
    "peers": Section(
        "the best peer loaders (LanceDB StreamingDataset and Permutation, MosaicML streaming, LitData) on the "
        "photos' very JPEG bytes in their own formats, out of the box and fed lance_hpc's decode, against the "
        "default strategy, on local disk and over the S3 server at 25 ms",
        peer_loaders.configs,
        peer_loaders.section_report,
        runs=1,
    ),
    "loader_library": Section(
        "lance_hpc.Loader in a plain loop (no model) over a token set: batches/s against the built-in trainer's "
        "loader with the same strategy, batch and workers, and with the sharded_batch strategy against lance.torch's "
        "LanceDataset with a ShardedBatchSampler (the same read pattern), each ratio against the trainer's loader and "
        "lance.torch in the same round",
        loader_library.configs,
        loader_library.section_report,
        runs=5,
    ),
    "ingest": Section(
        "lance-hpc ingest of the photos' JPEG bytes from WebDataset tars, Parquet and an image folder with 1, 2 and 4 "
        "workers, against the one-process write lance_hpc had for image folders and, at 2 workers, MosaicML's MDSWriter + "
        "merge_index and LitData's optimize(): rows/s, CPU and peak memory, and the scaling chart",
        ingest.configs,
        ingest.section_report,
        runs=2,
    ),
    "text_ingest": Section(
        "lance-hpc ingest --tokenize of a JSON Lines corpus built from the standard library's sources, at two sizes "
        "ten times apart, with 1 and 2 workers, byte-level and with a BPE trained here: tokens/s, and each "
        "worker's peak memory against the corpus size (flat: the corpus grows, the worker does not)",
        text_ingest.configs,
        text_ingest.section_report,
        runs=1,
    ),
    "infer": Section(
        "job: infer on one local rank over the photos (a small CNN at 64 px, embedding and predicted written back as "
        "new columns) against the same data pipeline alone and against a hand-written loop that rewrites the table: "
        "images/s, and the bytes each wrote against the new columns' size",
        infer.configs,
        infer.section_report,
        runs=2,
    ),
    "refresh": Section(
        "rows appended to the photos (a tenth more) after job: infer wrote embedding and predicted: infer.refresh: "
        "missing, which computes the new rows only, against a full overwrite of the same columns: time and bytes "
        "written, and the old data files checked byte for byte",
        refresh.configs,
        refresh.section_report,
        runs=1,
    ),
    "map": Section(
        "job: map of a cheap function (each image's encoded size) over the photos on one local rank, against reading "
        "the same column in the same batches alone: rows/s of each loop over the fragments, and the job's whole command",
        map_job.configs,
        map_job.section_report,
        runs=2,
    ),
    "choose": Section(
        "what choosing the training rows costs, each against its peer in the same run: sampler: block over the S3 "
        "server at 25 ms against itself and the default strategy on local disk (images/s, GET requests and KB per "
        "image); data.filter selecting half the rows against those rows as their own dataset; data.mix of three "
        "sources (0.5/0.3/0.2) against one; shuffle quality of every strategy on data in class order (distinct labels "
        "and position spread per planned batch, and the quickstart model's validation accuracy trained with "
        "distributed, block and sharded_fragment, one local job each); and a request-rate model (GET/s, MB/s and "
        "GET cost per hour at 3,000 images/s per GPU for 1 to 512 GPUs, against S3's 5,500 GET/s per prefix)",
        choose.configs,
        choose.section_report,
        runs=2,
        once=(shuffle_quality.TRAIN_KIND,),
    ),
    "sharded": Section(
        "a GPT of 110M parameters on 2 and 4 local gloo ranks (CPU) under ddp and fsdp: state bytes per rank, the "
        "step loop's wait per save (ddp's one file, a synchronous and a background sharded save) and tokens/s; and "
        "start-up to the first step of a 350M GPT, ddp's CPU build against fsdp on the meta device",
        sharded.configs,
        sharded.section_report,
        runs=1,
    ),
    "restarts": Section(
        "what a dead rank costs a job on the SLURM test cluster (started here: root and Debian's SLURM packages): "
        "rank 1 of 4 SIGKILLed, the job restarted inside its allocation (its next ranks started ahead) against "
        "the same job requeued at once; seconds from the kill to the first step after it, the steps done again, "
        "and their ratio",
        restarts.configs,
        restarts.section_report,
        runs=1,
        once=(restarts.KIND,),
    ),
    "gpu": Section(
        "ResNet-50 training on one CUDA GPU (bf16, channels-last), fed by the default strategy from local disk "
        "and over the S3 server at 25 ms, against synthetic batches already on the GPU: images/s and the share "
        "of time spent waiting for data (measures nothing without a CUDA device)",
        gpu.configs,
        gpu.section_report,
        runs=2,
    ),
}


def data_sets(tiny: bool) -> list[DataSetSpec]:
    """ImageNet-like photos and a 64x64 set that shows per-sample overhead; ``tiny``: a small one only.

    Row counts are multiples of batch size x DDP ranks, so no rank drops a partial batch and the
    exactly-once check compares whole epochs."""
    if tiny:
        return [DataSetSpec("small", count=384, image_size=64, batch_size=32, size=64, rows_per_fragment=100)]
    return [
        DataSetSpec("photos", count=8192, image_size=224, batch_size=64),
        DataSetSpec("small", count=8192, image_size=64, batch_size=64, size=64),
    ]


def _gather(
    context: Context, sections: dict[str, Section], runs: int | None
) -> tuple[list[Measurement], dict[tuple[str, str], int]]:
    """Every section's configurations, each (data set, label) once (sections that share a baseline
    measure it once, as often as the section that runs it most), and its number of runs (one for
    the kinds a section measures once)."""
    found: dict[tuple[str, str], Measurement] = {}
    runs_of: dict[tuple[str, str], int] = {}
    for section in sections.values():
        for config in section.configs(context):
            key = (config.dataset, config.label)
            found.setdefault(key, config)
            count = 1 if config.kind in section.once else runs or section.runs
            runs_of[key] = max(runs_of.get(key, 0), count)
    return list(found.values()), runs_of


def _runs_text(runs: dict[tuple[str, str], int]) -> str:
    counts = sorted(set(runs.values()))
    if not counts:  # only sections that had nothing to measure here (gpu without a CUDA device)
        return "0x"
    return f"{counts[0]}x" if len(counts) == 1 else f"{counts[-1]}x or {counts[0]}x (by section)"


def run_benchmark(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    workers = args.workers or cores
    seconds = args.seconds or (0.5 if args.tiny else 2.0)
    machine = report.machine_description()
    print(f"lance_hpc loader benchmark on {machine}")
    sets = [prepare(spec, out / "data") for spec in data_sets(args.tiny)]
    for data in sets:
        print(f"  {data.spec.name}: {data.describe()}")
    context = Context(out, out / "data", sets, workers, seconds, args.tiny, machine)
    sections = {name: SECTIONS[name] for name in args.sections}
    try:
        configs, runs = _gather(context, sections, args.runs or (1 if args.tiny else None))
        print(
            f"sections {', '.join(sections)}: {len(configs)} configurations, {sum(runs.values())} measurements, "
            f"each in a fresh process ({workers} workers, {seconds:g} s window) ..."
        )
        load_before = os.getloadavg()[0]
        summaries = run_rounds(configs, runs, out / "work", worker=WORKER)
        load_after = os.getloadavg()[0]
    finally:
        context.stop_servers()
        shutil.rmtree(object_storage.cache_parent(context), ignore_errors=True)
    by_key = {(summary.dataset, summary.label): summary for summary in summaries}
    reports = {name: section.report(context, by_key) for name, section in sections.items()}

    text, markdown = (
        [],
        [
            "# lance_hpc loader benchmark",
            "",
            f"Machine: {machine}.",
            "",
            f"Sections: {', '.join(sections)}. Each configuration ran {_runs_text(runs)} in a fresh process, "
            f"interleaved; images/s is the median steady rate after the first batch ({seconds:g} s window; "
            "lance_hpc's strategies, on local disk and over S3, and the DDP run read the whole epoch). "
            f"{workers} DataLoader workers for every pipeline that has workers (the reference iterable pipeline has none). "
            f"The decode limit is one core's decode + resize rate on the same bytes (lance_hpc's decoder and resize, with "
            f"no loader around them), times {cores} cores. "
            f"Load average (1 min) {load_before:.1f} before, {load_after:.1f} after: other work on the machine shows as "
            "noise in images/s; CPU ms/img (main process and workers, per image read) moves less with the load and shows "
            "the work each pipeline does per image, against the decode limit's floor.",
        ],
    )
    for section_report in reports.values():
        text += section_report.text
        markdown += section_report.markdown
    failures = [f"{s.dataset} {s.label}: {error.strip().splitlines()[-1]}" for s in summaries for error in s.errors]
    if failures:
        text += ["", "Failed runs (logs in " + str(out / "work") + "):", *("  " + line for line in failures)]
        markdown += ["", "## Failed runs", "", *(f"- {line}" for line in failures)]
    (out / "results.md").write_text("\n".join(markdown) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "sections": list(sections),
                "runs": sorted(set(runs.values())),
                "workers": workers,
                "seconds": seconds,
                "load": [load_before, load_after],
                "data_sets": [asdict(data) for data in sets],
                "summaries": [{**asdict(summary), "images_per_s": summary.images_per_s} for summary in summaries],
                "targets": {name: [asdict(verdict) for verdict in found.targets] for name, found in reports.items()},
                **{key: value for found in reports.values() for key, value in found.json.items()},
            },
            default=str,
        )
    )
    print("\n".join(text))
    charts = [chart for found in reports.values() for chart in found.charts]
    written = [out / "results.md", *charts, out / "results.json"]
    print(f"\nwrote {', '.join(map(str, written))} in {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


def _sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(unknown) or repr(text)}: give one or more of {', '.join(SECTIONS)}"
        )
    return [name for name in SECTIONS if name in names]  # report order, each once


def parser() -> argparse.ArgumentParser:
    sections = "\n".join(
        textwrap.fill(section.help, 100, initial_indent=f"  {name}: ", subsequent_indent="    ")
        for name, section in SECTIONS.items()
    )
    result = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark lance_hpc's loaders against the peers on generated data sets (run from the repository "
        "root; lance-hpc bench job.yaml measures a job's own pipeline).",
        epilog=f"sections of the loader benchmark (--sections, default all):\n{sections}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        metavar="NAME[,NAME...]",
        help=f"the sections to measure, of {', '.join(SECTIONS)} (default all; see below)",
    )
    result.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT}/)")
    result.add_argument(
        "--runs",
        type=int,
        help="runs per configuration (default: local and object_storage 2, peers 1; --tiny: 1; "
        "the choose section's training jobs run once)",
    )
    result.add_argument(
        "--seconds",
        type=float,
        help="measuring window per run after the first batch "
        "(in the loader benchmark, lance_hpc's strategies read a whole epoch instead)",
    )
    result.add_argument("--tiny", action="store_true", help="a few hundred small images, one run each (tests)")
    result.add_argument(
        "--workers",
        type=int_list,
        help="workers per pipeline (default: the cores)",
    )
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workers and len(args.workers) > 1:
        parser().error("give one --workers value")
    args.workers = args.workers[0] if args.workers else None
    return run_benchmark(args)
