"""Ports for the ranks' rendezvous (MASTER_PORT). Kept apart from the launcher, the batch script's
renderer and the ranks' environment, which all use it, so that none pulls the others' imports (the
launcher's are torch and the data layer).

- Local ranks get a port free on loopback now (:func:`free_port`).
- A SLURM job's batch step, which runs on the node of rank 0, listens on a port free there from
  the moment it picks it and exports it for every task (:func:`master_port_lines`): the job's own
  port (drawn by its job id) if nothing holds it, else a free one drawn at random from the same
  range, never one of the kernel's ephemeral ports. On a shared node any job or service may hold
  the job's port; and the next port up would be the port of the next job, whose batch step, on the
  same node at the same moment, would pick it too. Rank 0 takes the listening socket over
  (:func:`take_held_port`), so nothing can take the port between the pick and rank 0's start;
  where it cannot (a script that skips those lines), it listens itself and waits a little for a
  port that is taken (:func:`lance_hpc.runtime.environment.process_group`).
- A task that finds no MASTER_PORT (a script of the user's own that skips the batch step's lines)
  falls back to the job-id port (:func:`port_for_job`), which every rank derives alike.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import struct
from collections.abc import MutableMapping

# Ports derived from a job id fall in this range (submitit's TorchDistributedEnvironment uses the same).
PORT_RANGE = (20000, 60000)
# How many ports drawn at random the batch step tries after the job-id port before it leaves the
# choice to the fallback.
PORTS_TRIED = 100
# The variable that names, for rank 0, the socket on which the batch step hands over the port it
# holds; the names it makes start with this prefix.
HANDOFF_VARIABLE = "LANCE_HPC_PORT_HANDOFF"
HANDOFF_PREFIX = "lance_hpc-port-"
# How long rank 0 waits for the holder to answer on that socket.
HANDOFF_TIMEOUT_S = 10.0

# What the batch step runs, with the node's own python3 -I (isolated: no working directory on
# sys.path, no PYTHON* variables, no site packages), so it needs neither lance_hpc nor the job's
# environment, only the standard library (of Python 3.6 or newer); a container job's host has it
# too. It listens on a port nothing holds, on every address (as rank 0 will): the job's own port,
# one drawn by the job id, unless something holds it, else one drawn at random, never one of the
# kernel's ephemeral ports (ip_local_port_range: the kernel hands those to any outgoing connection
# on the node at any moment). It prints that port and the name of a socket (abstract, random, on
# this node) on which it hands the listening socket to rank 0, a process of the same user, once;
# it holds the port until then, so nothing can take it in between, and ends when the batch script
# (argv[2], its pid) ends, a zombie included. Ranks that knock early wait in the listening socket's queue.
HOLD_PORT_PROGRAM = f"""\
import array, errno, os, random, socket, struct, sys
low, high = {PORT_RANGE[0]}, {PORT_RANGE[1]}
job = int("".join(c for c in sys.argv[1] if c.isdigit()) or 0)
script = int(sys.argv[2])
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as limits:
        first_ephemeral, last_ephemeral = map(int, limits.read().split())
except (OSError, ValueError):
    first_ephemeral, last_ephemeral = high, high
ports = [port for port in range(low, high) if not first_ephemeral <= port <= last_ephemeral] or list(range(low, high))
def listen(port):
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            listener.bind((address, port))
            listener.listen(128)
            return listener
        except OSError as error:
            listener.close()
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return None
    return None
tried = [ports[job % len(ports)], *random.sample(ports, min({PORTS_TRIED}, len(ports)))]
listener = next(filter(None, map(listen, tried)), None)
if listener is None:
    print("", flush=True)
    sys.exit(0)
name = "{HANDOFF_PREFIX}" + os.urandom(16).hex()
handoff = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
handoff.bind("\\0" + name)
handoff.listen(8)
handoff.settimeout(1.0)
print(listener.getsockname()[1], name, flush=True)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as stat:
            return stat.read().rpartition(")")[2].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False
while alive(script):
    try:
        rank0, _ = handoff.accept()
    except socket.timeout:
        continue
    with rank0:
        uid = struct.unpack("3i", rank0.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            continue
        rank0.sendmsg([b"port"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [listener.fileno()]))])
        break
"""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_for_job(job_id: str) -> int:
    """The fallback port: every rank of the job derives the same one; consecutive job ids get
    different ports. The batch step's MASTER_PORT wins over it."""
    low, high = PORT_RANGE
    return low + int(re.sub(r"\D", "", job_id) or 0) % (high - low)


def master_port_lines() -> list[str]:
    """Batch-script lines that hold a port free on this node (rank 0's) for srun's tasks and export
    it as MASTER_PORT, with the name rank 0 takes it over by (:func:`take_held_port`); when no
    python3 runs here or every port tried is held, they unset both (one inherited from the
    submitting shell would be as unchecked) and the tasks fall back to the job-id port."""
    hold = f'python3 -I -c {shlex.quote(HOLD_PORT_PROGRAM)} "$SLURM_JOB_ID" "$$"'
    fallback = 'echo "lance_hpc: no free port found on $(hostname); the ranks fall back to the port derived from the job id" >&2'
    return [
        "# the ranks meet on a port held for rank 0 on this node from now on: the job-id port unless something holds it",
        f"exec {{port_holder}}< <({hold})",
        f'read -r -t 60 MASTER_PORT {HANDOFF_VARIABLE} <&"$port_holder" || MASTER_PORT=""',
        "exec {port_holder}<&-",
        f'if [ -n "$MASTER_PORT" ]; then export MASTER_PORT {HANDOFF_VARIABLE}; else unset MASTER_PORT {HANDOFF_VARIABLE}; {fallback}; fi',
    ]


def take_held_port(port: int, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """For rank 0: the file descriptor of the socket that the batch step has listened on ``port``
    with since it picked it, taken over from its holder (see :data:`HOLD_PORT_PROGRAM`), or None
    when there is none to take (no batch step of lance_hpc's, another node, a holder gone, a
    holder of another user, another port): rank 0 then listens on ``port`` itself. The name is
    taken out of ``environ``, so the processes rank 0 starts do not try again."""
    name = environ.pop(HANDOFF_VARIABLE, "")
    if not name.startswith(HANDOFF_PREFIX):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
            holder.settimeout(HANDOFF_TIMEOUT_S)
            holder.connect("\0" + name)
            credentials = holder.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", credentials)[1] != os.getuid():
                return None
            _, descriptors, _, _ = socket.recv_fds(holder, 16, 1)
    except OSError:
        return None
    if not descriptors:
        return None
    listener = socket.socket(fileno=descriptors[0])
    try:
        listening = listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        if listening and listener.type == socket.SOCK_STREAM and listener.getsockname()[1] == port:
            return listener.detach()
    except OSError:
        pass
    listener.close()
    return None
