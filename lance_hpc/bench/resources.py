"""Resident memory and CPU time of a process and of its DataLoader workers, sampled in a
background thread.

CPU time per image is the benchmark's load-independent measure: on a busy machine images/s drops
with the share of the cores a pipeline gets, but the CPU it spends on each image does not.
psutil is used when it is installed; otherwise the numbers come straight from ``/proc`` (Linux).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

try:
    import psutil
except ImportError:  # psutil is optional
    psutil = None

MIB = 1024 * 1024
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    rss: int  # bytes
    cpu_s: float  # user + system seconds since the process started


def _proc_usage(pid: int) -> Usage | None:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            rss = int(statm.read().split()[1]) * _PAGE_SIZE
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return Usage(rss, (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS)  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _proc_children(pid: int) -> dict[int, int]:
    """Every descendant of ``pid`` and its parent, from /proc/PID/task/*/children."""
    found, pending = {}, [pid]
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
            found.update(dict.fromkeys(kids, parent))
            pending += kids
    return found


def descendants(pid: int) -> list[int]:
    """Pids of every descendant process of ``pid``."""
    if psutil is None:
        return list(_proc_children(pid))
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def usage_tree(pid: int) -> tuple[Usage | None, dict[int, Usage]]:
    """Usage of ``pid`` itself and of each of its workers, by pid: the descendants that have no
    children of their own (a forkserver, say, is a parent of workers, not one)."""
    if psutil is None:
        tree = _proc_children(pid)
        leaves = set(tree) - set(tree.values())
        children = {child: _proc_usage(child) for child in leaves}
        return _proc_usage(pid), {child: usage for child, usage in children.items() if usage is not None}

    def usage(process: psutil.Process) -> Usage | None:
        try:
            with process.oneshot():
                times = process.cpu_times()
                return Usage(process.memory_info().rss, times.user + times.system)
        except psutil.Error:
            return None

    try:
        main = psutil.Process(pid)
        children = main.children(recursive=True)
        parents = {child.ppid() for child in children}
    except psutil.Error:
        return None, {}
    found = {child.pid: usage(child) for child in children if child.pid not in parents}
    return usage(main), {child: value for child, value in found.items() if value is not None}


@dataclass
class Sample:
    seconds: float  # since sampling began
    main: Usage | None
    workers: dict[int, Usage]


@dataclass
class ResourceSampler:
    """Samples this process and its descendants every ``interval_s`` until stopped; :meth:`mark`
    takes an extra sample at an exact moment (first batch, end of the window)."""

    interval_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    started_at: float = 0.0  # perf_counter() when sampling began
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ResourceSampler:
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="bench-resources", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.mark()

    def mark(self) -> Sample:
        main, workers = usage_tree(os.getpid())
        sample = Sample(time.perf_counter() - self.started_at, main, workers)
        with self._lock:
            self.samples.append(sample)
        return sample

    def summary(self, first: Sample, last: Sample, images: int) -> dict[str, Any]:
        """Peak RSS of the main process and of the largest worker (MiB); how much the workers grew
        from a quarter into the window to its end (MiB, summed); CPU ms per image over the window
        (main process and workers)."""
        with self._lock:
            samples = sorted(self.samples, key=lambda sample: sample.seconds)
        main_peak = max((s.main.rss for s in samples if s.main), default=0)
        worker_peak = max((max((u.rss for u in s.workers.values()), default=0) for s in samples), default=0)
        quarter = first.seconds + (last.seconds - first.seconds) / 4
        in_window = [s for s in samples if quarter <= s.seconds <= last.seconds and s.workers]
        growth = 0.0
        if len(in_window) >= 2:
            start, end = in_window[0].workers, in_window[-1].workers
            growth = sum(end[pid].rss - start[pid].rss for pid in set(start) & set(end)) / MIB
        main_cpu = (last.main.cpu_s - first.main.cpu_s) if first.main and last.main else 0.0
        worker_cpu = sum(last.workers[pid].cpu_s - first.workers[pid].cpu_s for pid in set(first.workers) & set(last.workers))
        return {
            "main_rss_mib": main_peak / MIB,
            "worker_rss_mib": worker_peak / MIB,
            "worker_growth_mib": growth,
            "cpu_ms_per_image": 1000 * (main_cpu + worker_cpu) / images if images else 0.0,
            "main_cpu_ms_per_image": 1000 * main_cpu / images if images else 0.0,
        }

    def worker_timeline(self, first: Sample, points: int = 20) -> list[tuple[float, float]]:
        """(seconds after ``first``, all workers' RSS in MiB), at most ``points`` samples."""
        with self._lock:
            samples = [s for s in sorted(self.samples, key=lambda s: s.seconds) if s.seconds >= first.seconds and s.workers]
        step = max(1, len(samples) // points)
        return [
            (round(s.seconds - first.seconds, 2), round(sum(u.rss for u in s.workers.values()) / MIB, 1)) for s in samples[::step]
        ]
