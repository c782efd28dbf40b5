"""What each rank is doing, published cheaply, and a watchdog that names a stuck or slow rank.

Each rank's :class:`Progress` is a few attributes its loop sets as it goes (the step, and the phase:
``data`` waiting for the next batch, ``compute`` in the loop's own work, ``collective`` once the
step's first gradient bucket went to the all-reduce, ``checkpoint``, ``log``). A :class:`Watchdog`
thread in every rank publishes it every few seconds to ``<watch dir>/rank-R.json`` (what
``lance-hpc status`` reads) and watches the current step. When a step runs past
``train.watchdog.factor`` times the recent median step (at least ``floor_s``, and always well
before ``train.collective_timeout_s``), every rank writes the Python stacks of its threads, and of
its DataLoader workers, to ``<watch dir>/stacks/``, and rank 0 prints one message naming the stuck
rank (the one not waiting in a collective, or the one that stopped publishing), its host, its
phase and the top of its stack.

Stragglers: at each log point the ranks gather their own work per step (from taking a batch to
sending the first gradient bucket, so time spent waiting for the others is left out) and their
data wait; TensorBoard gets both per rank, and a rank that is ``straggler_factor`` times the median
at two log points in a row is named in the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lance_hpc.errors import UserError
from lance_hpc.signals import WORKER_DUMP_SIGNAL, start_time
from lance_hpc.storage.files import read_regular

PUBLISH_S = 2.0  # how often a rank's progress file is rewritten
STALE_S = 15.0  # a progress file this old belongs to a rank that stopped answering
PHASES = {
    "starting": "starting up",
    "data": "waiting for its next batch",
    "compute": "in the loop's own work (forward, backward, optimizer)",
    "collective": "waiting in a collective (the other ranks)",
    "checkpoint": "saving a checkpoint",
    "log": "reducing metrics at a log point",
    "evaluate": "in an epoch-end hook (evaluation)",
    "done": "finished",
}


@dataclass
class Progress:
    """This rank's step and phase; the loop writes it, the watchdog thread reads it."""

    step: int = 0
    phase: str = "starting"
    phase_since: float = field(default_factory=time.monotonic)
    step_since: float = field(default_factory=time.monotonic)
    batch_ready: float | None = None  # when the step's batch was handed to the loop
    own_s: float | None = None  # the step's own work before its first collective, once it sent one
    recent: deque = field(default_factory=lambda: deque(maxlen=50))  # recent step durations
    first_of_pass: bool = True  # the first step of a pass over a loader starts its workers

    def enter(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def new_pass(self) -> None:
        self.first_of_pass = True

    def wait_for_batch(self, first_of_step: bool) -> None:
        if first_of_step:  # what happened between steps (evaluation, checkpoints) is not the step's
            self.step_since = time.monotonic()
        self.enter("data")

    def got_batch(self) -> None:
        self.batch_ready = time.monotonic()
        self.enter("compute")

    def first_bucket(self) -> None:
        """DDP's comm hook: the step's first gradient bucket goes to the all-reduce."""
        if self.phase != "collective":
            if self.batch_ready is not None and self.own_s is None:
                self.own_s = time.monotonic() - self.batch_ready
            self.enter("collective")

    def step_done(self, step: int, seconds: float) -> None:
        self.step = step
        if not self.first_of_pass:
            self.recent.append(seconds)
        self.first_of_pass = False
        self.step_since, self.own_s, self.batch_ready = time.monotonic(), None, None

    def limit_s(self, factor: float, floor_s: float, ceiling_s: float) -> float:
        """How long the current step may take before it counts as a hang: ``factor`` times the
        recent median, at least ``floor_s``; at most ``ceiling_s``, which also bounds what is not
        an ordinary step (a pass's first, starting its workers; checkpoints, log points, evaluation)."""
        if self.first_of_pass or not self.recent or self.phase in ("checkpoint", "log", "evaluate"):
            return ceiling_s
        return min(max(factor * statistics.median(self.recent), floor_s), ceiling_s)


def stack_text(skip: int | None = None) -> str:
    """Every thread's Python stack in this process, the main thread first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: ident != threading.main_thread().ident)
    parts = []
    for ident in order:
        if ident == skip:
            continue
        parts.append(f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def top_frames(frame: Any, count: int = 3) -> list[str]:
    """The innermost ``count`` frames of a stack, as ``file:line in function: code`` lines."""
    summary = traceback.extract_stack(frame)[-count:]
    return [f"{entry.filename}:{entry.lineno} in {entry.name}: {(entry.line or '').strip()}" for entry in reversed(summary)]


def host_name() -> str:
    """This node by SLURM's name for it (what squeue and sinfo show), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def is_descendant(pid: int, ancestor: int, generations: int = 3) -> bool:
    """Whether process ``pid`` is a child of ``ancestor``, or a child's child (DataLoader workers
    come from a forkserver the rank started), read from /proc."""
    for _ in range(generations):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def recorded_worker(pid_file: Path) -> int | None:
    """The pid a worker's ``.pid`` file names when that very process still runs (its start time is
    the one recorded with it), else None: the worker ended, and its pid may be another process's."""
    try:
        pid_text, _, started = pid_file.read_text().partition(" ")
        pid = int(pid_text)
        return pid if started.strip() and start_time(pid) == int(started) else None
    except (OSError, ValueError):
        return None


def forget_ended_workers(stacks: Path, rank: int) -> None:
    """Delete the ``.pid`` files of ``rank``'s DataLoader workers that no longer run: those an
    earlier attempt of this job left in its stacks folder."""
    for pid_file in stacks.glob(f"rank-{rank}-worker-*.pid"):
        if recorded_worker(pid_file) is None:
            pid_file.unlink(missing_ok=True)


def watch_dir(log_dir: str, name: str, job_id: str | None) -> Path:
    """Where a job's ranks publish their progress and write their stacks."""
    return Path(log_dir) / f"{name}.watch" / (job_id or "local")


class Watchdog(threading.Thread):
    """The thread of one rank: publishes its progress, dumps its stacks when its step overruns,
    and on rank 0 names the stuck rank and stragglers (see the module doc)."""

    def __init__(
        self,
        progress: Progress,
        directory: Path,
        rank: int,
        world_size: int,
        factor: float,
        floor_s: float,
        ceiling_s: float,
        say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True),
        poll_s: float = 0.5,
        on_hang: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(name="lance_hpc-watchdog", daemon=True)
        self.progress, self.directory, self.rank, self.world_size = progress, directory, rank, world_size
        self.factor, self.floor_s, self.ceiling_s = factor, floor_s, ceiling_s
        self.say, self.poll_s = say, poll_s
        self.on_hang = on_hang  # rank 0: what to do with the stuck rank's status once reported (end the attempt)
        self.stuck: dict[str, Any] | None = None  # the status of the rank the last report named
        self.host = host_name()
        self.stop = threading.Event()
        self.dumped_step: int | None = None
        self.reported_step: int | None = None
        self.published = 0.0
        (directory / "stacks").mkdir(parents=True, exist_ok=True)
        path = self.status_path(rank)
        path.unlink(missing_ok=True)  # a status left by an earlier run of this job
        forget_ended_workers(directory / "stacks", rank)  # and the workers it named

    def status_path(self, rank: int) -> Path:
        return self.directory / f"rank-{rank}.json"

    def run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as error:  # the watchdog never takes a rank down
                print(f"lance_hpc.watchdog: rank {self.rank}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.progress.enter("done")
        self.stop.set()
        self.join(timeout=5)
        self.publish(overdue=False)

    def check(self) -> None:
        progress = self.progress
        now = time.monotonic()
        limit = progress.limit_s(self.factor, self.floor_s, self.ceiling_s)
        running = now - progress.step_since
        overdue = progress.phase not in ("starting", "done") and running > limit
        if overdue and self.dumped_step != progress.step:
            self.dumped_step = progress.step
            self.dump_stacks()
        if now - self.published >= PUBLISH_S or overdue:
            self.publish(overdue)
        if self.rank == 0 and overdue and self.reported_step != progress.step:
            time.sleep(min(3 * self.poll_s + PUBLISH_S, 5.0))  # the others publish and dump too
            self.reported_step = progress.step
            self.say(self.report(limit))
            if self.on_hang is not None and self.stuck is not None:
                self.on_hang(self.stuck)

    def publish(self, overdue: bool) -> None:
        progress = self.progress
        now = time.monotonic()
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        status = {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "time": time.time(),
            "step": progress.step,
            "phase": progress.phase,
            "phase_s": round(now - progress.phase_since, 3),
            "step_s": round(now - progress.step_since, 3),
            "median_step_s": round(statistics.median(progress.recent), 4) if progress.recent else None,
            "overdue": overdue,
            "top": top_frames(main) if overdue and main is not None else [],
        }
        path = self.status_path(self.rank)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(status))
        os.replace(temporary, path)
        self.published = now

    def dump_stacks(self) -> None:
        """This rank's threads (all but this one) and its DataLoader workers, into stacks/rank-R.txt."""
        stacks = self.directory / "stacks"
        progress = self.progress
        lines = [
            f"rank {self.rank} on {self.host} (pid {os.getpid()}), step {progress.step}, "
            f"{progress.phase} for {time.monotonic() - progress.phase_since:.1f} s",
            stack_text(skip=threading.get_ident()),
        ]
        forget_ended_workers(stacks, self.rank)
        for pid_file in sorted(stacks.glob(f"rank-{self.rank}-worker-*.pid")):
            pid = recorded_worker(pid_file)
            if pid is not None and is_descendant(pid, os.getpid()):  # not a worker of another run
                with contextlib.suppress(OSError):
                    os.kill(pid, WORKER_DUMP_SIGNAL)
                    lines.append(f"DataLoader worker (pid {pid}): {pid_file.with_suffix('.txt')}")
        (stacks / f"rank-{self.rank}.txt").write_text("\n".join(lines) + "\n")

    def statuses(self) -> list[dict[str, Any]]:
        found = []
        for rank in range(self.world_size):
            try:
                found.append(read_status(self.status_path(rank)))
            except (OSError, ValueError, UserError):
                found.append({"rank": rank, "host": "?", "time": 0.0, "phase": "starting", "step": -1, "top": []})
        return found

    def report(self, limit: float) -> str:
        """One message naming the stuck rank: one that stopped answering, else the one furthest
        behind that is not waiting in a collective."""
        statuses = self.statuses()
        now = time.time()
        silent = [status for status in statuses if now - status["time"] > STALE_S]
        busy = [status for status in statuses if status not in silent and status["phase"] != "collective"]
        candidates = silent or busy or statuses
        stuck = self.stuck = min(candidates, key=lambda status: (status["step"], -status.get("phase_s", 0.0)))
        if stuck in silent:
            what = f"stopped answering {now - stuck['time']:.0f} s ago (its watchdog thread is blocked: native code holding the GIL, or the process died)"
        else:
            what = f"is stuck {PHASES.get(stuck['phase'], stuck['phase'])} for {stuck.get('phase_s', 0):.0f} s"
        median = stuck.get("median_step_s")
        lines = [
            f"lance_hpc.watchdog: rank {stuck['rank']} on {stuck['host']} {what}, at step {stuck['step']} "
            f"(a step past {limit:.0f} s counts as a hang; recent steps took {median if median is not None else '?'} s)",
        ]
        if stuck.get("top"):
            lines.append("  top of its stack:")
            lines += [f"    {frame}" for frame in stuck["top"]]
        waiting = [str(status["rank"]) for status in statuses if status["phase"] == "collective"]
        if waiting:
            lines.append(f"  waiting for it in a collective: rank {', '.join(waiting)}")
        lines.append(f"  every rank's stacks (and its DataLoader workers'): {self.directory / 'stacks'}")
        return "\n".join(lines)


class Stragglers:
    """Rank 0's view of each rank's own work per step over log windows; names a rank that is
    ``factor`` times the median at two log points in a row."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.flagged: dict[int, int] = {}

    def check(self, own_s: list[float], wait_s: list[float], hosts: list[str] | None = None) -> str | None:
        if len(own_s) < 2:
            return None
        work = [own + wait for own, wait in zip(own_s, wait_s)]
        median = statistics.median(work)
        slow = [rank for rank, value in enumerate(work) if value > self.factor * median and value - median > 1e-3]
        self.flagged = {rank: self.flagged.get(rank, 0) + 1 for rank in slow}
        named = [rank for rank, count in self.flagged.items() if count == 2]
        if not named:
            return None
        parts = [
            f"rank {rank}{f' on {hosts[rank]}' if hosts else ''}: {work[rank]:.3f} s per step ({own_s[rank]:.3f} s of its own "
            f"work, {wait_s[rank]:.3f} s of data wait) against a median of {median:.3f} s over the ranks"
            for rank in named
        ]
        return "lance_hpc.watchdog: straggler " + "; ".join(parts) + " (at two log points in a row; the other ranks wait for it)"


def read_status(path: Path) -> dict[str, Any]:
    """A rank's published status: a small JSON object, read without following a link or waiting on
    a FIFO (``status`` reads these from a watch directory under the job's log directory)."""
    found = read_regular(path, STATUS_BYTES, fix=f"remove {path}")
    if found is None:
        raise FileNotFoundError(path)
    status = json.loads(found)
    if not isinstance(status, dict):
        raise ValueError(f"{path} holds no JSON object")
    return status


STATUS_BYTES = 1024 * 1024  # a rank's status is a few hundred bytes


def activity_line(directory: Path) -> str | None:
    """What a running job's ranks published last, in one line for ``lance-hpc status``: a stuck
    rank first, else the step and phases; None when nothing was published."""
    statuses = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            statuses.append(read_status(path))
        except (OSError, ValueError, UserError):
            continue  # gone, cut short, or not a regular file of the size a rank writes
    if not statuses:
        return None
    now = time.time()
    live = [status for status in statuses if status.get("phase") != "done"]
    if not live:
        return None
    stuck = [status for status in live if status.get("overdue")]
    silent = [status for status in live if now - status["time"] > STALE_S]
    if stuck:
        worst = min(stuck, key=lambda status: (status["step"], -status.get("phase_s", 0.0)))
        waiting = [status for status in stuck if status["phase"] != "collective"] or [worst]
        worst = min(waiting, key=lambda status: (status["step"], -status.get("phase_s", 0.0)))
        return (
            f"STUCK: rank {worst['rank']} on {worst['host']} {PHASES.get(worst['phase'], worst['phase'])} for "
            f"{worst.get('phase_s', 0):.0f} s at step {worst['step']}; stacks in {directory / 'stacks'}"
        )
    steps = sorted({status["step"] for status in live})
    phases = ", ".join(
        f"{phase} {sum(status['phase'] == phase for status in live)}" for phase in sorted({s["phase"] for s in live})
    )
    text = f"{len(live)} rank(s) at step {steps[0]}" + (f"..{steps[-1]}" if len(steps) > 1 else "") + f" ({phases})"
    if silent:
        text += f"; rank {', '.join(str(status['rank']) for status in silent)} silent for {max(now - s['time'] for s in silent):.0f} s"
    return text
