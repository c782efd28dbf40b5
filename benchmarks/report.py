"""The comparison benchmark's output beyond the tables (``lance_hpc.bench.report``): the verdict on
each target, the PNG charts, and the object-storage tables."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from lance_hpc.bench.report import (
    DECODE_LIMIT,
    IMAGE_FOLDER,
    PEERS,
    REFERENCE_ITERABLE,
    REFERENCE_MAP,
    format_markdown,
    format_text,
    machine_description,
    rate_text,
    ratio_text,
    table_rows,
)
from lance_hpc.bench.runner import ExactlyOnce, Summary

# Worker RSS may grow this much over the measured window and still count as flat.
FLAT_GROWTH_MIB = 32.0
FLAT_GROWTH_SHARE = 0.05

# The tables' names, used by the sections through this module.
__all__ = [
    "DECODE_LIMIT",
    "IMAGE_FOLDER",
    "PEERS",
    "REFERENCE_ITERABLE",
    "REFERENCE_MAP",
    "Target",
    "bar_chart",
    "cache_row",
    "cache_target",
    "chart",
    "format_markdown",
    "format_text",
    "machine_description",
    "object_storage_chart",
    "object_storage_rows",
    "object_storage_targets",
    "rate_text",
    "ratio_text",
    "table_rows",
    "targets",
]


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    detail: str

    def line(self) -> str:
        return f"{'met   ' if self.met else 'MISSED'}  {self.name}: {self.detail}"


def section_lines(
    heading: str, title: str, header: list[str], cells: list[list[str]], notes: list[str], verdicts: list[Target]
) -> tuple[list[str], list[str]]:
    """A section's terminal lines and markdown: its title, table, notes and targets."""
    text = [
        "",
        title,
        format_text(header, cells),
        *notes,
        "",
        f"Targets ({heading.lower()}):",
        *("  " + v.line() for v in verdicts),
    ]
    markdown = [
        "",
        f"## {heading}",
        "",
        title,
        "",
        format_markdown(header, cells),
        "",
        *notes,
        "",
        *(f"- {v.line()}" for v in verdicts),
    ]
    return text, markdown


def targets(
    summaries: Sequence[Summary], default: str, ddp: Summary | None, check: ExactlyOnce | None, lance_labels: Sequence[str]
) -> list[Target]:
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
        found.append(
            Target(
                "2-rank DDP vs one process (same total workers)",
                ratio >= 0.9,
                f"{ratio:.2f}x ({ddp.images_per_s:,.0f} vs {single:,.0f} img/s; wanted >= 0.9x)",
            )
        )
        found.append(
            Target(
                "DDP reads every row exactly once",
                check.ok,
                f"{check.rows_read:,} rows read of {check.rows_expected:,}, {check.duplicated} duplicated, "
                f"{check.missing} missing, steps per rank {check.steps_per_rank}",
            )
        )
    lance = [by_label[label] for label in lance_labels if label in by_label and by_label[label].ok_runs]
    if not lance:
        found.append(Target("time to first batch < 3 s, flat worker memory", False, "no lance_hpc run succeeded"))
    else:
        slowest = max(lance, key=lambda summary: summary.first_batch_s)
        found.append(
            Target(
                "time to first batch < 3 s",
                slowest.first_batch_s < 3.0,
                ", ".join(f"{summary.label} {summary.first_batch_s:.2f} s" for summary in lance),
            )
        )
        growing = [
            summary
            for summary in lance
            if summary.worker_growth_mib > max(FLAT_GROWTH_MIB, FLAT_GROWTH_SHARE * summary.worker_rss_mib)
        ]
        found.append(
            Target(
                "worker memory flat over the run",
                not growing,
                ", ".join(f"{summary.label} {summary.worker_growth_mib:+.0f} MiB" for summary in lance)
                + f" (flat: < {FLAT_GROWTH_MIB:.0f} MiB or {FLAT_GROWTH_SHARE:.0%} of the worker's RSS)",
            )
        )
    return found


