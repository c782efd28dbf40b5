"""Resident memory of a process and of its DataLoader workers, sampled in a background thread.

psutil is used when it is installed; otherwise the numbers come straight from ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

try:
    import psutil
except ImportError:  # psutil is optional
    psutil = None

MIB = 1024 * 1024


def _proc_rss(pid: int) -> int:
    """RSS in bytes from /proc/PID/statm (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _proc_children(pid: int) -> list[int]:
    """All descendants of ``pid`` from /proc/PID/task/*/children."""
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    kids = [int(child) for child in children.read().split()]
            except OSError:
                continue
            found += kids
            pending += kids
    return found


def process_rss(pid: int) -> int:
    """Resident set size of one process in bytes."""
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return 0
    return _proc_rss(pid)


def child_rss(pid: int) -> dict[int, int]:
    """RSS in bytes of every descendant process of ``pid``, by pid."""
    if psutil is not None:
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return {}
        sizes = {}
        for child in children:
            try:
                sizes[child.pid] = child.memory_info().rss
            except psutil.Error:
                continue
        return sizes
    return {child: _proc_rss(child) for child in _proc_children(pid)}


@dataclass
class MemorySample:
    seconds: float
    main_rss: int
    worker_rss: dict[int, int]


@dataclass
class MemorySampler:
    """Samples this process and its descendants every ``interval_s`` until stopped."""

    interval_s: float = 0.2
    samples: list[MemorySample] = field(default_factory=list)
    started_at: float = 0.0  # perf_counter() when sampling began; sample times count from here
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "MemorySampler":
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        pid = os.getpid()
        self.samples.append(MemorySample(time.perf_counter() - self.started_at, process_rss(pid), child_rss(pid)))

    def summary(self, window_start_s: float, window_end_s: float) -> dict[str, float]:
        """Peak RSS of the main process and of the largest worker (MiB), and how much the workers
        grew between the first quarter of the measured window and its end (MiB, summed)."""
        main_peak = max((sample.main_rss for sample in self.samples), default=0)
        worker_peak = max((max(sample.worker_rss.values(), default=0) for sample in self.samples), default=0)
        quarter = window_start_s + (window_end_s - window_start_s) / 4
        in_window = [s for s in self.samples if quarter <= s.seconds <= window_end_s and s.worker_rss]
        growth = 0.0
        if len(in_window) >= 2:
            first, last = in_window[0].worker_rss, in_window[-1].worker_rss
            common = set(first) & set(last)
            growth = sum(last[pid] - first[pid] for pid in common) / MIB
        return {
            "main_rss_mib": main_peak / MIB,
            "worker_rss_mib": worker_peak / MIB,
            "worker_growth_mib": growth,
        }

    def worker_timeline(self, window_start_s: float, points: int = 20) -> list[tuple[float, float]]:
        """(seconds after the first batch, all workers' RSS in MiB), at most ``points`` samples."""
        samples = [s for s in self.samples if s.seconds >= window_start_s and s.worker_rss]
        step = max(1, len(samples) // points)
        return [
            (round(s.seconds - window_start_s, 2), round(sum(s.worker_rss.values()) / MIB, 1)) for s in samples[::step]
        ]
