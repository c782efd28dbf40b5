"""Environment detection over tables of SLURM, torchrun and local environments, node lists and
misconfigurations; the process group on one CPU rank."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lance_hpc.errors import UserError
from lance_hpc.runtime.environment import (
    DistEnv,
    detect,
    explain_failure,
    hostnames,
    port_for_job,
    process_group,
    tasks_per_node,
)

# Real node-list forms and their expansion (as `scontrol show hostnames` prints them).
NODE_LISTS = [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a-[001-002]-b", ["a-001-b", "a-002-b"]),
    ("node[09-11]", ["node09", "node10", "node11"]),
    ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
    ("gpu-a100-[1,3],gpu-h100-7", ["gpu-a100-1", "gpu-a100-3", "gpu-h100-7"]),
    ("x1000c0s0b0n0", ["x1000c0s0b0n0"]),
]


def srun_task(**overrides: str) -> dict[str, str]:
    """The variables of task 3 of a 2-node x 2-task srun step (as SLURM 22.05 sets them)."""
    environ = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    environ.update(overrides)
    return {key: value for key, value in environ.items() if value is not None}


TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}

ENVIRONMENTS = [
    pytest.param({}, DistEnv("local", 0, 0, 1, 1, 0, 1, "127.0.0.1", 0), id="plain-local"),
    pytest.param(
        srun_task(),
        DistEnv("slurm", 3, 1, 4, 2, 1, 2, "gpu01", port_for_job("4242"), job_id="4242"),
        id="srun-2x2",
    ),
    pytest.param(
        srun_task(SLURM_RESTART_COUNT="2", MASTER_PORT="31337", SLURM_GPUS_ON_NODE="2"),
        DistEnv("slurm", 3, 1, 4, 2, 1, 2, "gpu01", 31337, job_id="4242", restart_count=2),
        id="srun-explicit-port-requeued-gpus",
    ),
    pytest.param(
        srun_task(LANCE_HPC_ATTEMPT="1"),
        DistEnv("slurm", 3, 1, 4, 2, 1, 2, "gpu01", port_for_job("4242"), job_id="4242", attempt=1),
        id="srun-restarted-in-the-allocation",
    ),
    pytest.param(
        srun_task(SLURM_JOB_NODELIST="gpu[01-03,07],cpu5", SLURM_STEP_NODELIST=None),
        DistEnv("slurm", 3, 1, 4, 2, 1, 2, "gpu01", port_for_job("4242"), job_id="4242"),
        id="srun-job-nodelist-only",
    ),
    pytest.param(
        srun_task(
            SLURM_PROCID="0",
            SLURM_LOCALID="0",
            SLURM_NODEID="0",
            SLURM_NTASKS="1",
            SLURM_STEP_NUM_TASKS="1",
            SLURM_JOB_NUM_NODES="1",
            SLURM_STEP_NUM_NODES="1",
            SLURM_JOB_NODELIST="a-[001-002]-b",
            SLURM_STEP_NODELIST="a-001-b",
            SLURM_NTASKS_PER_NODE=None,
            SLURM_TASKS_PER_NODE="1",
            SLURM_STEP_TASKS_PER_NODE="1",
        ),
        DistEnv("slurm", 0, 0, 1, 1, 0, 1, "a-001-b", port_for_job("4242"), job_id="4242"),
        id="srun-single-task",
    ),
    pytest.param(
        srun_task(
            SLURM_PROCID="2",
            SLURM_LOCALID="2",
            SLURM_NODEID="0",
            SLURM_JOB_NUM_NODES="1",
            SLURM_STEP_NUM_NODES="1",
            SLURM_JOB_NODELIST="node7",
            SLURM_STEP_NODELIST="node7",
            SLURM_NTASKS_PER_NODE=None,
            SLURM_TASKS_PER_NODE="4",
            SLURM_STEP_TASKS_PER_NODE="4",
        ),
        DistEnv("slurm", 2, 2, 4, 4, 0, 1, "node7", port_for_job("4242"), job_id="4242"),
        id="srun-ntasks-one-node",
    ),
    pytest.param(TORCHRUN, DistEnv("torchrun", 5, 1, 8, 4, 1, 2, "10.0.0.7", 29500), id="torchrun"),
    pytest.param(
        {**srun_task(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1"), **TORCHRUN},
        DistEnv("torchrun", 5, 1, 8, 4, 1, 2, "10.0.0.7", 29500, job_id="4242"),
        id="torchrun-inside-srun",
    ),
    pytest.param({"RANK": "0", "WORLD_SIZE": "1"}, DistEnv("torchrun", 0, 0, 1, 1, 0, 1, "127.0.0.1", 0), id="torchrun-single"),
    pytest.param(
        {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "node1"},
        DistEnv("local", 0, 0, 1, 1, 0, 1, "127.0.0.1", 0),
        id="batch-shell-one-task",
    ),
]


@pytest.mark.parametrize("environ, expected", ENVIRONMENTS)
def test_detect(environ: dict[str, str], expected: DistEnv) -> None:
    assert detect(environ) == expected


def test_detect_reads_os_environ_by_default() -> None:
    with mock.patch.dict(os.environ, srun_task(), clear=True):
        assert detect().rank == 3


def test_every_rank_of_a_job_agrees_on_the_master() -> None:
    ranks = [
        detect(srun_task(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2))) for rank in range(4)
    ]
    assert {(env.master_addr, env.master_port) for env in ranks} == {("gpu01", port_for_job("4242"))}
    assert [env.rank for env in ranks] == [0, 1, 2, 3]


def test_port_is_derived_from_the_job_id() -> None:
    ports = {port_for_job(str(job_id)) for job_id in range(1000, 1100)}
    assert len(ports) == 100 and all(20000 <= port < 60000 for port in ports)
    assert port_for_job("1234") == port_for_job("1234")


@pytest.mark.parametrize("nodelist, expected", NODE_LISTS)
def test_hostnames(nodelist: str, expected: list[str]) -> None:
    assert hostnames(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["", "node[1-2", "node[a-b]"])
def test_malformed_node_list_is_a_clear_error(nodelist: str) -> None:
    with pytest.raises(UserError, match="cannot read the SLURM node list"):
        hostnames(nodelist)


@pytest.mark.slurm
@pytest.mark.slow
def test_node_lists_expand_like_scontrol(slurm_cluster) -> None:
    compared = 0
    for nodelist, expected in NODE_LISTS:
        printed = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env={**os.environ, **slurm_cluster.env},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if printed:  # SLURM 22.05's scontrol rejects a suffix after brackets (a-[001-002]-b); newer ones expand it
            assert hostnames(nodelist) == printed == expected
            compared += 1
    assert compared >= len(NODE_LISTS) - 1


@pytest.mark.parametrize("text, expected", [("2(x2)", [2, 2]), ("4", [4]), ("3,1", [3, 1]), ("2(x3),1", [2, 2, 2, 1])])
def test_tasks_per_node(text: str, expected: list[int]) -> None:
    assert tasks_per_node(text) == expected


MISCONFIGURATIONS = [
    pytest.param(
        srun_task(SLURM_NTASKS_PER_NODE=None, SLURM_TASKS_PER_NODE="3,1", SLURM_STEP_TASKS_PER_NODE="3,1"),
        r"--ntasks=4 on 2 nodes without --ntasks-per-node.*--nodes=2 --ntasks-per-node=2",
        id="ntasks-without-per-node",
    ),
    pytest.param(
        srun_task(SLURM_GPUS_ON_NODE="4"),
        r"2 task\(s\) per node but 4 GPU\(s\) per node.*--ntasks-per-node=4",
        id="tasks-not-gpus",
    ),
    pytest.param(
        srun_task(
            SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NUM_NODES="1", SLURM_PROCID="0", SLURM_NTASKS_PER_NODE=None
        ),
        r"world size is 1 but the job holds 2 nodes.*--ntasks-per-node",
        id="world-1-multi-node-srun",
    ),
    pytest.param(
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"},
        r"world size is 1 but the job holds 2 nodes",
        id="world-1-multi-node-batch-shell",
    ),
    pytest.param(
        {"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "4"},
        r"4 tasks but the trainer was started without srun.*srun python -m lance_hpc.run",
        id="not-under-srun",
    ),
    pytest.param({"RANK": "1", "WORLD_SIZE": "2"}, r"MASTER_ADDR/MASTER_PORT are not.*torchrun", id="torchrun-no-master"),
    pytest.param(srun_task(SLURM_PROCID="x"), r"SLURM_PROCID='x' is not an integer", id="garbage-rank"),
]


@pytest.mark.parametrize("environ, message", MISCONFIGURATIONS)
def test_misconfiguration_errors_carry_the_fix(environ: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=f"(?s){message}"):
        detect(environ)


def test_process_group_single_cpu_rank() -> None:
    env = detect({})
    with process_group(env, timeout_s=30) as device:
        assert device == torch.device("cpu") and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()


def test_explain_failure_names_a_lost_peer() -> None:
    env = DistEnv("slurm", 1, 1, 4, 2, 0, 2, "node1", 20001)
    lost = RuntimeError("[pair.cc:545] Read error [127.0.0.1]:1234: Connection reset by peer")
    assert "lost contact with another rank" in explain_failure(lost, env)
    assert "training failed: ValueError: bad" in explain_failure(ValueError("bad"), env)


def test_a_rank_exits_with_its_code_after_the_exit_hooks_and_without_the_teardown() -> None:
    """exit_process: what atexit registered runs and buffered output is written, but nothing of the
    interpreter's teardown (here a module global's __del__), where gloo's threads can abort it."""
    program = """
import atexit, sys
from lance_hpc.kinds.rank import exit_process

class Teardown:
    def __del__(self):
        print("teardown ran")

kept = Teardown()
atexit.register(lambda: print("exit hook ran"))
print("buffered output", end="")
sys.stderr.write("buffered error")
exit_process(3)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered outputexit hook ran\n" and done.stderr == "buffered error"
