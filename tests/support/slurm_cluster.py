"""A real SLURM cluster on this machine, for tests and demos.

``munged``, ``slurmctld`` and two emulated nodes (``slurmd -N node1``, ``slurmd -N node2``) run on
loopback from Debian's packages (SLURM 22.05), with config, state, logs and the munge socket in one
directory and ports picked free at start, so two clusters on one machine do not collide. The
daemons run as root. For people: ``python -m tests.support.slurm_cluster start|stop|status``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lance_hpc.errors import UserError
from tests.support.ports import free_ports

NODES = ("node1", "node2")
PARTITION = "debug"
DEFAULT_DIR = Path(os.environ.get("LANCE_HPC_SLURM_DIR", "/tmp/lance_hpc_slurm"))
# Oversubscribed on purpose: 2 nodes x 2 tasks x a few CPUs each must fit on a 2-core machine.
# SlurmdParameters=config_overrides makes slurmd report these numbers instead of the real ones.
CPUS_PER_NODE = 8
MEMORY_MB_PER_NODE = 16000
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

CONFIG_TEMPLATE = """\
ClusterName=lancehpc
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={controller_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={workdir}/munge.socket,cred_expire=5
StateSaveLocation={workdir}/state
SlurmctldPidFile={workdir}/slurmctld.pid
SlurmctldLogFile={workdir}/slurmctld.log
SlurmdSpoolDir={workdir}/spool-%n
SlurmdPidFile={workdir}/slurmd-%n.pid
SlurmdLogFile={workdir}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=5
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
{node_lines}
PartitionName={partition} Nodes=node[1-{node_count}] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass(frozen=True)
class SlurmCluster:
    """A started test cluster: pass ``env`` to sbatch/srun/submitit so they find it."""

    workdir: Path
    partition: str = PARTITION
    nodes: tuple[str, ...] = NODES
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def at(cls, workdir: Path) -> SlurmCluster:
        workdir = Path(workdir).resolve()
        return cls(workdir=workdir, env={"SLURM_CONF": str(workdir / "slurm.conf")})

    @property
    def log_files(self) -> list[Path]:
        names = ["munged.log", "slurmctld.log", *(f"slurmd-{node}.log" for node in self.nodes)]
        return [self.workdir / name for name in names]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(command, env={**os.environ, **self.env}, capture_output=True, text=True, check=check, timeout=60)

    def node_states(self) -> dict[str, str]:
        result = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        pairs = (line.split() for line in result.stdout.splitlines())
        return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def ensure_installed() -> None:
    """Install Debian's SLURM and munge packages when a command is missing (fresh CI machines)."""
    os.environ["PATH"] = _with_system_path(os.environ.get("PATH", ""))
    missing = [command for command in COMMANDS if shutil.which(command) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise UserError(
            f"SLURM commands missing: {', '.join(missing)}\n"
            f"  fix: sudo apt-get install -y {' '.join(PACKAGES)} (or run the tests as root)"
        )
    print(f"installing {' '.join(PACKAGES)} (missing: {', '.join(missing)})", file=sys.stderr)
    apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=apt_env, check=True)
    subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=apt_env, check=True)


def start(workdir: Path = DEFAULT_DIR, timeout_s: float = 60.0) -> SlurmCluster:
    """Write a fresh config into workdir, start the daemons and wait until every node is idle."""
    ensure_installed()
    cluster = SlurmCluster.at(workdir)
    if (cluster.workdir / "slurmctld.pid").exists() and _alive(cluster.workdir / "slurmctld.pid"):
        raise UserError(f"a test cluster already runs in {cluster.workdir}\n  fix: stop it first (stop subcommand)")
    shutil.rmtree(cluster.workdir, ignore_errors=True)
    (cluster.workdir / "state").mkdir(parents=True)
    cluster.workdir.chmod(0o755)  # munged refuses a socket in a directory others cannot search
    _ensure_hosts_entry(cluster.nodes)
    _write_munge_key(cluster.workdir / "munge.key")
    (cluster.workdir / "slurm.conf").write_text(_config_text(cluster))
    try:
        _start_daemons(cluster)
        _wait_idle(cluster, timeout_s)
    except BaseException:
        stop(cluster)
        raise
    return cluster


def stop(cluster: SlurmCluster) -> None:
    """Cancel every job, then stop the node daemons, the controller and munged."""
    if _alive(cluster.workdir / "slurmctld.pid"):
        jobs = cluster.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            cluster.run("scancel", *jobs, check=False)
            _wait_until(lambda: not cluster.run("squeue", "-h", check=False).stdout.strip(), timeout_s=20)
    pid_files = [cluster.workdir / f"slurmd-{node}.pid" for node in cluster.nodes]
    pid_files += [cluster.workdir / "slurmctld.pid", cluster.workdir / "munged.pid"]
    for pid_file in pid_files:
        _terminate(pid_file)


