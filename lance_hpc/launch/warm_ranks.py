"""Local ranks forked from one warm process instead of each started as a fresh interpreter.

A rank spends seconds of CPU importing torch, its compiler (which DDP and FSDP import), Lance and
lance_hpc before it does anything; N local ranks pay that N times, and again at every restart. A
local run starts one server instead, ``python -P -m lance_hpc.launch.warm_ranks FD`` (the same
interpreter, flags and environment a rank gets): it imports what a rank imports while the
launcher checks the job, and then forks each rank of each attempt, which starts with those imports
done. Nothing is read through Lance in the server, so its forks are safe, as the DataLoader
workers' server's are (:mod:`lance_hpc.loading.worker_server`).

A forked rank is what ``python -P -m lance_hpc.run SPEC`` would be: its own session, the
environment the launcher gives it (in ``os.environ``; a fork keeps the server's in
``/proc/PID/environ``), default signal handling, ``lance_hpc.run`` run as ``__main__``, and a
process name that says which rank it is (``lance_hpc rank1`` in ``ps -o comm`` and ``top``). The
server stays its parent: it reports each rank's pid and exit code to the launcher and signals a
rank only while it has not reaped it, so a pid is never signalled after it was reused. The server
dies with the launcher and the ranks with the server (``PR_SET_PDEATHSIG``); it ignores the signals
a terminal or SLURM sends to the launcher's process group, which the launcher forwards to the ranks.

:class:`WarmRanks` is the launcher's side; :class:`WarmRank` stands for one rank as the
``subprocess.Popen`` of a fresh rank would (``pid``, ``returncode``, ``poll``, ``wait``,
``send_signal``, ``kill``). When the server cannot start, the launcher starts fresh ranks instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Protocol

from lance_hpc.imports import child_environment, python_command
from lance_hpc.quiet import FORK_WARNING, exec_children
from lance_hpc.signals import PREEMPTION_SIGNALS, PROFILE_SIGNAL

# What a rank imports before it runs anything, imported once in the server. Importing runs no Lance
# code and starts no thread but those of the libraries' own loading (OpenBLAS's, jemalloc's).
PRELOAD = (
    "lance_hpc.cli.run",
    "lance_hpc.kinds.rank",
    "lance_hpc.kinds.train",
    "lance_hpc.runtime.trainer",
    "lance_hpc.loading.worker_preload",
    "torch.distributed",
    "torch.utils.tensorboard",
    "torch._dynamo",  # DDP's and FSDP's constructors import it: over a second of CPU a rank
)
# Sent to every process of a terminal's foreground group or a SLURM step: the launcher's to forward.
IGNORED = (*PREEMPTION_SIGNALS, PROFILE_SIGNAL, signal.SIGHUP)
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1  # prctl(2)
READY_S = 120.0  # the server's imports, on a loaded machine
POLL_S = 0.05


class RankProcess(Protocol):
    """A rank as the launcher handles it: a fresh rank's ``subprocess.Popen``, or a :class:`WarmRank`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...
    def kill(self) -> None: ...


