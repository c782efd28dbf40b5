"""The local-disk section: on each data set, the decode limit, pylance's reference pipelines,
torchvision ImageFolder and every lance_hpc strategy reading from local disk, and on the main set a
2-rank DDP run that checks every row is read exactly once."""

from __future__ import annotations

import os
from dataclasses import asdict

from benchmarks import report
from benchmarks.datasets import DataSet
from benchmarks.sections import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Context,
    SectionReport,
    Summaries,
    common_fields,
    strategy_fields,
)
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import Summary, exactly_once

DDP_LABEL = "lance_hpc map/distributed, 2-rank DDP"
DDP_RANKS = 2


def set_configs(data: DataSet, context: Context, with_ddp: bool) -> list[Measurement]:
    """Every configuration measured on one data set, in table order."""
    common = common_fields(data, context)
    cores = len(os.sched_getaffinity(0))
    configs = [
        Measurement(report.DECODE_LIMIT, "decode_limit", cores=cores, **common),
        Measurement(report.REFERENCE_MAP, "reference_map", **common),
        Measurement(report.REFERENCE_ITERABLE, "reference_iterable", **{**common, "num_workers": 0}),
        Measurement(report.IMAGE_FOLDER, "image_folder", **common),
    ]
    for label, style, sampler in STRATEGIES:
        # A whole epoch each, like the same strategy over S3 in the object-storage section: an epoch
        # takes a few seconds, and a window shorter than that is mostly the loader warming up.
        configs.append(
            Measurement(
                label,
                "lance_hpc",
                data=strategy_fields(data, style, sampler, context.workers),
                full_epoch=True,
                fingerprint=label == DEFAULT_STRATEGY and with_ddp,
                **common,
            )
        )
    if with_ddp:
        per_rank = max(1, context.workers // DDP_RANKS)
        configs.append(
            Measurement(
                DDP_LABEL,
                "lance_hpc",
                world_size=DDP_RANKS,
                full_epoch=True,
                fingerprint=True,
                data=strategy_fields(data, "map", "distributed", per_rank),
                **{**common, "num_workers": per_rank},
            )
        )
    return configs


def configs(context: Context) -> list[Measurement]:
    return [config for index, data in enumerate(context.sets) for config in set_configs(data, context, index == 0)]


def _paired_rates(first: Summary, second: Summary) -> list[tuple[float, float]]:
    """Both configurations' rates in the rounds where both ran without error."""
    return [
        (Summary(first.label, first.dataset, [a]).images_per_s, Summary(second.label, second.dataset, [b]).images_per_s)
        for a, b in zip(first.runs, second.runs)
        if not any(result.error for result in a + b)
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    """One table per data set, the DDP line and the targets, and the bar chart results.png."""
    main_set = context.sets[0].spec.name
    tables = {data.spec.name: [s for s in summaries.values() if s.dataset == data.spec.name] for data in context.sets}
    ddp = summaries.get((main_set, DDP_LABEL))
    single = summaries[(main_set, DEFAULT_STRATEGY)]
    check = None
    if ddp is not None:
        pairs = [
            (ddp_run, single_run)
            for ddp_run, single_run in zip(ddp.runs, single.runs)
            if not any(r.error for r in ddp_run + single_run)
        ]
        check = exactly_once(*pairs[-1]) if pairs else None
    verdicts = report.targets(tables[main_set], DEFAULT_STRATEGY, ddp, check, [label for label, _, _ in STRATEGIES])
    titles = {data.spec.name: f"{data.spec.name}: {data.describe()}" for data in context.sets}
    text, markdown = [], []
    for name, rows in tables.items():
        header, cells = report.table_rows(rows)
        text += ["", titles[name], report.format_text(header, cells)]
        markdown += ["", f"## {titles[name]}", "", report.format_markdown(header, cells)]
    if ddp is not None and ddp.ok_runs:
        workers = context.workers
        runs_text = ", ".join(f"{rate:,.0f}" for rate in ddp.rates())
        ddp_line = (
            f"2-rank DDP (gloo, {max(1, workers // DDP_RANKS)} worker(s) per rank, an all-reduce every step): "
            f"{ddp.images_per_s:,.0f} img/s (runs: {runs_text}) vs one process with {workers} workers "
            f"{single.images_per_s:,.0f} img/s (runs: {', '.join(f'{rate:,.0f}' for rate in single.rates())}); "
            f"DDP / one process in each round: {', '.join(f'{d / o:.2f}x' for d, o in _paired_rates(ddp, single))}"
        )
        text += ["", ddp_line]
        markdown += ["", "## DDP", "", ddp_line + "."]
    text += ["", "Targets (" + main_set + "):", *("  " + verdict.line() for verdict in verdicts)]
    markdown += ["", f"## Targets ({main_set})", "", *(f"- {verdict.line()}" for verdict in verdicts)]
    chart = context.out / "results.png"
    charts = []
    title = f"lance_hpc loader benchmark, local disk - {context.machine.split(';')[0]}"
    if report.chart(chart, lambda: report.bar_chart(tables, chart, title)):
        markdown += ["", f"![loader throughput]({chart.name})"]
        charts.append(chart)
    return SectionReport(text, markdown, verdicts, charts, {"exactly_once": asdict(check) if check else None})