def _config_text(cluster: SlurmCluster) -> str:
    controller_port, *node_ports = free_ports(1 + len(cluster.nodes))
    node_lines = "\n".join(
        f"NodeName={node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB_PER_NODE} State=UNKNOWN"
        for node, port in zip(cluster.nodes, node_ports)
    )
    return CONFIG_TEMPLATE.format(
        hostname=socket.gethostname(),
        controller_port=controller_port,
        workdir=cluster.workdir,
        node_lines=node_lines,
        partition=cluster.partition,
        node_count=len(cluster.nodes),
    )


def _start_daemons(cluster: SlurmCluster) -> None:
    workdir, conf = cluster.workdir, str(cluster.workdir / "slurm.conf")
    munged = [
        "munged", f"--socket={workdir}/munge.socket", f"--key-file={workdir}/munge.key",
        f"--log-file={workdir}/munged.log", f"--pid-file={workdir}/munged.pid",
        f"--seed-file={workdir}/munged.seed",
    ]  # fmt: skip
    commands = [munged, ["slurmctld", "-f", conf], *(["slurmd", "-f", conf, "-N", node] for node in cluster.nodes)]
    for command in commands:
        result = subprocess.run(command, env={**os.environ, **cluster.env}, capture_output=True, text=True)
        if result.returncode != 0:
            raise UserError(f"{command[0]} failed to start: {result.stderr.strip()}\n{log_hint(cluster)}")


def _wait_idle(cluster: SlurmCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = cluster.node_states()
        if all(states.get(node) == "idle" for node in cluster.nodes):
            return
        time.sleep(0.5)
    shown = ", ".join(f"{node}={states.get(node, 'absent')}" for node in cluster.nodes)
    raise UserError(f"test cluster nodes not idle after {timeout_s:.0f}s ({shown})\n{log_hint(cluster)}")


def log_hint(cluster: SlurmCluster, lines_each: int = 3) -> str:
    """Where the cluster's daemons log, with the last ``lines_each`` lines of each."""
    lines = ["  see the logs:"]
    for log in cluster.log_files:
        tail = log.read_text(errors="replace").splitlines()[-lines_each:] if log.exists() else ["(not written)"]
        lines.append(f"    {log}")
        lines += [f"      | {line}" for line in tail]
    return "\n".join(lines)


def _write_munge_key(path: Path) -> None:
    # A key of our own: the system key belongs to the munge user, and munged runs as root here.
    path.write_bytes(os.urandom(1024))
    path.chmod(0o600)


def _ensure_hosts_entry(nodes: Sequence[str]) -> None:
    """The emulated node names must resolve; map them to loopback in /etc/hosts if they do not."""
    unresolved = []
    for node in nodes:
        try:
            socket.gethostbyname(node)
        except OSError:
            unresolved.append(node)
    if unresolved:
        with open("/etc/hosts", "a") as hosts:
            hosts.write(f"127.0.0.1 {' '.join(unresolved)}  # lance_hpc test cluster\n")


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid_file: Path) -> bool:
    pid = _read_pid(pid_file)
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a daemon that exited but was not reaped yet is gone


def _terminate(pid_file: Path, timeout_s: float = 10.0) -> None:
    pid = _read_pid(pid_file)
    if pid is None or not _alive(pid_file):
        return
    os.kill(pid, 15)
    if not _wait_until(lambda: not _alive(pid_file), timeout_s):
        os.kill(pid, 9)


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _with_system_path(path: str) -> str:
    parts = path.split(os.pathsep) if path else []
    return os.pathsep.join(parts + [part for part in SYSTEM_PATH.split(":") if part not in parts])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.slurm_cluster",
        description="Start, stop or inspect the local two-node SLURM test cluster (needs root).",
    )
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"config/state/log directory [{DEFAULT_DIR}]")
    args = parser.parse_args(argv)
    cluster = SlurmCluster.at(args.dir)
    try:
        if args.action == "start":
            cluster = start(cluster.workdir)
            print(f"test cluster up: nodes {', '.join(cluster.nodes)}, partition {cluster.partition}")
            print(f"use it with:  export SLURM_CONF={cluster.env['SLURM_CONF']}")
        elif args.action == "stop":
            stop(cluster)
            print(f"test cluster in {cluster.workdir} stopped")
        else:
            if not _alive(cluster.workdir / "slurmctld.pid"):
                print(f"no test cluster runs in {cluster.workdir}")
                return 1
            print(cluster.run("sinfo", check=False).stdout + cluster.run("squeue", check=False).stdout, end="")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