class WarmRank:
    """One forked rank, as the launcher sees it (the ``subprocess.Popen`` calls it makes)."""

    def __init__(self, server: WarmRanks, pid: int):
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            self.server.pump(POLL_S)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            self.server.send({"signal": [self.pid, int(signum)]})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmRanks:
    """The launcher's side of the server: start it, fork ranks from it, stop it."""

    def __init__(self, process: subprocess.Popen, connection: socket.socket):
        self.process = process
        self.connection = connection
        self.ranks: dict[int, WarmRank] = {}
        self.buffer = b""
        self.started: list[int] = []
        self.ready = False

    @classmethod
    def start(cls) -> WarmRanks | None:
        """The server, importing in the background; None when it cannot be started."""
        from lance_hpc.launch.local import die_with_parent

        ours, theirs = socket.socketpair()
        try:
            with exec_children():
                process = subprocess.Popen(
                    python_command("-m", "lance_hpc.launch.warm_ranks", str(theirs.fileno())),
                    env=child_environment(),
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    preexec_fn=die_with_parent,
                )
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(process, ours)

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # a server gone is seen by pump()
            self.connection.sendall(json.dumps(message).encode() + b"\n")

    def fork(
        self, environ: dict[str, str], argv: list[str], name: str, module: str = "lance_hpc.run", session: bool = True
    ) -> WarmRank | None:
        """A process forked with ``environ`` that runs ``python -P -m MODULE ARGV...`` (a rank, by
        default) in a session of its own, or in the launcher's process group; None when the server
        is gone or failed to get ready (its imports failed: a fresh process then says why)."""
        self.send({"start": {"environ": environ, "argv": argv, "name": name, "module": module, "session": session}})
        deadline = time.monotonic() + (5.0 if self.ready else READY_S)
        while not self.started:
            if time.monotonic() > deadline or not self.pump(POLL_S):
                return None
        self.ready = True
        rank = WarmRank(self, self.started.pop(0))
        self.ranks[rank.pid] = rank
        return rank

    def pump(self, timeout: float) -> bool:
        """Read what the server said within ``timeout`` s; False once it is gone (its ranks died
        with it, each marked killed)."""
        ready, _, _ = _select(self.connection, timeout)
        if not ready:
            return True
        try:
            data = self.connection.recv(65536)
        except OSError:
            data = b""
        if not data:
            for rank in self.ranks.values():
                if rank.returncode is None:
                    rank.returncode = -signal.SIGKILL
            return False
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "started" in message:
                self.started.append(int(message["started"]))
            elif "exited" in message:
                pid, code = message["exited"]
                if pid in self.ranks:
                    self.ranks[pid].returncode = int(code)
        return True

    def close(self) -> None:
        """Stop the server: the connection closed, it ends (a rank still running is killed by it)."""
        with contextlib.suppress(OSError):
            self.connection.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _select(connection: socket.socket, timeout: float) -> tuple[list[Any], list[Any], list[Any]]:
    try:
        return select.select([connection], [], [], timeout)
    except (OSError, ValueError):
        return [connection], [], []


def serve(descriptor: int) -> None:
    """The server: import :data:`PRELOAD`, then fork a rank for each request and report its pid and
    exit code, until the launcher closes the connection; its remaining ranks are then killed."""
    import warnings

    for number in IGNORED:
        signal.signal(number, signal.SIG_IGN)
    connection = socket.socket(fileno=descriptor)
    try:
        with warnings.catch_warnings():  # filters a module sets as it loads are not the ranks'
            for module in PRELOAD:
                __import__(module)
    except BaseException:  # the launcher starts fresh ranks, which say what is wrong
        return
    children: set[int] = set()
    buffer = b""
    try:
        while True:
            if _select(connection, POLL_S)[0]:
                data = connection.recv(65536)
                if not data:
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    if "start" in request:
                        pid = _fork_rank(request["start"], connection)
                        children.add(pid)
                        connection.sendall(json.dumps({"started": pid}).encode() + b"\n")
                    elif "signal" in request:
                        pid, number = request["signal"]
                        if pid in children:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, number)
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    connection.sendall(json.dumps({"exited": [pid, os.waitstatus_to_exitcode(status)]}).encode() + b"\n")
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _fork_rank(start: dict[str, Any], connection: socket.socket) -> int:
    import warnings

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with warnings.catch_warnings():  # left in both processes: the rank keeps every warning
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=UserWarning)  # this process read nothing
        pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        connection.close()
        code = _run_rank(start)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_rank(start: dict[str, Any]) -> int:
    """In the forked child: become ``python -P -m MODULE ARGV...`` as the launcher asked."""
    import runpy

    if start["session"]:
        os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the server, which dies with the launcher
    libc.prctl(PR_SET_NAME, str(start["name"]).encode()[:15])
    if os.getppid() == 1:  # the server died between the fork and here
        return 1
    for number in IGNORED:
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(start["environ"])
    sys.argv = ["-m", *start["argv"]]
    runpy.run_module(start["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    serve(int(sys.argv[1]))
