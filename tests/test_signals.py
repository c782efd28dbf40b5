"""The watchdog signals a DataLoader worker only while the process its pid file names (pid and
start time) still runs, and forgets the pid files an earlier attempt left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lance_hpc.runtime.watchdog import WORKER_DUMP_SIGNAL, Progress, Watchdog, start_time


def sleeper() -> subprocess.Popen:
    """A child process of this one, as a DataLoader worker is of its rank; WORKER_DUMP_SIGNAL's
    default action ends it, so being signalled shows in its exit status."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_the_watchdog_signals_a_worker_only_while_its_pid_and_start_time_still_match(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    child = sleeper()
    try:
        started = start_time(child.pid)
        assert started is not None
        # an earlier attempt's worker whose pid this child now has: another start time
        stale = stacks / f"rank-0-worker-0-{child.pid}.pid"
        stale.write_text(f"{child.pid} {started - 1}")
        other_rank = stacks / "rank-1-worker-0-7.pid"
        other_rank.write_text(f"{child.pid} {started - 1}")
        watchdog = Watchdog(Progress(), tmp_path, 0, 1, factor=5, floor_s=1, ceiling_s=10)
        assert not stale.exists(), "a pid file of an earlier attempt was kept at start"
        assert other_rank.exists(), "a rank forgets only its own workers"
        stale.write_text(f"{child.pid} {started - 1}")  # reused while the job runs
        watchdog.dump_stacks()
        assert child.poll() is None, "a process that only reuses a worker's pid was signalled"
        assert not stale.exists() and "DataLoader worker" not in (stacks / "rank-0.txt").read_text()

        current = stacks / f"rank-0-worker-1-{child.pid}.pid"
        current.write_text(f"{child.pid} {started}")
        watchdog.dump_stacks()
        assert child.wait(timeout=30) == -WORKER_DUMP_SIGNAL, "the worker itself was not signalled"
        assert f"DataLoader worker (pid {child.pid})" in (stacks / "rank-0.txt").read_text()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_worker_records_its_pid_with_its_start_time(tmp_path: Path, monkeypatch) -> None:
    import faulthandler

    from lance_hpc.runtime.watchdog import WATCH_DIR_VARIABLE, init_worker_dumps

    monkeypatch.setenv(WATCH_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    try:
        init_worker_dumps(3)
    finally:
        faulthandler.unregister(WORKER_DUMP_SIGNAL)
    (pid_file,) = (tmp_path / "stacks").glob("rank-0-worker-3-*.pid")
    assert pid_file.read_text() == f"{os.getpid()} {start_time(os.getpid())}"