def chart(path: Path, draw: Callable[[], None]) -> bool:
    """Draws the chart at ``path`` (``draw`` writes it), replacing an old one; False without matplotlib."""
    path.unlink(missing_ok=True)
    try:
        draw()
    except ImportError:
        print("no chart: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return False
    return True


def bar_chart(tables: Mapping[str, Sequence[Summary]], path: Path, title: str) -> None:
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


OBJECT_STORAGE_NOTE = (
    "GET/img and KB/img are the requests and bytes the server answered over the measuring window per image "
    "read: what an object store bills. Loader CPU is the main process and its workers, as on local disk; the "
    "server's CPU (its Python and the kernel's loopback sends) is reported apart, but it runs on the same "
    "cores. In flight: the most requests the server held at once, a measure of the loader's read parallelism."
)


def object_storage_rows(local: dict[str, Summary], grid: dict[str, dict[float, Summary]]) -> tuple[list[str], list[list[str]]]:
    """Per strategy: its local-disk row, then one row per first-byte latency over S3."""
    header = [
        "configuration",
        "storage",
        "images/s (min-max)",
        "x local disk",
        "x 0 ms",
        "GET/img",
        "KB/img",
        "loader CPU ms/img",
        "x local CPU",
        "server CPU ms/img",
        "in flight (peak)",
    ]
    rows = []
    for label, by_latency in grid.items():
        disk = local[label]
        cpu = f"{disk.cpu_ms_per_image:.2f}" if disk.ok_runs else "-"
        rows.append([label, "local disk", rate_text(disk), "1.00x", "-", "-", "-", cpu, "1.00x", "-", "-"])
        zero = by_latency.get(0.0)
        for latency, summary in by_latency.items():
            rows.append(
                [
                    label,
                    f"S3 {latency:g} ms",
                    rate_text(summary),
                    ratio_text(summary.images_per_s, disk.images_per_s),
                    ratio_text(summary.images_per_s, zero.images_per_s) if zero else "-",
                    *_store_cells(summary, disk),
                ]
            )
    return header, rows


def _store_cells(summary: Summary, disk: Summary) -> list[str]:
    """The columns of an S3 row after its ratios: what the store billed, the loader's CPU against
    local disk, the server's CPU, the requests in flight."""
    ok = bool(summary.ok_runs)
    return [
        f"{summary.store_per_image('gets'):.2f}" if ok else "-",
        f"{summary.store_per_image('get_bytes') / 1000:,.1f}" if ok else "-",
        f"{summary.cpu_ms_per_image:.2f}" if ok else "-",
        ratio_text(summary.cpu_ms_per_image, disk.cpu_ms_per_image),
        f"{1000 * summary.store_per_image('cpu_s'):.2f}" if ok else "-",
        f"{summary.store_in_flight:.0f}" if ok else "-",
    ]


def cache_row(label: str, storage: str, cached: Summary, disk: Summary) -> list[str]:
    """The default strategy's epoch read after one that filled its node-local cache, in the columns
    of :func:`object_storage_rows` (the 0 ms column does not apply)."""
    return [
        label,
        storage,
        rate_text(cached),
        ratio_text(cached.images_per_s, disk.images_per_s),
        "-",
        *_store_cells(cached, disk),
    ]


def cache_target(cached: Summary, disk: Summary, uncached: Summary) -> Target:
    """Issue 10's cache target: the epoch after the one that filled the cache at least 0.95x local
    disk, with under 1% of the GET requests of an epoch read from the store."""
    ratio = cached.images_per_s / disk.images_per_s if disk.images_per_s else 0.0
    gets, first = cached.store_per_image("gets"), uncached.store_per_image("gets")
    share = gets / first if first else float("inf")
    counted = any(run[0].store for run in cached.ok_runs)  # no counters read: nothing shows the GETs were few
    met = counted and ratio >= 0.95 and share < 0.01
    return Target(
        "second epoch from the node-local cache vs local disk",
        met,
        f"{ratio:.2f}x ({cached.images_per_s:,.0f} vs {disk.images_per_s:,.0f} img/s; wanted >= 0.95x), "
        f"{100 * share:.2f}% of the GET requests of an epoch from the store ({gets:.3f} vs {first:.2f} "
        "per image; wanted < 1%)",
    )


def object_storage_targets(local: dict[str, Summary], grid: dict[str, dict[float, Summary]], default: str) -> list[Target]:
    """Issue 10's targets for reading over S3: the default strategy near local disk at 25 ms, every
    strategy as fast at 25 and 50 ms as at 0 ms, and no more loader CPU per image than locally."""
    found = []
    if 25.0 in grid[default]:
        rate, base = grid[default][25.0].images_per_s, local[default].images_per_s
        ratio = rate / base if base else 0.0
        found.append(
            Target(
                "default strategy at 25 ms vs local disk",
                ratio >= 0.85,
                f"{ratio:.2f}x ({rate:,.0f} vs {base:,.0f} img/s; wanted >= 0.85x)",
            )
        )
    latency_ratios, cpu_ratios = [], []
    for label, by_latency in grid.items():
        zero = by_latency[0.0].images_per_s if 0.0 in by_latency else 0.0
        for latency, summary in by_latency.items():
            if latency > 0 and 0.0 in by_latency:  # --tiny measures no 0 ms to compare with
                latency_ratios.append((summary.images_per_s / zero if zero else 0.0, f"{label} at {latency:g} ms"))
            disk_cpu = local[label].cpu_ms_per_image
            cpu_ratios.append(
                (
                    summary.cpu_ms_per_image / disk_cpu if disk_cpu and summary.ok_runs else float("inf"),
                    f"{label} at {latency:g} ms",
                )
            )
    if latency_ratios:
        worst, where = min(latency_ratios)
        found.append(
            Target(
                "every strategy with latency vs its own 0 ms",
                worst >= 0.95,
                f"lowest {worst:.2f}x ({where}; wanted >= 0.95x): " + ", ".join(f"{ratio:.2f}x" for ratio, _ in latency_ratios),
            )
        )
    if cpu_ratios:
        worst, where = max(cpu_ratios)
        found.append(
            Target("loader CPU per image over S3 vs local disk", worst <= 1.1, f"highest {worst:.2f}x ({where}; wanted <= 1.1x)")
        )
    return found


def object_storage_chart(local: dict[str, Summary], grid: dict[str, dict[float, Summary]], path: Path, title: str) -> None:
    """One group of bars per strategy: local disk, then S3 at each latency, with min-max spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latencies = sorted({latency for by_latency in grid.values() for latency in by_latency})
    series = [("local disk", "#1f77b4", lambda label: local[label])] + [
        (f"S3, {latency:g} ms", color, lambda label, latency=latency: grid[label][latency])
        for latency, color in zip(latencies, ["#8fbf6f", "#f0a030", "#d62728", "#7f4fbf"])
    ]
    labels = list(grid)
    height = 0.8 / len(series)
    figure, axis = plt.subplots(figsize=(9, 1.2 + 0.35 * len(labels) * len(series)))
    for index, (name, color, pick) in enumerate(series):
        summaries = [pick(label) for label in labels]
        rates = [summary.images_per_s for summary in summaries]
        low = [rate - min(summary.rates(), default=rate) for rate, summary in zip(rates, summaries)]
        high = [max(summary.rates(), default=rate) - rate for rate, summary in zip(rates, summaries)]
        positions = [row + index * height for row in range(len(labels))]
        axis.barh(positions, rates, height=height, xerr=[low, high], color=color, capsize=2, label=name)
        for y, rate, above in zip(positions, rates, high):
            axis.text(rate + above, y, f"  {rate:,.0f}", va="center", fontsize=7)
    axis.set_yticks([row + 0.4 - height / 2 for row in range(len(labels))], labels)
    axis.invert_yaxis()
    axis.set_xlabel("images/s (median; bars span min-max)")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(series), fontsize=8, frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
