"""The benchmark's sections: what each measures is chosen by name (``--sections``), every section's
configurations are measured together in one interleaved run, and each section reports its own
tables, chart and targets from the summaries.

A section is two functions: ``configs(context)`` lists its measurements and ``report(context,
summaries)`` turns the summaries into text and markdown. Sections that measure over the S3
protocol ask :meth:`Context.server` for the benchmark server at a first-byte latency; it serves the
data directory (every data set, and whatever a section writes beside them) and is started once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from benchmarks.datasets import DataSet
from benchmarks.report import Target
from benchmarks.s3_server import S3BenchServer, start_server
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import Summary

# lance_hpc's strategies: (label, style, sampler); the first is the default a job spec gets.
STRATEGIES = (
    ("lance_hpc map/distributed", "map", "distributed"),
    ("lance_hpc iterable/sharded_batch", "iterable", "sharded_batch"),
    ("lance_hpc iterable/sharded_fragment", "iterable", "sharded_fragment"),
)
DEFAULT_STRATEGY = STRATEGIES[0][0]


def strategy_fields(
    data: DataSet, style: str, sampler: str, workers: int, uri: str | None = None, storage_options: dict[str, str] | None = None
) -> dict[str, Any]:
    """DataSpec fields for a lance_hpc strategy on ``data`` (or on ``uri``, the same rows elsewhere).
    The decoder resizes only, like the peers (``Measurement.augment`` "none")."""
    fields = dict(
        uri=uri or data.lance_uri,
        style=style,
        sampler=sampler,
        batch_size=data.spec.batch_size,
        num_workers=workers,
        shuffle=True,
        seed=0,
    )
    if storage_options:
        fields["storage_options"] = storage_options
    return fields


def common_fields(data: DataSet, context: Context) -> dict[str, Any]:
    """Measurement fields every pipeline on ``data`` shares: same images, size, batch, workers, window."""
    spec = data.spec
    return dict(
        dataset=spec.name,
        lance_uri=data.lance_uri,
        folder=data.folder,
        image_size=spec.image_size,
        augment="none",
        batch_size=spec.batch_size,
        num_workers=context.workers,
        seconds=context.seconds,
    )


@dataclass
class Context:
    """What every section builds its configurations from."""

    out: Path  # the output directory
    data_dir: Path  # where the data sets are generated; the S3 servers serve this directory
    sets: list[DataSet]  # the first is the main set (photos; --tiny: a small one)
    workers: int  # DataLoader workers for every pipeline that has workers
    seconds: float  # measuring window
    tiny: bool
    machine: str  # report.machine_description()
    _servers: dict[float, S3BenchServer] = field(default_factory=dict)

    def server(self, latency_ms: float) -> S3BenchServer:
        """The S3 benchmark server at this first-byte latency, started on first use."""
        if latency_ms not in self._servers:
            self._servers[latency_ms] = start_server(self.data_dir, latency_ms=latency_ms)
        return self._servers[latency_ms]

    def s3_uri(self, server: S3BenchServer, local_path: str | Path) -> str:
        """The ``s3://`` URI through ``server`` of a path under the data directory."""
        return server.uri(Path(local_path).resolve().relative_to(self.data_dir.resolve()).as_posix())

    def stop_servers(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@dataclass
class SectionReport:
    text: list[str]  # lines for the terminal
    markdown: list[str]  # lines of results.md
    targets: list[Target] = field(default_factory=list)
    charts: list[Path] = field(default_factory=list)
    json: dict[str, Any] = field(default_factory=dict)  # extra entries for results.json


Summaries = dict[tuple[str, str], Summary]  # by (data set, label), as Measurement has them


@dataclass(frozen=True)
class Section:
    help: str  # what the section measures, for --help
    configs: Callable[[Context], list[Measurement]]
    report: Callable[[Context, Summaries], SectionReport]
    runs: int = 2  # runs per configuration unless --runs (or --tiny: 1) says otherwise
    once: tuple[str, ...] = ()  # kinds measured once whatever --runs says (a training job of a minute)
