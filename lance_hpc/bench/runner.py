"""Runs measurements, each in a fresh process, and gathers their results.

A measurement is ``python -P -m lance_hpc.bench._worker CONFIG_JSON``; a DDP measurement is one such
process per rank, started together with a gloo rendezvous on loopback. Rounds are interleaved (every
configuration once, then again) so that a slow spell of a noisy machine hits every configuration
alike, and each configuration's median over the rounds is reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import lance_hpc
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.imports import SAFE_PATH_VARIABLE, python_command
from lance_hpc.runtime.ports import free_port

# A measurement that takes longer than this is stopped and reported as failed.
MEASUREMENT_TIMEOUT_S = 300


# The worker module a measurement runs in (``python -m WORKER CONFIG_JSON``): this package's, or one
# that measures more pipelines (the repository's ``benchmarks.worker``).
WORKER = "lance_hpc.bench._worker"


def _environment(worker: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: this lance_hpc and the worker's package importable even when they
    are not installed, and the working directory never searched (the worker's own children too)."""
    environment = {**os.environ, SAFE_PATH_VARIABLE: "1"}
    roots = [str(Path(lance_hpc.__file__).resolve().parents[1])]
    spec = importlib.util.find_spec(worker.split(".", 1)[0])
    if spec is not None and spec.submodule_search_locations:
        roots.append(str(Path(list(spec.submodule_search_locations)[0]).resolve().parent))
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [*dict.fromkeys(roots), environment.get("PYTHONPATH")]))
    environment.update(extra or {})
    return environment


def _read_result(config: Measurement, returncode: int | None, log_path: Path) -> Result:
    path = Path(config.result_path)
    if path.is_file():
        return Result.from_dict(json.loads(path.read_text()))
    reason = "timed out" if returncode is None else f"exited with {returncode}"
    return Result(
        config.label,
        config.dataset,
        0.0,
        0.0,
        0,
        0,
        0.0,
        0.0,
        0.0,
        0.0,
        rank=config.rank,
        world_size=config.world_size,
        error=f"worker {reason}; see {log_path}",
    )


def _start(config: Measurement, log_path: Path, environment: dict[str, str], worker: str) -> subprocess.Popen:
    Path(config.result_path).unlink(missing_ok=True)
    with open(log_path, "w") as log:
        return subprocess.Popen(
            python_command("-m", worker, config.to_json()),  # without the working directory on sys.path
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
        )


def _wait(process: subprocess.Popen, deadline: float) -> int | None:
    try:
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


