"""The object-storage section: every lance_hpc strategy reading the main data set over the S3
protocol from the benchmark server (s3_server) at first-byte latencies of 0, 25 and 50 ms, next to
the same strategy on local disk in the same run.

The server serves the very files the local rows read, so the two differ only in the path to the
bytes. Per configuration the table gives images/s, the ratio to local disk and to its own 0 ms,
what the store would bill (GET requests and bytes per image, from the server's counters over the
measuring window), the loader's CPU per image (main process and workers), and the server's CPU per
image, which shares the machine's cores but is not the loader's work. A last row reads the default
strategy at 25 ms with a node-local cache (``data.cache``): one epoch fills it, the next is measured,
against local disk and against the GET requests of an epoch read from the store.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import report
from benchmarks.datasets import DataSet
from benchmarks.local import set_configs
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

LATENCIES_MS = (0.0, 25.0, 50.0)
TINY_LATENCIES_MS = (25.0,)  # the cache's latency; one S3 row per strategy keeps --tiny short
# The default strategy with a node-local cache (data.cache), over S3 at this latency: one epoch
# fills the cache, the next is measured.
CACHE_LATENCY_MS = 25.0
CACHE_LABEL = "lance_hpc map/distributed + data.cache"
CACHE_STORAGE = f"S3 {CACHE_LATENCY_MS:g} ms, 2nd epoch"


def latencies(context: Context) -> tuple[float, ...]:
    return TINY_LATENCIES_MS if context.tiny else LATENCIES_MS


def dataset_name(name: str, latency_ms: float) -> str:
    """The ``Measurement.dataset`` of a configuration over S3: the set's name and the latency."""
    return f"{name}-s3-{latency_ms:g}ms"


def cache_parent(context: Context) -> Path:
    """Where the cache row's measurements keep their node-local caches (a copy of the data set
    each; the benchmark deletes them when it ends). Absolute: the spec refuses a relative one."""
    return (context.out / "work" / "node_cache").resolve()


def s3_measurement(context: Context, data: DataSet, latency_ms: float, label: str, style: str, sampler: str) -> Measurement:
    """A lance_hpc strategy reading ``data`` through the S3 server at ``latency_ms`` for a whole
    epoch, with the server's counters over the window (the choose section shares these rows)."""
    server = context.server(latency_ms)
    fields = strategy_fields(
        data, style, sampler, context.workers, context.s3_uri(server, data.lance_uri), server.storage_options()
    )
    common = {**common_fields(data, context), "dataset": dataset_name(data.spec.name, latency_ms)}
    return Measurement(label, "lance_hpc", data=fields, store_counters=True, full_epoch=True, **common)


def configs(context: Context) -> list[Measurement]:
    """Each strategy on local disk (shared with the local section when both run), then over S3 at
    each latency; every one reads a whole epoch (a few seconds), so local and S3 rows cover the same
    rows, and the S3 client's warm-up (connections, the throttle's ramp) weighs as it would in training."""
    data = context.sets[0]
    local_labels = {label for label, _, _ in STRATEGIES}
    found = [config for config in set_configs(data, context, with_ddp=False) if config.label in local_labels]
    for latency in latencies(context):
        found += [s3_measurement(context, data, latency, label, style, sampler) for label, style, sampler in STRATEGIES]
    server = context.server(CACHE_LATENCY_MS)
    fields = strategy_fields(
        data, "map", "distributed", context.workers, context.s3_uri(server, data.lance_uri), server.storage_options()
    )
    fields["cache"] = {"dir": str(cache_parent(context)), "max_gb": 100}
    common = {**common_fields(data, context), "dataset": dataset_name(data.spec.name, CACHE_LATENCY_MS)}
    found.append(
        Measurement(CACHE_LABEL, "lance_hpc", data=fields, store_counters=True, full_epoch=True, warmup_epochs=1, **common)
    )
    return found


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    name = context.sets[0].spec.name
    grid = {
        label: {latency: summaries[(dataset_name(name, latency), label)] for latency in latencies(context)}
        for label, _, _ in STRATEGIES
    }
    local = {label: summaries[(name, label)] for label in grid}
    cached = summaries.get((dataset_name(name, CACHE_LATENCY_MS), CACHE_LABEL))
    header, rows = report.object_storage_rows(local, grid)
    verdicts = report.object_storage_targets(local, grid, DEFAULT_STRATEGY)
    if cached is not None:
        rows.append(report.cache_row(CACHE_LABEL, CACHE_STORAGE, cached, local[DEFAULT_STRATEGY]))
        verdicts.append(report.cache_target(cached, local[DEFAULT_STRATEGY], grid[DEFAULT_STRATEGY][CACHE_LATENCY_MS]))
    title = (
        f"object storage: {name} over the S3 protocol from a server on loopback, by first-byte latency "
        f"({context.workers} workers, batch {context.sets[0].spec.batch_size})"
    )
    text = [
        "",
        title,
        report.format_text(header, rows),
        "",
        "Targets (object storage):",
        *("  " + verdict.line() for verdict in verdicts),
    ]
    markdown = [
        "",
        f"## {title[0].upper()}{title[1:]}",
        "",
        report.format_markdown(header, rows),
        "",
        report.OBJECT_STORAGE_NOTE,
        "",
        "## Targets (object storage)",
        "",
        *(f"- {verdict.line()}" for verdict in verdicts),
    ]
    chart = context.out / "object_storage.png"
    charts = []
    chart_title = f"lance_hpc over S3 by first-byte latency - {context.machine.split(';')[0]}"
    if report.chart(chart, lambda: report.object_storage_chart(local, grid, chart, chart_title)):
        markdown += ["", f"![object storage throughput]({chart.name})"]
        charts.append(chart)
    return SectionReport(text, markdown, verdicts, charts)
