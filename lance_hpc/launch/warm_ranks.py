"""Local ranks forked from one warm process instead of each started as a fresh interpreter.

A rank spends seconds of CPU importing torch, its compiler (which DDP and FSDP import), Lance and
lance_hpc before it does anything; N local ranks pay that N times, and again at every restart. A
local run starts one server instead, ``python -P -m lance_hpc.launch.warm_ranks FD`` (the same
interpreter, flags and environment a rank gets): it imports what a rank imports while the
launcher gets ready, and then forks the job's check (:mod:`lance_hpc.launch.job_check`) and each
rank of each attempt, which start with those imports done. Nothing is read through Lance in the server, so its forks are safe, as the DataLoader
workers' server's are (:mod:`lance_hpc.loading.worker_server`).

A forked rank is what ``python -P -m lance_hpc.run SPEC`` would be: its own session, the
environment the launcher gives it (in ``os.environ``; a fork keeps the server's in
``/proc/PID/environ``), default signal handling, ``lance_hpc.run`` run as ``__main__``, and a
process name that says which rank it is (``lance_hpc r1`` in ``ps -o comm`` and ``top``). The
server stays its parent: it reports each rank's pid and exit code to the launcher and signals a
rank only while it has not reaped it, so a pid is never signalled after it was reused. The server
dies with the launcher and the ranks with the server (``PR_SET_PDEATHSIG``); it ignores the signals
a terminal or SLURM sends to the launcher's process group, which the launcher forwards to the ranks,
and forks with them blocked, so one sent to a new rank before it holds them waits instead of being lost.

:class:`WarmRanks` is the launcher's side; :class:`WarmRank` stands for one rank as the
``subprocess.Popen`` of a fresh rank would (``pid``, ``returncode``, ``poll``, ``wait``,
``send_signal``, ``kill``). When the server cannot start, the launcher starts fresh ranks instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Protocol

from lance_hpc.imports import child_environment, python_command
from lance_hpc.quiet import exec_children, fork_unread
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
        """Ask the server to signal the rank; it does so only while it has not reaped it. Safe in
        a signal handler (it reads nothing)."""
        if self.returncode is None:
            self.server.send({"signal": [self.pid, int(signum)]})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmRanks:
    """The launcher's side of the server: start it, fork ranks from it, stop it. Its calls may run
    inside the launcher's signal handlers too: a read there is skipped while another is under way,
    and a message sent there waits for the one being sent."""

    def __init__(self, process: subprocess.Popen, connection: socket.socket):
        self.process = process
        self.connection = connection
        self.selector = selectors.DefaultSelector()
        self.selector.register(connection, selectors.EVENT_READ)
        self.ranks: dict[int, WarmRank] = {}
        self.buffer = b""
        self.started: dict[int, int] = {}  # request id -> pid
        self.requests = 0
        self.ready = False
        self.gone = False
        self.reading = False
        self.outbox: list[bytes] = []
        self.sending = False

    @classmethod
    def start(cls) -> WarmRanks | None:
        """The server, importing in the background; None when it cannot be started."""
        ours, theirs = socket.socketpair()
        try:
            with exec_children():
                process = subprocess.Popen(
                    python_command("-m", "lance_hpc.launch.warm_ranks", str(theirs.fileno())),
                    env=child_environment(),
                    pass_fds=[theirs.fileno()],
                    preexec_fn=die_with_parent,
                )
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(process, ours)

    def send(self, message: dict[str, Any]) -> None:
        self.outbox.append(_message(message))
        if self.sending:
            return  # a signal handler's message, sent by the send it interrupted once that is done
        self.sending = True
        try:
            while self.outbox:
                data = self.outbox.pop(0)
                with contextlib.suppress(OSError):  # a server gone is seen by pump()
                    self.connection.sendall(data)
        finally:
            self.sending = False

    def fork(self, environ: dict[str, str], argv: list[str], name: str, module: str = "lance_hpc.run") -> WarmRank | None:
        """A process forked with ``environ`` that runs ``python -P -m MODULE ARGV...`` (a rank, by
        default) in a session of its own; None when the server is gone, failed to get ready (its
        imports failed: a fresh process then says why) or did not answer in time, after which it is
        stopped and never asked again."""
        if self.gone:
            return None
        self.requests += 1
        request = self.requests
        self.send({"start": {"id": request, "environ": environ, "argv": argv, "name": name, "module": module}})
        deadline = time.monotonic() + (5.0 if self.ready else READY_S)
        while request not in self.started:
            if time.monotonic() > deadline or not self.pump(POLL_S):
                self.stop()  # a request it may still answer must not start a process nobody watches
                return None
        self.ready = True
        rank = WarmRank(self, self.started.pop(request))
        self.ranks[rank.pid] = rank
        return rank

    def pump(self, timeout: float) -> bool:
        """Read what the server said within ``timeout`` s; False once it is gone (its ranks died
        with it, each marked killed)."""
        if self.gone:
            return False
        if self.reading:  # a signal handler interrupted a read: the next poll reads
            return True
        self.reading = True
        try:
            if not self.selector.select(timeout):
                return True
            try:
                data = self.connection.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.stop()
                return False
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "started" in message:
                    self.started[int(message["id"])] = int(message["started"])
                elif "exited" in message:
                    pid, code = message["exited"]
                    if pid in self.ranks:
                        self.ranks[pid].returncode = int(code)
            return True
        finally:
            self.reading = False

    def stop(self) -> None:
        """Kill the server (it holds nothing to save; what it forked dies with it) and mark its
        ranks that had not ended as killed."""
        self.gone = True
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for rank in self.ranks.values():
            if rank.returncode is None:
                rank.returncode = -signal.SIGKILL

    def close(self) -> None:
        """Stop the server at the end of the run (its ranks have ended by then)."""
        with contextlib.suppress(OSError):
            self.connection.close()
        self.selector.close()
        self.stop()


def die_with_parent() -> None:
    """In a process the launcher starts (a fresh rank, or the warm server), before it runs: SIGKILL
    when the launcher dies, so none outlives it (a rank's own session no longer hears the terminal)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _message(value: dict[str, Any]) -> bytes:
    """One message of the protocol between the launcher and the server: a line of JSON."""
    return json.dumps(value).encode() + b"\n"


def serve(descriptor: int) -> None:
    """The server: import :data:`PRELOAD`, then fork a process for each request and report its pid
    and exit code, until the launcher closes the connection (or goes); what it forked and still
    runs is then killed."""
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
    selector = selectors.DefaultSelector()
    selector.register(connection, selectors.EVENT_READ)
    buffer = b""
    try:
        while True:
            if selector.select(POLL_S):
                data = connection.recv(65536)
                if not data:
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    request = json.loads(line)
                    if "start" in request:
                        pid = _fork(request["start"], connection)
                        children.add(pid)
                        connection.sendall(_message({"started": pid, "id": request["start"]["id"]}))
                    elif "signal" in request:
                        pid, number = request["signal"]
                        if pid in children:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(pid, number)
            for pid in list(children):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    connection.sendall(_message({"exited": [pid, os.waitstatus_to_exitcode(status)]}))
    except OSError:  # the launcher went: as the end of the connection
        return
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _fork(start: dict[str, Any], connection: socket.socket) -> int:
    """Fork the process ``start`` asks for, with the signals a rank holds blocked until it holds
    them (a signal sent meanwhile waits, and is not lost to this server's ignoring it)."""
    server = os.getpid()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    pid = fork_unread()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return pid
    code = 1
    try:
        connection.close()
        code = _run(start, server, before)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()  # as a fresh interpreter's exit runs them
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run(start: dict[str, Any], server: int, mask: set[Any]) -> int:
    """In the forked child: become ``python -P -m MODULE ARGV...`` as the launcher asked."""
    import runpy

    from lance_hpc.runtime import preemption

    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the server, which dies with the launcher
    if os.getppid() != server:  # the server died between the fork and here
        return 1
    for number in IGNORED:
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if start["module"] == "lance_hpc.run":
        preemption.hold()  # as its first line does: held before the rank is seen by its name
    os.environ.clear()
    os.environ.update(start["environ"])
    sys.argv = ["-m", *start["argv"]]
    libc.prctl(PR_SET_NAME, str(start["name"]).encode()[:15])
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    runpy.run_module(start["module"], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    serve(int(sys.argv[1]))