def run_measurement(config: Measurement, work_dir: Path, worker: str = WORKER) -> list[Result]:
    """Measure ``config`` in fresh processes: one, or one per rank when ``world_size > 1``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{config.dataset}-{config.label}".replace(" ", "_").replace("/", "_")
    environment = _environment(worker)
    if config.world_size > 1:
        environment = _environment(worker, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    ranks = [
        replace(config, rank=rank, result_path=str(work_dir / f"{stem}.rank{rank}.json")) for rank in range(config.world_size)
    ]
    logs = [work_dir / f"{stem}.rank{rank.rank}.log" for rank in ranks]
    processes = [_start(rank, log, environment, worker) for rank, log in zip(ranks, logs)]
    deadline = time.monotonic() + MEASUREMENT_TIMEOUT_S
    codes = [_wait(process, deadline) for process in processes]
    return [_read_result(rank, code, log) for rank, code, log in zip(ranks, codes, logs)]


@dataclass
class Summary:
    """One configuration over all its runs."""

    label: str
    dataset: str
    runs: list[list[Result]] = field(default_factory=list)  # per run, one result per rank

    @property
    def ok_runs(self) -> list[list[Result]]:
        return [run for run in self.runs if not any(result.error for result in run)]

    @property
    def errors(self) -> list[str]:
        return [result.error for run in self.runs for result in run if result.error]

    def rates(self) -> list[float]:
        """Images/s of each good run; for DDP, all ranks' images over the slowest rank's time."""
        return [
            sum(result.images for result in run) / max(result.seconds for result in run) if len(run) > 1 else run[0].images_per_s
            for run in self.ok_runs
        ]

    @property
    def images_per_s(self) -> float:
        rates = self.rates()
        return statistics.median(rates) if rates else 0.0

    def _median(self, attribute: str) -> float:
        values = [max(getattr(result, attribute) for result in run) for run in self.ok_runs]
        return statistics.median(values) if values else 0.0

    def _per_image(self, value: Callable[[Result], float]) -> float:
        """Median over runs of a per-image figure, its ranks weighted by the images each read."""
        values = [
            sum(value(r) * r.images for r in run) / max(1, sum(r.images for r in run)) if len(run) > 1 else value(run[0])
            for run in self.ok_runs
        ]
        return statistics.median(values) if values else 0.0

    @property
    def worker_cpu_ms_per_image(self) -> float:
        """Median over runs of the DataLoader workers' CPU time per image (the main process left out)."""
        return self._per_image(lambda r: r.cpu_ms_per_image - r.main_cpu_ms_per_image)

    @property
    def data_wait_share(self) -> float:
        """Median over runs of the share of the window spent waiting for the next batch."""
        return self._median("data_wait_share")

    @property
    def cpu_ms_per_image(self) -> float:
        """Median over runs of the CPU time (main process and workers, all ranks) per image."""
        return self._per_image(lambda r: r.cpu_ms_per_image)

    @property
    def first_batch_s(self) -> float:
        return self._median("first_batch_s")

    def _peak(self, attribute: str) -> float:
        return max((getattr(result, attribute) for run in self.ok_runs for result in run), default=0.0)

    @property
    def main_rss_mib(self) -> float:
        return self._peak("main_rss_mib")

    @property
    def worker_rss_mib(self) -> float:
        return self._peak("worker_rss_mib")

    @property
    def worker_growth_mib(self) -> float:
        return self._peak("worker_growth_mib")

    def store_per_image(self, counter: str) -> float:
        """Median over runs of an S3 server counter over the window (``Result.store``) per image read."""
        values = [
            sum(result.store.get(counter, 0.0) for result in run) / max(1, sum(result.images for result in run))
            for run in self.ok_runs
            if run[0].store
        ]
        return statistics.median(values) if values else 0.0

    @property
    def store_in_flight(self) -> float:
        """The most requests the S3 server held at once in any run's window."""
        return max((result.store.get("max_in_flight", 0.0) for run in self.ok_runs for result in run), default=0.0)


@dataclass
class ExactlyOnce:
    """The rows a DDP run read, against one process reading the same epoch."""

    ranks: int
    steps_per_rank: list[int]
    rows_read: int
    rows_expected: int
    duplicated: int
    missing: int

    @property
    def ok(self) -> bool:
        return self.duplicated == 0 and self.missing == 0 and len(set(self.steps_per_rank)) == 1


def exactly_once(ddp_run: list[Result], single_run: list[Result]) -> ExactlyOnce:
    """Compares the multisets of image fingerprints: identical images stay distinguishable by count."""
    read = Counter(fingerprint for result in ddp_run for fingerprint in result.fingerprints)
    expected = Counter(single_run[0].fingerprints)
    return ExactlyOnce(
        ranks=len(ddp_run),
        # +1: the first batch is not among the measured ones
        steps_per_rank=[result.batches + 1 for result in ddp_run],
        rows_read=sum(read.values()),
        rows_expected=sum(expected.values()),
        duplicated=sum((read - expected).values()),
        missing=sum((expected - read).values()),
    )


def run_rounds(
    configs: list[Measurement],
    runs: int | dict[tuple[str, str], int],
    work_dir: Path,
    log: Callable[[str], None] = print,
    worker: str = WORKER,
) -> list[Summary]:
    """Every configuration ``runs`` times (or as often as ``runs[(dataset, label)]`` says), interleaved;
    the order rotates from round to round."""
    summaries = {(config.dataset, config.label): Summary(config.label, config.dataset) for config in configs}
    runs_of = runs if isinstance(runs, dict) else dict.fromkeys(summaries, runs)
    for round_index in range(max(runs_of.values(), default=0)):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            key = (config.dataset, config.label)
            if runs_of[key] <= round_index:
                continue
            started = time.monotonic()
            results = run_measurement(config, work_dir / f"run{round_index}", worker)
            summaries[key].runs.append(results)
            status = next((result.error.strip().splitlines()[-1] for result in results if result.error), "")
            rate = summaries[key].rates()[-1] if not status else 0.0
            log(
                f"  run {round_index + 1}/{runs_of[key]}  {config.dataset:<13} {config.label:<38} "
                + (f"{rate:8,.0f} img/s" if not status else f"FAILED: {status}")
                + f"  ({time.monotonic() - started:.0f} s, load {os.getloadavg()[0]:.1f})"
            )
    return list(summaries.values())
