"""MASTER_PORT: the batch step picks a port free on rank 0's node (the job-id port unless another
process holds it), the job-id port is only the fallback, and a rank 0 whose port is taken says so
instead of blaming another rank. On the cluster: tests/test_slurm_cluster.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lance_hpc.runtime.ports import PICK_PORT_PROGRAM, PORT_RANGE, master_port_lines, port_for_job
from tests.support.jobs import REPO_ROOT, write_spec


@contextmanager
def held_port(address: str = "0.0.0.0") -> Iterator[int]:
    """A port in the job-id range that this process listens on (as another job or service would)."""
    while True:
        holder = socket.socket()
        holder.bind((address, 0))
        if PORT_RANGE[0] <= holder.getsockname()[1] < PORT_RANGE[1]:
            break
        holder.close()
    holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def job_id_for(port: int) -> str:
    job_id = str(port - PORT_RANGE[0])
    assert port_for_job(job_id) == port
    return job_id


def picked(job_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-I", "-c", PICK_PORT_PROGRAM, job_id], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


def test_the_batch_step_skips_a_job_id_port_that_another_process_holds() -> None:
    for address in ("0.0.0.0", "127.0.0.1"):  # rank 0 listens on every address: a hold on loopback counts too
        with held_port(address) as port:
            chosen = int(picked(job_id_for(port)))
            assert chosen != port and PORT_RANGE[0] <= chosen < PORT_RANGE[1], (address, port, chosen)
    assert picked(job_id_for(port)) == str(port)  # let go: the job-id port is free again, and chosen


def test_the_batch_script_exports_a_free_port_over_an_inherited_one_and_falls_back_without_python(tmp_path: Path) -> None:
    script = "\n".join(["set -eo pipefail", *master_port_lines(), 'echo "port=${MASTER_PORT-unset}"'])
    with held_port() as port:
        environ = {**os.environ, "SLURM_JOB_ID": job_id_for(port), "MASTER_PORT": str(port)}  # as if the submitting shell had it
        done = subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        chosen = int(done.stdout.strip().removeprefix("port="))
        assert chosen != port and PORT_RANGE[0] <= chosen < PORT_RANGE[1], done.stdout
        # no python3 on the node: MASTER_PORT is unset (the ranks fall back to the job-id port), and the log says so
        environ["PATH"] = str(tmp_path)
        done = subprocess.run(["/bin/bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "port=unset", done.stdout + done.stderr
    assert "no free port found on" in done.stderr and "port derived from the job id" in done.stderr, done.stderr


def test_a_rank_0_whose_port_is_held_names_the_port_and_the_node(tmp_path: Path, digits) -> None:
    spec_file = write_spec(tmp_path, digits)
    with held_port() as port:
        environ = {
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SLURMD_NODENAME": "node7",
        }
        done = subprocess.run(
            [sys.executable, "-P", "-m", "lance_hpc.run", str(spec_file)],
            env=environ,
            capture_output=True,
            text=True,
            timeout=300,
        )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"rank 0 cannot listen on port {port} on node7 for the ranks' rendezvous: another process" in output, output
    assert "lost contact" not in output and "Traceback" not in output, output
