"""Ports for the ranks' rendezvous (MASTER_PORT). Kept apart from the launcher, the batch script's
renderer and the ranks' environment, which all use it, so that none pulls the others' imports (the
launcher's are torch and the data layer).

- Local ranks get a port free on loopback now (:func:`free_port`).
- A SLURM job's batch step, which runs on the node of rank 0, picks a port free there and exports
  it for every task (:func:`master_port_lines`): the job's own port (drawn by its job id) if
  nothing holds it, else a free one drawn at random from the same range, never one of the kernel's
  ephemeral ports. On a shared node any job or service may hold the job's port; and the next port
  up would be the port of the next job, whose batch step, on the same node at the same moment,
  would pick it too. Rank 0 waits a little for a port taken in the moment between the two
  (:func:`lance_hpc.runtime.environment.process_group`).
- A task that finds no MASTER_PORT (a script of the user's own that skips the batch step's lines)
  falls back to the job-id port (:func:`port_for_job`), which every rank derives alike.
"""

from __future__ import annotations

import re
import shlex
import socket

# Ports derived from a job id fall in this range (submitit's TorchDistributedEnvironment uses the same).
PORT_RANGE = (20000, 60000)
# How many ports drawn at random the batch step tries after the job-id port before it leaves the
# choice to the fallback.
PORTS_TRIED = 100

# What the batch step runs, with the node's own python3 -I (isolated: no working directory on
# sys.path, no PYTHON* variables, no site packages), so it needs neither lance_hpc nor the job's
# environment, only the standard library; a container job's host has it too. It prints a port
# that nothing holds on any address (rank 0 listens on all of them): the job's own port, one drawn
# by the job id, unless something holds it, else one drawn at random. It draws only ports outside
# the kernel's ephemeral range (ip_local_port_range): the kernel hands those to any outgoing
# connection on the node at any moment, so one free now may be taken before rank 0 listens.
PICK_PORT_PROGRAM = f"""\
import errno, random, socket, sys
low, high = {PORT_RANGE[0]}, {PORT_RANGE[1]}
job = int("".join(c for c in sys.argv[1] if c.isdigit()) or 0)
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as limits:
        first_ephemeral, last_ephemeral = map(int, limits.read().split())
except (OSError, ValueError):
    first_ephemeral, last_ephemeral = high, high
ports = [port for port in range(low, high) if not first_ephemeral <= port <= last_ephemeral] or list(range(low, high))
def held(port):
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as probe:
                probe.bind((address, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
    return False
tried = [ports[job % len(ports)], *random.sample(ports, min({PORTS_TRIED}, len(ports)))]
print(next((port for port in tried if not held(port)), ""))
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
    """Batch-script lines that export MASTER_PORT, picked free on this node (rank 0's), for srun's
    tasks; when no python3 runs here or every port tried is held, they unset it (one inherited
    from the submitting shell would be as unchecked) and the tasks fall back to the job-id port."""
    pick = f'python3 -I -c {shlex.quote(PICK_PORT_PROGRAM)} "$SLURM_JOB_ID"'
    fallback = 'echo "lance_hpc: no free port found on $(hostname); the ranks fall back to the port derived from the job id" >&2'
    return [
        "# the ranks meet on a port free on this node, rank 0's: the job-id port unless something holds it",
        f'MASTER_PORT="$({pick})" || MASTER_PORT=""',
        f'if [ -n "$MASTER_PORT" ]; then export MASTER_PORT; else unset MASTER_PORT; {fallback}; fi',
    ]
