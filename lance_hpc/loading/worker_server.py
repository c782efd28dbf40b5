"""The DataLoader workers' server: a process that holds, imported once, what every worker needs
(torch, the decoders, Lance, lance_hpc's readers) and forks a worker for each request, which is
ready at once (see :mod:`lance_hpc.loading.workers` for the workers themselves).

A rank forks it from itself (:func:`start_for_spec_file`, which ``python -m lance_hpc.run`` calls
first): the rank imports what the workers need, which it needs too, and forks the server before it
reads anything through Lance, so neither pays for those imports twice. Anywhere else (a script's
:class:`~lance_hpc.Loader`, which may have read through Lance already, and a process must not fork
once it has), the server starts as multiprocessing starts it, a fresh interpreter that imports them
(:func:`start`).

Workers get this process's ``sys.path`` when they fork, but the environment of the moment the
server started; what a worker needs to know of the rank comes with its init function instead.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import multiprocessing
import os
import signal
import socket
import warnings
from collections.abc import Iterator
from multiprocessing import connection, forkserver, resource_tracker, util
from multiprocessing.context import BaseContext
from typing import Any

from lance_hpc.imports import SAFE_PATH_VARIABLE
from lance_hpc.quiet import FORK_WARNING, fork_unread
from lance_hpc.signals import PREEMPTION_SIGNALS, PROFILE_SIGNAL

# Imported by the server before any worker forks from it. Lance is imported, never used, there: no
# Lance runtime or thread exists in the server, so its forks are safe (a process that has read
# through Lance must not fork; a rank forks the server before it reads).
PRELOAD = ("lance_hpc.loading.worker_preload",)
# The arguments of multiprocessing.forkserver.main that a forked server is run with; a Python whose
# forkserver takes others (an authentication key, say) gets a server started as multiprocessing does.
SERVER_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")

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
    """Fork the server from this process now if the spec in ``spec_file`` names a kind that reads
    with DataLoader workers (as its registered kind says: ``reads_with_workers``) and has workers;
    True if it did. Call it before this process reads anything through Lance. The first loader's
    workers then fork from the server ready. Only a head start: a spec it cannot read starts
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
    fork_from_here()
    return True


def fork_from_here() -> BaseContext:
    """The multiprocessing context whose processes fork from a server forked from this process,
    once this process has imported :data:`PRELOAD`: the server holds those imports already, as a
    server that imports them would after a few seconds. This process must not have read anything
    through Lance yet (its threads are then those the imports start, which a server that imports
    them has as well). Signals as :func:`start` sets them."""
    with warnings.catch_warnings():  # the server's filters (worker_preload's) are not this process's
        for module in PRELOAD:
            __import__(module)
    context = multiprocessing.get_context("forkserver")
    server: Any = getattr(forkserver, "_forkserver", None)  # multiprocessing's own, as start() uses it
    parameters = tuple(inspect.signature(forkserver.main).parameters)
    if parameters != SERVER_MAIN_PARAMETERS or not hasattr(server, "_forkserver_alive_fd"):
        return start()
    if server._forkserver_pid is not None:
        return context
    context.set_forkserver_preload(list(PRELOAD))
    atexit.unregister(stop)  # as start() does
    atexit.register(stop)
    with rank_signals_blocked():
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # closed in every client: the server ends when all are gone
            try:
                pid = fork_unread()
            except OSError:  # no memory or processes left for a fork: a fresh server, as anywhere else
                os.close(alive_r)
                os.close(alive_w)
                return start()
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return context


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked server's life: multiprocessing's own server loop, with :data:`PRELOAD` already
    imported, until the last client is gone; never returns to the code of the process it forked
    from (nor runs its exit hooks)."""
    code = 1
    try:
        os.close(alive_w)
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=UserWarning)  # as worker_preload sets it
        forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit:  # the loop's way to end when the clients are gone
        code = 0
    finally:
        os._exit(code)


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
