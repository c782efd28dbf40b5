"""``python -m lance_hpc.bench`` and ``lance-hpc bench``.

Without a job spec: the peer benchmark. It generates (or reuses) the benchmark data sets, measures
the decode limit, the peers and every lance_hpc strategy each in a fresh process, interleaved,
``--runs`` times, and writes a table (terminal and markdown), a PNG chart and the raw results to
the output directory.

With a job spec (an ``image_classification`` job): measures that job's own data pipeline (its
strategy, batch size and workers, its image size and augmentation, one rank's share of the data) on
this machine without training, next to the decode limit of the same images, so workers and batch
size can be tuned before the job is submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from lance_hpc.bench import report
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.datasets import DataSet, DataSetSpec, prepare
from lance_hpc.bench.runner import Summary, exactly_once, run_rounds
from lance_hpc.errors import UserError

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec
    from lance_hpc.tasks.image import ImageOptions

DEFAULT_OUT = "bench_out"
# lance_hpc's strategies: (label, style, sampler); the first is the default a job spec gets.
STRATEGIES = (
    ("lance_hpc map/distributed", "map", "distributed"),
    ("lance_hpc iterable/sharded_batch", "iterable", "sharded_batch"),
    ("lance_hpc iterable/sharded_fragment", "iterable", "sharded_fragment"),
)
DEFAULT_STRATEGY = STRATEGIES[0][0]
DDP_LABEL = "lance_hpc map/distributed, 2-rank DDP"
DDP_RANKS = 2


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


def peer_configs(data: DataSet, workers: int, seconds: float, with_ddp: bool) -> list[Measurement]:
    """Every configuration measured on one data set, in table order."""
    spec = data.spec
    common = dict(
        dataset=spec.name, lance_uri=data.lance_uri, folder=data.folder, image_size=spec.image_size,
        augment="none", batch_size=spec.batch_size, num_workers=workers, seconds=seconds,
    )
    cores = len(os.sched_getaffinity(0))
    configs = [
        Measurement(report.DECODE_LIMIT, "decode_limit", cores=cores, **common),
        Measurement(report.REFERENCE_MAP, "reference_map", **common),
        Measurement(report.REFERENCE_ITERABLE, "reference_iterable", **{**common, "num_workers": 0}),
        Measurement(report.IMAGE_FOLDER, "image_folder", **common),
    ]
    for label, style, sampler in STRATEGIES:
        is_default = label == DEFAULT_STRATEGY
        configs.append(Measurement(
            label, "lance_hpc", data=_data_fields(data, style, sampler, workers), full_epoch=is_default,
            fingerprint=is_default and with_ddp, **common,
        ))
    if with_ddp:
        per_rank = max(1, workers // DDP_RANKS)
        configs.append(Measurement(
            DDP_LABEL, "lance_hpc", world_size=DDP_RANKS, full_epoch=True, fingerprint=True,
            data=_data_fields(data, "map", "distributed", per_rank), **{**common, "num_workers": per_rank},
        ))
    return configs


def _data_fields(data: DataSet, style: str, sampler: str, workers: int) -> dict:
    """DataSpec fields for a lance_hpc strategy (the decoder resizes only, like the peers: augment
    "none" in :func:`peer_configs`)."""
    return dict(
        uri=data.lance_uri, style=style, sampler=sampler, batch_size=data.spec.batch_size, num_workers=workers,
        shuffle=True, seed=0,
    )


def _paired_rates(first: Summary, second: Summary) -> list[tuple[float, float]]:
    """Both configurations' rates in the rounds where both ran without error."""
    return [
        (Summary(first.label, first.dataset, [a]).images_per_s, Summary(second.label, second.dataset, [b]).images_per_s)
        for a, b in zip(first.runs, second.runs)
        if not any(result.error for result in a + b)
    ]


