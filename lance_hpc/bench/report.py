"""The benchmark's output: a table for the terminal, the same as markdown, a PNG bar chart, and
the verdict on each target."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from lance_hpc.bench.runner import ExactlyOnce, Summary

DECODE_LIMIT = "decode limit"
REFERENCE_MAP = "reference map-style"
REFERENCE_ITERABLE = "reference iterable"
IMAGE_FOLDER = "torchvision ImageFolder"
PEERS = (REFERENCE_MAP, REFERENCE_ITERABLE, IMAGE_FOLDER)
# Worker RSS may grow this much over the measured window and still count as flat.
FLAT_GROWTH_MIB = 32.0
FLAT_GROWTH_SHARE = 0.05


def machine_description() -> str:
    """CPU model, usable cores, memory, accelerator and library versions, in one line."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = 0.0
    import lance
    import torch
    import torchvision

    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{len(os.sched_getaffinity(0))} cores ({model}), {memory_gib:.0f} GiB RAM, {accelerator}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"pylance {lance.__version__}"
    )


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 and value > 0 else "-"


def _rate(summary: Summary) -> str:
    if not summary.ok_runs:
        return "failed"
    rates = summary.rates()
    spread = f" ({min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else ""
    return f"{summary.images_per_s:,.0f}{spread}"


def table_rows(summaries: Sequence[Summary]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one data set's table: rate, ratios, first batch, memory."""
    by_label = {summary.label: summary for summary in summaries}
    base = {label: by_label[label].images_per_s if label in by_label else 0.0 for label in (DECODE_LIMIT, *PEERS)}
    header = ["configuration", "images/s (min-max)", "x decode limit", "x ref map", "x ref iterable",
              "x ImageFolder", "CPU ms/img", "first batch s", "main RSS MiB", "worker RSS MiB", "worker growth MiB"]
    rows = []
    for summary in summaries:
        rate = summary.images_per_s
        is_limit = summary.label == DECODE_LIMIT
        rows.append([
            summary.label,
            _rate(summary),
            _ratio(rate, base[DECODE_LIMIT]),
            *(_ratio(rate, base[peer]) for peer in PEERS),
            f"{summary.cpu_ms_per_image:.2f}" if summary.ok_runs else "-",
            "-" if is_limit else f"{summary.first_batch_s:.2f}",
            "-" if is_limit else f"{summary.main_rss_mib:,.0f}",
            "-" if is_limit or not summary.worker_rss_mib else f"{summary.worker_rss_mib:,.0f}",
            "-" if is_limit or not summary.worker_rss_mib else f"{summary.worker_growth_mib:+.0f}",
        ])
    return header, rows


def format_text(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    align = lambda row: "  ".join(  # noqa: E731 - left-align the name, right-align numbers
        cell.ljust(width) if column == 0 else cell.rjust(width) for column, (cell, width) in enumerate(zip(row, widths))
    )
    return "\n".join([align(header), "  ".join("-" * width for width in widths), *map(align, rows)])


def format_markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    detail: str

    def line(self) -> str:
        return f"{'met   ' if self.met else 'MISSED'}  {self.name}: {self.detail}"


def targets(summaries: Sequence[Summary], default: str, ddp: Summary | None, check: ExactlyOnce | None,
            lance_labels: Sequence[str]) -> list[Target]:
    """The issue's targets, judged on one data set's summaries (``default`` names lance_hpc's default)."""
    by_label = {summary.label: summary for summary in summaries}
    rate = by_label[default].images_per_s if default in by_label else 0.0

    def ratio_target(name: str, label: str, wanted: float) -> Target:
        base = by_label[label].images_per_s if label in by_label else 0.0
        ratio = rate / base if base else 0.0
        return Target(name, ratio >= wanted, f"{ratio:.2f}x ({rate:,.0f} vs {base:,.0f} img/s; wanted >= {wanted}x)")

    found = [
        ratio_target("default strategy vs decode limit", DECODE_LIMIT, 0.9),
        ratio_target("default strategy vs reference map-style", REFERENCE_MAP, 3.0),
        ratio_target("default strategy vs torchvision ImageFolder", IMAGE_FOLDER, 2.0),
    ]
    if ddp is not None and check is None:
        found.append(Target("2-rank DDP run", False, "the DDP run or the single-process epoch failed (see Failed runs)"))
    if ddp is not None and check is not None:
        single = rate
        ratio = ddp.images_per_s / single if single else 0.0
        found.append(Target(
            "2-rank DDP vs one process (same total workers)", ratio >= 0.9,
            f"{ratio:.2f}x ({ddp.images_per_s:,.0f} vs {single:,.0f} img/s; wanted >= 0.9x)",
        ))
        found.append(Target(
            "DDP reads every row exactly once", check.ok,
            f"{check.rows_read:,} rows read of {check.rows_expected:,}, {check.duplicated} duplicated, "
            f"{check.missing} missing, steps per rank {check.steps_per_rank}",
        ))
    lance = [by_label[label] for label in lance_labels if label in by_label and by_label[label].ok_runs]
    if not lance:
        found.append(Target("time to first batch < 3 s, flat worker memory", False, "no lance_hpc run succeeded"))
    else:
        slowest = max(lance, key=lambda summary: summary.first_batch_s)
        found.append(Target(
            "time to first batch < 3 s", slowest.first_batch_s < 3.0,
            ", ".join(f"{summary.label} {summary.first_batch_s:.2f} s" for summary in lance),
        ))
        growing = [summary for summary in lance
                   if summary.worker_growth_mib > max(FLAT_GROWTH_MIB, FLAT_GROWTH_SHARE * summary.worker_rss_mib)]
        found.append(Target(
            "worker memory flat over the run", not growing,
            ", ".join(f"{summary.label} {summary.worker_growth_mib:+.0f} MiB" for summary in lance)
            + f" (flat: < {FLAT_GROWTH_MIB:.0f} MiB or {FLAT_GROWTH_SHARE:.0%} of the worker's RSS)",
        ))
    return found


def bar_chart(tables: dict[str, Sequence[Summary]], path: Path, title: str) -> None:
    """Horizontal bars of images/s per configuration, one panel per data set; the decode limit is a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [s for s in summaries]) for name, summaries in tables.items()]
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 1.2 + 0.45 * sum(len(s) for _, s in panels)), squeeze=False)
    for axis, (name, summaries) in zip(axes[:, 0], panels):
        bars = [summary for summary in summaries if summary.label != DECODE_LIMIT]
        labels = [summary.label for summary in bars]
        rates = [summary.images_per_s for summary in bars]
        low = [rate - min(summary.rates(), default=rate) for rate, summary in zip(rates, bars)]
        high = [max(summary.rates(), default=rate) - rate for rate, summary in zip(rates, bars)]
        colors = ["#9e9e9e" if label in PEERS else "#1f77b4" for label in labels]
        axis.barh(labels, rates, xerr=[low, high], color=colors, capsize=3)
        axis.invert_yaxis()
        limit = next((summary.images_per_s for summary in summaries if summary.label == DECODE_LIMIT), 0.0)
        if limit:
            axis.axvline(limit, color="#d62728", linestyle="--", label=f"decode limit {limit:,.0f} img/s")
            axis.legend(loc="upper right", fontsize=8)
        for y, (rate, above) in enumerate(zip(rates, high)):
            axis.text(rate + above, y, f"  {rate:,.0f}", va="center", fontsize=8)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("images/s (median; bars span min-max)")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
