"""The signals a rank's processes take, in one place below everything that sends or handles them.

- A rank stops at its next step boundary on :data:`PREEMPTION_SIGNALS` (USR2: SLURM's warning
  before the time limit, save and requeue; TERM: scancel, save and stop; INT: Ctrl-C on a local
  run) and records a profiler trace on :data:`PROFILE_SIGNAL` (USR1): see
  :mod:`lance_hpc.runtime.preemption` and :mod:`lance_hpc.runtime.profile`. Its DataLoader workers
  ignore all of them (:mod:`lance_hpc.loading.workers`): the rank acts on them for the job.
- The rank's watchdog (:mod:`lance_hpc.runtime.watchdog`) asks its workers for their Python stacks
  with :data:`WORKER_DUMP_SIGNAL`; each worker sets that up as it starts (:func:`init_worker_dumps`)
  and records its pid with its start time, which is how the watchdog knows a pid is still that worker.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

from lance_hpc.storage.files import write_file

# USR2: SLURM's --signal before the time limit, or submitit's preemption signal: save and requeue.
REQUEUE_SIGNAL = signal.SIGUSR2
# SIGTERM: scancel, or a preemption that SLURM requeues by itself: save and stop.
STOP_SIGNAL = signal.SIGTERM
# SIGINT: Ctrl-C on a local run: save and stop, like SIGTERM.
INTERRUPT_SIGNAL = signal.SIGINT
PREEMPTION_SIGNALS = (INTERRUPT_SIGNAL, STOP_SIGNAL, REQUEUE_SIGNAL)  # in rising precedence
# Not a stop: record a profiler trace of the next train.profile.steps steps (lance_hpc.runtime.profile).
PROFILE_SIGNAL = signal.SIGUSR1

# The directory every process of a rank (its DataLoader workers too) writes its stacks under.
WATCH_DIR_VARIABLE = "LANCE_HPC_WATCH_DIR"
# What a rank sends its DataLoader workers to make them write their stacks (faulthandler).
WORKER_DUMP_SIGNAL = signal.SIGRTMIN + 3


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/<pid>/stat field 22; the
    fields after the command name, which may hold spaces, start at 3), or None if it is not there."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[22 - 3])
    except OSError:
        return None


def init_worker_dumps(worker_id: int, directory: str | None) -> None:
    """In a DataLoader worker: write this process's stacks to ``directory`` (the rank's watch dir) on WORKER_DUMP_SIGNAL."""
    if not directory:
        return
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    stacks = Path(directory) / "stacks"
    try:
        stacks.mkdir(parents=True, exist_ok=True)
        # Named by pid too: a rank's training and evaluation loaders each have a worker 0.
        name = f"rank-{rank}-worker-{worker_id}-{os.getpid()}"
        target = open(stacks / f"{name}.txt", "w")  # noqa: SIM115 (held for faulthandler)
        faulthandler.register(WORKER_DUMP_SIGNAL, file=target, all_threads=True, chain=False)
        write_file(stacks / f"{name}.pid", f"{os.getpid()} {start_time(os.getpid())}")  # the pair names this process
    except OSError:
        pass  # a worker without stack dumps still works