def run_peer_benchmark(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    workers = args.workers or cores
    runs = args.runs or (1 if args.tiny else 3)
    seconds = args.seconds or (0.5 if args.tiny else 2.0)
    machine = report.machine_description()
    print(f"lance_hpc loader benchmark on {machine}")
    sets = [prepare(spec, out / "data") for spec in data_sets(args.tiny)]
    for data in sets:
        print(f"  {data.spec.name}: {data.describe()}")
    configs = [config for index, data in enumerate(sets) for config in peer_configs(data, workers, seconds, index == 0)]
    print(f"measuring {len(configs)} configurations x {runs} runs, each in a fresh process "
          f"({workers} workers, {seconds:g} s window) ...")
    load_before = os.getloadavg()[0]
    summaries = run_rounds(configs, runs, out / "work")
    load_after = os.getloadavg()[0]

    main_set = sets[0].spec.name
    tables = {data.spec.name: [s for s in summaries if s.dataset == data.spec.name] for data in sets}
    ddp = next((s for s in summaries if s.label == DDP_LABEL), None)
    single = next(s for s in tables[main_set] if s.label == DEFAULT_STRATEGY)
    check = None
    if ddp is not None:
        pairs = [(ddp_run, single_run) for ddp_run, single_run in zip(ddp.runs, single.runs)
                 if not any(r.error for r in ddp_run + single_run)]
        check = exactly_once(*pairs[-1]) if pairs else None
    verdicts = report.targets(tables[main_set], DEFAULT_STRATEGY, ddp, check, [label for label, _, _ in STRATEGIES])

    titles = {data.spec.name: f"{data.spec.name}: {data.describe()}" for data in sets}
    text, markdown = [], [
        "# lance_hpc loader benchmark", "",
        f"Machine: {machine}.", "",
        f"Each configuration ran {runs}x in a fresh process, interleaved; images/s is the median steady rate "
        f"after the first batch ({seconds:g} s window; lance_hpc's default strategy and the DDP run read the whole epoch). "
        f"{workers} DataLoader workers for every pipeline that has workers (the reference iterable pipeline has none). "
        f"The decode limit is one core's decode + resize rate on the same bytes (lance_hpc's decoder and resize, with no loader around them), times {cores} cores. "
        f"Load average (1 min) {load_before:.1f} before, {load_after:.1f} after: other work on the machine shows as "
        "noise in images/s; CPU ms/img (main process and workers, per image read) moves less with the load and shows "
        "the work each pipeline does per image, against the decode limit's floor.",
    ]
    for name, rows in tables.items():
        header, cells = report.table_rows(rows)
        text += ["", titles[name], report.format_text(header, cells)]
        markdown += ["", f"## {titles[name]}", "", report.format_markdown(header, cells)]
    if ddp is not None:
        runs_text = ", ".join(f"{rate:,.0f}" for rate in ddp.rates())
        ddp_line = (f"2-rank DDP (gloo, {max(1, workers // DDP_RANKS)} worker(s) per rank, an all-reduce every step): "
                    f"{ddp.images_per_s:,.0f} img/s (runs: {runs_text}) vs one process with {workers} workers "
                    f"{single.images_per_s:,.0f} img/s (runs: {', '.join(f'{rate:,.0f}' for rate in single.rates())}); "
                    f"DDP / one process in each round: {', '.join(f'{d / o:.2f}x' for d, o in _paired_rates(ddp, single))}")
        text += ["", ddp_line]
        markdown += ["", "## DDP", "", ddp_line + "."]
    text += ["", "Targets (" + main_set + "):", *("  " + verdict.line() for verdict in verdicts)]
    markdown += ["", f"## Targets ({main_set})", "", *(f"- {verdict.line()}" for verdict in verdicts)]
    failures = [f"{s.dataset} {s.label}: {error.strip().splitlines()[-1]}" for s in summaries for error in s.errors]
    if failures:
        text += ["", "Failed runs (logs in " + str(out / "work") + "):", *("  " + line for line in failures)]
        markdown += ["", "## Failed runs", "", *(f"- {line}" for line in failures)]

    chart = out / "results.png"
    chart.unlink(missing_ok=True)
    try:
        report.bar_chart(tables, chart, f"lance_hpc loader benchmark - {machine.split(';')[0]}")
        markdown += ["", f"![loader throughput]({chart.name})", ""]
    except ImportError:
        print("no chart: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    (out / "results.md").write_text("\n".join(markdown))
    (out / "results.json").write_text(json.dumps({
        "machine": machine, "runs": runs, "workers": workers, "seconds": seconds, "load": [load_before, load_after],
        "data_sets": [asdict(data) for data in sets],
        "summaries": [{**asdict(summary), "images_per_s": summary.images_per_s} for summary in summaries],
        "exactly_once": asdict(check) if check else None,
        "targets": [asdict(verdict) for verdict in verdicts],
    }, default=str))
    print("\n".join(text))
    written = [out / "results.md", *([chart] if chart.is_file() else []), out / "results.json"]
    print(f"\nwrote {', '.join(map(str, written))} in {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 0, e.g. 2,4,8")
    return values


def image_options(spec: JobSpec, job: str) -> ImageOptions:
    """The image options of a job's task. The benchmark measures image decoding and resizing, so
    it takes image_classification jobs (or a task class that extends it) only."""
    from lance_hpc.tasks import task_class
    from lance_hpc.tasks.image import ImageClassification

    cls = task_class(spec.task.name)
    if not issubclass(cls, ImageClassification):
        raise UserError(
            f"{job}: task.name is {spec.task.name!r}, but lance-hpc bench measures the data pipelines of "
            "image_classification jobs only (image decode and resize)\n"
            "  fix: bench a job with task.name: image_classification, or time this task's data with a short "
            "training run (train.max_steps)"
        )
    return cls.Options.model_validate(spec.task.options)


def run_job_benchmark(args: argparse.Namespace) -> int:
    from lance_hpc.data import ensure_dataset
    from lance_hpc.spec import load_spec

    spec = load_spec(args.job, overrides=args.overrides).spec
    image = image_options(spec, args.job)
    data = spec.data
    ensure_dataset(data)
    out = Path(args.out)
    cores = len(os.sched_getaffinity(0))
    runs = args.runs or 3
    seconds = args.seconds or 5.0
    world_size = spec.slurm.world_size
    common = dict(dataset="job", lance_uri=data.uri, image_size=image.image_size, image_column=image.image_column,
                  label_column=image.label_column, augment=image.augment, seconds=seconds, data_world_size=world_size)
    configs = [Measurement(report.DECODE_LIMIT, "decode_limit", cores=cores,
                           data=data.model_dump(mode="json"), **common)]
    for workers in args.workers or [data.num_workers]:
        for batch_size in args.batch_size or [data.batch_size]:
            fields = {**data.model_dump(mode="json"), "num_workers": workers, "batch_size": batch_size}
            configs.append(Measurement(f"{data.style}/{data.sampler} workers={workers} batch={batch_size}",
                                       "lance_hpc", batch_size=batch_size, num_workers=workers, data=fields, **common))
    print(f"measuring the data pipeline of {args.job} (rank 0 of {world_size}) on {report.machine_description()}")
    print(f"{len(configs)} configurations x {runs} runs, {seconds:g} s window each, no training")
    summaries = run_rounds(configs, runs, out / "job_work")
    header, rows = report.table_rows(summaries)
    keep = [0, 1, 2, 6, 7, 8, 9, 10]  # the peers' ratio columns do not apply here
    print()
    print(report.format_text([header[i] for i in keep], [[row[i] for i in keep] for row in rows]))
    print(f"\nimages/s is one rank's loader on this machine's {cores} cores (the job asks for "
          f"slurm.cpus_per_task: {spec.slurm.cpus_per_task}). A training step that consumes images faster than this "
          "waits on data: raise data.num_workers up to the cores per task, or lower the decode cost "
          "(task.options.image_size).")
    failures = [error for summary in summaries for error in summary.errors]
    for error in failures:
        print(f"failed: {error.strip().splitlines()[-1]}", file=sys.stderr)
    return 1 if failures else 0


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="python -m lance_hpc.bench",
        description="Benchmark lance_hpc's loaders against the peers, or measure a job spec's data pipeline.",
    )
    result.add_argument("job", nargs="?", help="job spec YAML: measure its data pipeline instead of the peer benchmark")
    result.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT}/)")
    result.add_argument("--runs", type=int, help="runs per configuration (default 3; --tiny: 1)")
    result.add_argument("--seconds", type=float, help="measuring window per run after the first batch")
    result.add_argument("--tiny", action="store_true", help="a few hundred small images, one run each (tests)")
    result.add_argument("--workers", type=_int_list,
                        help="peer benchmark: workers per pipeline (default: the cores); job: list to sweep, e.g. 2,4,8")
    result.add_argument("--batch-size", type=_int_list, help="job: batch sizes to sweep, e.g. 64,128")
    result.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="job: override a spec field, e.g. --set data.num_workers=8")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.job:
        try:
            return run_job_benchmark(args)
        except UserError as error:
            print(error, file=sys.stderr)
            return 2
    if args.batch_size or args.overrides:
        parser().error("--batch-size and --set apply to a job spec")
    if args.workers and len(args.workers) > 1:
        parser().error("the peer benchmark takes one --workers value")
    args.workers = args.workers[0] if args.workers else None
    return run_peer_benchmark(args)
