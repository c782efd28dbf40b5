"""Cluster environment: who am I in this job, and how do the ranks meet?

:func:`detect` reads a mapping of environment variables (default ``os.environ``) and returns a
:class:`DistEnv`, for one of three launchers:

- ``torchrun``: ``RANK`` and ``WORLD_SIZE`` are set (torchrun, or :mod:`lance_hpc.launch.local`, which
  sets the same variables); they win even inside a SLURM allocation.
- ``slurm``: a task started by ``srun`` (``SLURM_STEP_ID`` is set). The master is the first host
  of the node list; the port is the MASTER_PORT the batch step picked free on that node
  (:mod:`lance_hpc.runtime.ports`), or, in a script that skips that step, one derived from the job
  id, so every rank computes the same address without talking to the others.
- ``local``: a plain single process.

:func:`process_group` turns a DistEnv into an initialised ``torch.distributed`` process group.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from submitit.slurm.slurm import SlurmParseException, _parse_node_list

from lance_hpc.errors import UserError
from lance_hpc.runtime.failures import PortInUse
from lance_hpc.runtime.ports import port_for_job, take_held_port
from lance_hpc.runtime.restart_variables import ATTEMPT_VARIABLE
from lance_hpc.slurm.variables import SLURM_VARS

# Words in the errors gloo, NCCL and the TCP store raise when a peer process is gone.
# How long rank 0 keeps trying to listen on a MASTER_PORT that another process holds.
PORT_WAIT_S = 15.0
LOST_PEER_HINTS = ("connection reset", "connection closed", "broken pipe", "timed out", "timeout", "socket")

Launcher = Literal["slurm", "torchrun", "local"]


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    restart_count: int = 0
    attempt: int = 0  # inside the allocation, counted by the restart supervisor (0 without one)
    array_job_id: str | None = None
    array_task_id: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def job_ref(self) -> str | None:
        """The job as scontrol names it: ARRAYID_TASKID for a run of a job array (its bare id
        may be the array's own, which would requeue every run), else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def detect(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """The DistEnv of this process; raises UserError, with the fix, for a misconfigured launch."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if SLURM_VARS["step_id"] in environ and SLURM_VARS["rank"] in environ:
        return _from_slurm_task(environ)
    if SLURM_VARS["job_id"] in environ:
        _check_outside_srun(environ)
    return DistEnv("local", 0, 0, 1, 1, 0, 1, "127.0.0.1", _int(environ, "MASTER_PORT", 0))


def hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``gpu[01-03,07],cpu5`` with submitit's parser."""
    try:
        hosts = _parse_node_list(nodelist)
    except SlurmParseException:
        hosts = []
    if not hosts or not all(hosts):
        raise UserError(f"cannot read the SLURM node list {nodelist!r}: expected a form like node[01-04],gpu7")
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """Expand SLURM's compressed task counts, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise UserError(f"cannot read the SLURM tasks-per-node value {text!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", world_size)
    if world_size > 1 and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        raise UserError(
            f"RANK and WORLD_SIZE={world_size} are set but MASTER_ADDR/MASTER_PORT are not\n"
            "  fix: start the ranks with torchrun (or lance-hpc run --local), which sets all of them"
        )
    return DistEnv(
        launcher="torchrun",
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", 0),
        num_nodes=max(world_size // max(local_world_size, 1), 1),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 0),
        job_id=environ.get(SLURM_VARS["job_id"]),
        restart_count=_int(environ, SLURM_VARS["restart_count"], 0),
        attempt=_int(environ, ATTEMPT_VARIABLE, 0),
    )


def _from_slurm_task(environ: Mapping[str, str]) -> DistEnv:
    job_id = environ[SLURM_VARS["job_id"]]
    world_size = _maybe_int(environ, SLURM_VARS["step_world_size"]) or _int(environ, SLURM_VARS["world_size"], 1)
    num_nodes = _maybe_int(environ, SLURM_VARS["step_num_nodes"]) or _int(environ, SLURM_VARS["num_nodes"], 1)
    node_rank = _int(environ, SLURM_VARS["node_rank"], 0)
    if world_size > 1 and num_nodes > 1 and SLURM_VARS["ntasks_per_node"] not in environ:
        raise UserError(
            f"this job runs --ntasks={world_size} on {num_nodes} nodes without --ntasks-per-node, so SLURM may "
            "place the tasks unevenly and the ranks cannot be matched to GPUs\n"
            f"  fix: ask for --nodes={num_nodes} --ntasks-per-node={max(world_size // num_nodes, 1)} instead of "
            "--ntasks (slurm.tasks_per_node in the job spec)"
        )
    _check_single_task_on_many_nodes(environ, world_size)
    counts_text = environ.get(SLURM_VARS["step_tasks_per_node"]) or environ.get(SLURM_VARS["tasks_per_node"], "")
    counts = tasks_per_node(counts_text) if counts_text else [world_size // num_nodes]
    local_world_size = _maybe_int(environ, SLURM_VARS["ntasks_per_node"]) or counts[min(node_rank, len(counts) - 1)]
    gpus = _int(environ, SLURM_VARS["gpus_on_node"], 0)
    if gpus and gpus != local_world_size:
        raise UserError(
            f"{local_world_size} task(s) per node but {gpus} GPU(s) per node: DDP runs exactly one task per GPU\n"
            f"  fix: --ntasks-per-node={gpus} (slurm.tasks_per_node: {gpus} in the job spec, or remove it)"
        )
    # rank 0 runs on the first node of its step: the step's list, else the job's
    nodelist = environ.get(SLURM_VARS["step_nodelist"]) or environ.get(SLURM_VARS["nodelist"], "")
    master_addr = hostnames(nodelist)[0] if nodelist else "127.0.0.1"
    return DistEnv(
        launcher="slurm",
        rank=_int(environ, SLURM_VARS["rank"]),
        local_rank=_int(environ, SLURM_VARS["local_rank"], 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=_maybe_int(environ, "MASTER_PORT") or port_for_job(job_id),
        job_id=job_id,
        restart_count=_int(environ, SLURM_VARS["restart_count"], 0),
        attempt=_int(environ, ATTEMPT_VARIABLE, 0),
        array_job_id=environ.get(SLURM_VARS["array_job_id"]),
        array_task_id=environ.get(SLURM_VARS["array_task_id"]),
    )


def _check_outside_srun(environ: Mapping[str, str]) -> None:
    """A process in a SLURM allocation that srun did not start is one rank; fine only for a 1-task job."""
    tasks = _int(environ, SLURM_VARS["world_size"], 1)
    _check_single_task_on_many_nodes(environ, 1)
    if tasks > 1:
        raise UserError(
            f"this allocation has {tasks} tasks but the trainer was started without srun, so it would train "
            "as one process\n  fix: start it with srun: srun python -m lance_hpc.run SPEC_FILE"
        )


def _check_single_task_on_many_nodes(environ: Mapping[str, str], world_size: int) -> None:
    nodes = _int(environ, SLURM_VARS["num_nodes"], 1)
    if ATTEMPT_VARIABLE in environ:  # the restart supervisor chose the step's nodes: the others are spares
        nodes = _maybe_int(environ, SLURM_VARS["step_num_nodes"]) or nodes
    if world_size == 1 and nodes > 1:
        raise UserError(
            f"world size is 1 but the job holds {nodes} nodes: all but one node would sit idle\n"
            f"  fix: launch one task per GPU on every node: sbatch --nodes={nodes} --ntasks-per-node=GPUS_PER_NODE "
            "and srun python -m lance_hpc.run SPEC_FILE (slurm.nodes and slurm.gpus_per_node in the job spec)"
        )


def _int(environ: Mapping[str, str], name: str, default: int = 0) -> int:
    value = _maybe_int(environ, name)
    return default if value is None else value


def _maybe_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def select_device(env: DistEnv) -> torch.device:
    """One GPU per local rank when CUDA is present, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count >= env.local_world_size:
        return torch.device("cuda", env.local_rank)
    if count == 1 and env.launcher == "slurm":
        return torch.device("cuda", 0)  # SLURM bound one GPU to each task (--gpus-per-task / --gpu-bind)
    raise UserError(
        f"{env.local_world_size} ranks on this node but only {count} GPU(s) visible\n"
        f"  fix: run one rank per GPU: --ntasks-per-node={count} (or --nproc {count} locally)"
    )


@contextmanager
def process_group(env: DistEnv, timeout_s: float) -> Iterator[torch.device]:
    """Initialise torch.distributed for this rank and yield its device; tear down on exit.

    NCCL on GPUs, gloo on CPU. Every collective waits at most ``timeout_s``: when a rank dies the
    others fail within that time with an error instead of hanging until the 10-minute default.
    """
    device = select_device(env)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1:
        # a single rank needs no rendezvous: an in-memory store spares it a port
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    else:
        _meet(env, backend, timeout, device)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _meet(env: DistEnv, backend: str, timeout: datetime.timedelta, device: torch.device) -> None:
    """The ranks' rendezvous on MASTER_PORT: rank 0 hosts the store there, the others connect.
    Rank 0 hosts it on the socket the batch step has held the port with since it picked it
    (:func:`lance_hpc.runtime.ports.take_held_port`) when there is one. Else it listens itself;
    when another process holds the port (a connection of the node's may take any port for a
    moment), it tries again for up to :data:`PORT_WAIT_S` seconds while the other ranks keep
    knocking, and only then stops with a message that names the port and the node. The store is
    made here, not by ``init_process_group``, so that a failed try leaves no half-made group behind."""
    held = take_held_port(env.master_port) if env.is_main else None
    if held is not None:  # the batch step's socket, listening on the port since it was picked
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout=timeout, master_listen_fd=held)
    else:
        store = _listen_or_connect(env, timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def _listen_or_connect(env: DistEnv, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store on MASTER_PORT without a socket handed over: rank 0 listens, trying again while
    another process holds the port; the others connect."""
    deadline = time.monotonic() + PORT_WAIT_S
    pause = 0.25
    while True:
        try:
            return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.is_main, timeout=timeout)
        except dist.DistNetworkError as error:
            if not (env.is_main and port_in_use(error)):
                raise
            if time.monotonic() + pause > deadline:
                raise PortInUse(port_in_use_message(env)) from None
            if pause == 0.25:
                print(
                    f"rank 0: port {env.master_port} is held by another process; trying again for up to {PORT_WAIT_S:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(pause)
            pause = min(2 * pause, 4.0)


def port_in_use(error: BaseException) -> bool:
    """Whether ``error`` says that the rendezvous port is held by another process (rank 0 hosts
    the store there; torch's message names EADDRINUSE)."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def port_in_use_message(env: DistEnv) -> str:
    """Rank 0 could not listen on MASTER_PORT: which port, which node, and that no rank is to blame."""
    node = os.environ.get(SLURM_VARS["node_name"]) or socket.gethostname()
    return (
        f"rank 0 cannot listen on port {env.master_port} on {node} for the ranks' rendezvous: another process "
        f"on that node has held it for {PORT_WAIT_S:.0f} s (address already in use); no rank of this job failed\n"
        "  fix: run the job again (a batch script rendered by lance_hpc picks a free port on rank 0's node), "
        "or set MASTER_PORT to a port that is free there"
    )


def configure_process(seed: int, deterministic: bool, env: DistEnv, device: torch.device) -> None:
    """Seeds, determinism and CPU threads, before anything draws a random number."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every rank builds the same initial model
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks on one node share its cores; more threads than cores slows every rank down
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // env.local_world_size))


def lost_peer(error: BaseException, env: DistEnv) -> bool:
    """Whether ``error`` says another rank went away (its traceback shows only where this rank noticed)."""
    text = str(error).strip().splitlines()[0].lower() if str(error).strip() else ""
    return env.world_size > 1 and (isinstance(error, dist.DistError) or any(hint in text for hint in LOST_PEER_HINTS))


def explain_failure(error: BaseException, env: DistEnv) -> str:
    """A one-paragraph account of a failed rank, naming the likely cause when a peer died."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if lost_peer(error, env):
        return (
            f"rank {env.rank}/{env.world_size}: lost contact with another rank ({text})\n"
            "  another rank probably died or hung: the first error in the other ranks' output says why; "
            "the job stops instead of waiting for it"
        )
    return f"rank {env.rank}/{env.world_size}: training failed: {type(error).__name__}: {text}"


def on_main_rank(action: Callable[[], object], what: str) -> None:
    """Run ``action`` on rank 0 while the others wait; an error on rank 0 is raised on every rank."""
    outcome: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as error:
            outcome[0] = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise UserError(f"rank 0 could not {what}: {outcome[0]}")


class TrainingFailed(RuntimeError):
    """A rank failed; the message says which and the likely cause. The traceback of the cause is
    printed too, unless another rank went away: then it only shows where this one noticed."""

    def __init__(self, message: str, show_traceback: bool = True):
        super().__init__(message)
        self.show_traceback = show_traceback
