"""The DataLoader workers' processes: forked from a server that imported torch once (:func:`worker_context`),
workers that ignore the rank's signals and run one intra-op thread each (:func:`init_worker`), and
their end, at exit or after a read failed for good (:func:`stop_workers_after_failure`)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
from multiprocessing import forkserver
from multiprocessing.context import BaseContext, ForkServerProcess
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from lance_hpc.loading import worker_server
from lance_hpc.loading.reader import keep_batch
from lance_hpc.loading.worker_server import RANK_SIGNALS
from lance_hpc.signals import WATCH_DIR_VARIABLE, init_worker_dumps
from lance_hpc.spec import DataSpec

PR_SET_PDEATHSIG = 1  # prctl(2)


def worker_context() -> BaseContext:
    """Where DataLoader workers come from: forked from a server process ("forkserver") that has
    already imported torch, Lance and the readers, so a worker is ready in a fraction of a second
    rather than the seconds a fresh interpreter takes to import torch (which "spawn" pays in every
    worker, every job). See :mod:`lance_hpc.loading.worker_server`.

    The server starts on the first call (if ``python -m lance_hpc.run`` has not started it yet)
    and imports in the background. It serves every loader of the process; workers get the
    environment of the moment it started, and ignore USR2 and SIGTERM (:data:`RANK_SIGNALS`),
    which are the rank process's to handle.
    """
    context = worker_server.start()
    atexit.unregister(kill_workers)  # registered once, and after multiprocessing's own exit hook,
    atexit.register(kill_workers)  # so that it runs first
    return context


def kill_workers() -> None:
    """SIGKILL this process's DataLoader workers that are still alive: its daemonic children from
    the worker server, which multiprocessing would only SIGTERM at exit. Workers ignore SIGTERM
    (the rank's to handle), so a loader that never told them to stop (one held by a traceback, or
    still iterating when the program ends) would make multiprocessing's exit hook, which
    terminates and then joins every child, wait for them forever. Runs at interpreter exit (see
    :func:`worker_context`), after a failed run too; the workers hold nothing to save."""
    for child in multiprocessing.active_children():
        if isinstance(child, ForkServerProcess) and child.daemon:
            child.kill()
            child.join(timeout=10)


def stop_workers_after_failure(loader: DataLoader, batches: Iterator[Any]) -> None:
    """Kill the workers of ``batches`` (an iterator of ``loader``) after a read failed for good.

    Workers ignore SIGTERM (the rank's to handle), so the DataLoader's own shutdown, which joins
    each worker for seconds and then sends SIGTERM, would hold a program that goes on after the
    error for 10 s per loader. The workers hold nothing to save; a later pass starts new ones."""
    for worker in getattr(batches, "_workers", ()):
        if worker.is_alive():
            worker.kill()
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    if getattr(loader, "_iterator", None) is batches:  # persistent workers: the next pass must not reuse them
        loader._iterator = None


def init_worker(_worker_id: int, watch_dir: str | None = None) -> None:
    """DataLoader worker setup: one intra-op thread per worker, so workers do not oversubscribe;
    :data:`RANK_SIGNALS` ignored (torch's worker setup makes SIGTERM fatal); no hold on the
    worker server's life (see :func:`release_forkserver`); stacks written to ``watch_dir`` on the
    watchdog's signal."""
    torch.set_num_threads(1)
    for number in RANK_SIGNALS:
        signal.signal(number, signal.SIG_IGN)  # which discards one sent since the worker forked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_SIGNALS)  # blocked by the server (worker_server.start)
    release_forkserver()
    # SIGKILL when the worker server exits (it follows the rank): a worker stuck in a read that never
    # returns, which never gets to torch's check that its parent lives, would otherwise outlive the job
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    init_worker_dumps(_worker_id, watch_dir)  # the rank's watchdog can ask for this worker's stacks


def release_forkserver() -> None:
    """A process forked by multiprocessing's forkserver inherits the write end of the pipe whose
    closing tells the server that the rank process is gone. Held by a worker, it keeps the server
    (the worker's parent) alive after the rank process dies, so torch's parent watchdog never
    stops the worker: orphans holding memory and data. Closed here, the server exits with the
    rank process and the workers follow it."""
    server = getattr(forkserver, "_forkserver", None)
    descriptor = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and descriptor is not None:
        with contextlib.suppress(OSError):
            os.close(descriptor)
        server._forkserver_alive_fd = None


def data_loader(dataset: Any, data: DataSpec, pin_memory: bool, persistent: bool, **kwargs: Any) -> DataLoader:
    workers = data.num_workers
    extra: dict[str, Any] = {}
    if workers > 0:
        extra = dict(
            multiprocessing_context=worker_context(),
            persistent_workers=persistent,
            prefetch_factor=data.prefetch_factor,
            # the rank's watch dir, set after the worker server may have started
            worker_init_fn=functools.partial(init_worker, watch_dir=os.environ.get(WATCH_DIR_VARIABLE)),
        )
    return DataLoader(dataset, num_workers=workers, pin_memory=pin_memory, collate_fn=keep_batch, **extra, **kwargs)
