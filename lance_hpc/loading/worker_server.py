"""The DataLoader workers' server: a process that imports, once, what every worker needs (torch,
the decoders, Lance, lance_hpc's readers) and then forks a worker for each request, which is
ready at once (see :mod:`lance_hpc.loading.workers` for the workers themselves).

A rank starts it as early as it can: ``python -m lance_hpc.run`` does so from its spec before it
imports torch itself (:func:`start_for_spec_file`), so that the server's imports run on
another core while the rank's run, and the workers of the first loader are not waited for.
This module imports nothing heavy for that reason.

Workers get this process's ``sys.path`` when they fork, but the environment of the moment the
server started; what a worker needs to know of the rank comes with its init function instead.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import BaseContext

from lance_hpc.imports import SAFE_PATH_VARIABLE
from lance_hpc.signals import PREEMPTION_SIGNALS, PROFILE_SIGNAL

# Imported by the server before any worker forks from it. Lance is imported, never used, there: no
# Lance runtime or thread exists in the server, so its forks are safe (a process that has read
# through Lance must not fork; the rank never does).
PRELOAD = ("lance_hpc.loading.worker_preload",)

# SLURM sends its preemption warning (USR2) and SIGTERM (scancel, time limit) to every process of a
# job step. The rank process turns them into a checkpoint at the next step boundary; the worker
# server and the workers must not die of them first, which would fail the epoch instead (and lose
# the batches they already prepared). SIGKILL, which follows SIGTERM, still ends them. The same
# holds for SIGINT (Ctrl-C), which a terminal sends to every process of its foreground group, and for
# USR1, which asks the rank for a profiler trace.
RANK_SIGNALS = (*PREEMPTION_SIGNALS, PROFILE_SIGNAL)


def start() -> BaseContext:
    """The multiprocessing context whose processes fork from the server, which starts on the first
    call and imports in the background. The server and its forks start with :data:`RANK_SIGNALS`
    blocked (see :func:`rank_signals_blocked`); a worker unblocks them once it ignores them
    (:func:`lance_hpc.loading.workers.init_worker`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    atexit.unregister(stop)  # once, and after the workers' own exit hook (which runs first)
    atexit.register(stop)
    with rank_signals_blocked(), safe_path_for_children():
        forkserver.ensure_running()
    return context


@contextlib.contextmanager
def rank_signals_blocked() -> Iterator[None]:
    """Block :data:`RANK_SIGNALS` in this thread while the server starts: a blocked signal stays
    blocked across fork and exec, so the server, and each worker it forks, is never ended by one.
    Ignoring them would not be enough: torch's worker loop makes SIGTERM fatal again before it runs
    the worker's init function, and a SIGTERM sent to every process of the step in between ended
    the worker. Blocked, it waits until the worker ignores it, which discards it. A signal sent to
    this process meanwhile is delivered when the block ends, not lost."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
    try:
        # multiprocessing's resource tracker starts first, with the same mask, and then unblocks
        # SIGINT and SIGTERM in this thread whatever the mask was: block them again for the server
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start_for_spec_file(spec_file: str) -> bool:
    """Start the server now if the spec in ``spec_file`` names a kind that reads with DataLoader
    workers (as its registered kind says: ``reads_with_workers``) and has workers; True if it did. Its
    imports then run on another core while the rank imports torch and builds its model, and the
    first loader's workers fork from it ready. Only a head start: a spec it cannot read starts
    nothing here, and the rank says what is wrong with it once it loads it."""
    from lance_hpc.errors import UserError
    from lance_hpc.spec.data_section import DataSpec
    from lance_hpc.spec.kinds import named_kind
    from lance_hpc.spec.load import read_own_text
    from lance_hpc.spec.yaml_text import parse_yaml

    try:
        raw, problems = parse_yaml(read_own_text(spec_file))
    except (OSError, UserError):
        return False
    if problems or not isinstance(raw, dict):
        return False
    data = raw.get("data")
    default = DataSpec.model_fields["num_workers"].default
    workers = data.get("num_workers", default) if isinstance(data, dict) else default
    if not named_kind(raw).reads_with_workers or not isinstance(workers, int) or workers <= 0:
        return False
    start()
    return True


def stop() -> None:
    """At exit: SIGKILL the server this process started, if it runs. It holds nothing to save, and a
    rank that ends before its server has imported everything (a rerun that finds its work done, a
    spec it refuses) would otherwise leave it importing on a core until it notices."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    server._forkserver_pid = None


@contextlib.contextmanager
def safe_path_for_children() -> Iterator[None]:
    """The worker server starts as ``python -c ...``, which puts the working directory first on
    its sys.path (unless this process runs with -P) before it imports torch and numpy; with
    PYTHONSAFEPATH=1 set while it starts, it never searches there. Its workers then get this
    process's sys.path, which holds the spec's own import paths (see :mod:`lance_hpc.imports`)."""
    before = os.environ.get(SAFE_PATH_VARIABLE)
    os.environ[SAFE_PATH_VARIABLE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SAFE_PATH_VARIABLE, None)
        else:
            os.environ[SAFE_PATH_VARIABLE] = before
