"""A benchmark's tables: one line per configuration (rate, ratios to the decode limit and the
reference pipelines when measured, CPU, first batch, memory), for the terminal and as markdown."""

from __future__ import annotations

import os
import platform
from typing import Sequence

from lance_hpc.bench.runner import Summary

DECODE_LIMIT = "decode limit"
REFERENCE_MAP = "reference map-style"
REFERENCE_ITERABLE = "reference iterable"
IMAGE_FOLDER = "torchvision ImageFolder"
PEERS = (REFERENCE_MAP, REFERENCE_ITERABLE, IMAGE_FOLDER)


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


def ratio_text(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 and value > 0 else "-"


def rate_text(summary: Summary) -> str:
    if not summary.ok_runs:
        return "failed"
    rates = summary.rates()
    spread = f" ({min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else ""
    return f"{summary.images_per_s:,.0f}{spread}"


def table_rows(summaries: Sequence[Summary]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one data set's table: rate, ratios, first batch, memory."""
    by_label = {summary.label: summary for summary in summaries}
    base = {label: by_label[label].images_per_s if label in by_label else 0.0 for label in (DECODE_LIMIT, *PEERS)}
    header = [
        "configuration",
        "images/s (min-max)",
        "x decode limit",
        "x ref map",
        "x ref iterable",
        "x ImageFolder",
        "CPU ms/img",
        "first batch s",
        "main RSS MiB",
        "worker RSS MiB",
        "worker growth MiB",
    ]
    rows = []
    for summary in summaries:
        rate = summary.images_per_s
        is_limit = summary.label == DECODE_LIMIT
        rows.append(
            [
                summary.label,
                rate_text(summary),
                ratio_text(rate, base[DECODE_LIMIT]),
                *(ratio_text(rate, base[peer]) for peer in PEERS),
                f"{summary.cpu_ms_per_image:.2f}" if summary.ok_runs else "-",
                "-" if is_limit else f"{summary.first_batch_s:.2f}",
                "-" if is_limit else f"{summary.main_rss_mib:,.0f}",
                "-" if is_limit or not summary.worker_rss_mib else f"{summary.worker_rss_mib:,.0f}",
                "-" if is_limit or not summary.worker_rss_mib else f"{summary.worker_growth_mib:+.0f}",
            ]
        )
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
