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

from lance_hpc.launch.restarts.port_holder import PortHolder
from lance_hpc.runtime.ports import HANDOFF_VARIABLE, PORT_RANGE, master_port_lines, take_held_port
from tests.support.jobs import REPO_ROOT, write_spec


@contextmanager
def held_port(port: int | None = None, address: str = "0.0.0.0", listen: bool = True) -> Iterator[int]:
    """``port`` (default: any port the kernel hands out) that this process listens on, as another
    job or service would; or only binds (``listen=False``), as an outgoing connection holds its port."""
    holder = socket.socket()
    holder.bind((address, port or 0))
    if listen:
        holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def ephemeral_ports() -> range:
    first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(first, last + 1)


@contextmanager
def holding(job_id: str) -> Iterator[tuple[str, str]]:
    """The batch step's holder for ``job_id``, watching this process: the port it holds ("" when
    it found none) and the name it hands the port over by; stopped on the way out."""
    holder = PortHolder(job_id)
    try:
        yield holder.port, holder.name
    finally:
        holder.stop()


def picked(job_id: str) -> str:
    """The port the batch step picks for ``job_id`` now, let go again."""
    with holding(job_id) as (port, _):
        return port


def bind_fails(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def test_the_batch_step_skips_a_port_that_another_process_holds() -> None:
    job_id = "4242"
    own = int(picked(job_id))  # nothing holds it now: the job's own port, the same every time
    assert own == int(picked(job_id)) and PORT_RANGE[0] <= own < PORT_RANGE[1], own
    for address in ("0.0.0.0", "127.0.0.1"):  # rank 0 listens on every address: a hold on loopback counts too
        with held_port(own, address):
            chosen = int(picked(job_id))
            assert chosen != own and PORT_RANGE[0] <= chosen < PORT_RANGE[1], (address, own, chosen)
    assert picked(job_id) == str(own)  # let go: the job's port is free again, and chosen


def test_the_batch_step_never_picks_a_port_the_kernel_may_hand_to_a_connection() -> None:
    """A port in the ephemeral range, free when the batch step looks, may be taken by any outgoing
    connection on the node before rank 0 listens on it."""
    ephemeral = ephemeral_ports()
    chosen = {int(picked(str(job_id))) for job_id in (1, 16, 12767, 12768, 39999, 4_000_000_007)}
    assert not [port for port in chosen if port in ephemeral], (chosen, ephemeral)
    with held_port(int(picked("16"))):  # the random draws too
        drawn = {int(picked("16")) for _ in range(5)}
    assert not [port for port in drawn if port in ephemeral], (drawn, ephemeral)


def test_the_batch_script_exports_a_free_port_over_an_inherited_one_and_falls_back_without_python(tmp_path: Path) -> None:
    script = "\n".join(["set -eo pipefail", *master_port_lines(), 'echo "port=${MASTER_PORT-unset}"'])
    with held_port(int(picked("4141"))) as port:  # a job id of its own: tests run beside each other
        environ = {**os.environ, "SLURM_JOB_ID": "4141", "MASTER_PORT": str(port)}  # as if the submitting shell had it
        done = subprocess.run(["bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        chosen = int(done.stdout.strip().removeprefix("port="))
        assert chosen != port and PORT_RANGE[0] <= chosen < PORT_RANGE[1], done.stdout
        # no python3 on the node: MASTER_PORT is unset (the ranks fall back to the job-id port), and the log says so
        environ["PATH"] = str(tmp_path)
        done = subprocess.run(["/bin/bash", "-c", script], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "port=unset", done.stdout + done.stderr
    assert "no free port found on" in done.stderr and "port derived from the job id" in done.stderr, done.stderr


def test_the_batch_step_holds_its_port_until_rank_0_of_the_same_user_takes_it_over() -> None:
    """Nothing can take the port between the pick and rank 0's start: the holder listens on it,
    hands the listening socket to one process of its user, and is gone."""
    with holding("4343") as (port, name):  # a job id of its own: tests run beside each other
        assert bind_fails(int(port)), port
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # another user on the node asks for it: nothing
            try:
                os.setuid(65534)
                taken = take_held_port(int(port), {HANDOFF_VARIABLE: name})
                os.write(writer, b"taken" if taken is not None else b"refused")
            finally:
                os._exit(0)
        os.waitpid(child, 0)
        assert os.read(reader, 16) == b"refused"
        environ = {HANDOFF_VARIABLE: name}
        assert take_held_port(int(port) + 1, {HANDOFF_VARIABLE: "another-" + name}) is None  # not a name of ours
        descriptor = take_held_port(int(port), environ)
        assert descriptor is not None and HANDOFF_VARIABLE not in environ  # taken once: rank 0's children do not ask
        with socket.socket(fileno=descriptor) as listener:
            assert listener.getsockname()[1] == int(port)
            assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            assert take_held_port(int(port), {HANDOFF_VARIABLE: name}) is None  # handed over once, the holder is gone
        assert not bind_fails(int(port))  # rank 0 let go of it: free again


def rank_environ(rank: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "SLURMD_NODENAME": "node7",
    }


def test_a_rank_0_whose_port_stays_held_names_the_port_and_the_node(tmp_path: Path, digits) -> None:
    spec_file = write_spec(tmp_path, digits)
    with held_port() as port:
        done = subprocess.run(
            [sys.executable, "-P", "-m", "lance_hpc.run", str(spec_file)],
            env=rank_environ(0, port),
            capture_output=True,
            text=True,
            timeout=300,
        )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"rank 0 cannot listen on port {port} on node7 for the ranks' rendezvous: another process" in output, output
    assert "lost contact" not in output and "Traceback" not in output, output


def test_ranks_meet_once_a_port_held_for_a_moment_is_let_go(tmp_path: Path, digits) -> None:
    """Another process holds MASTER_PORT while the ranks start (as a connection of its own may, in
    the moment between the batch step's check and rank 0's listen): rank 0 waits, then both train."""
    spec_file = write_spec(tmp_path, digits, train={"epochs": 1, "max_steps": 2})
    with held_port(listen=False) as port:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-P", "-m", "lance_hpc.run", str(spec_file)],
                env=rank_environ(rank, port),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (0, 1)
        ]
        assert ranks[0].stdout is not None
        waiting = ranks[0].stdout.readline()  # rank 0 finds the port held before anything else
        while waiting and "is held by another process" not in waiting:
            waiting = ranks[0].stdout.readline()
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert f"rank 0: port {port} is held by another process" in waiting, waiting + outputs[0]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n---\n".join(outputs)


def test_ranks_meet_on_the_port_the_batch_step_holds(tmp_path: Path, digits) -> None:
    """Rank 0 takes over the socket the batch step listens on: it never waits for the port, and the
    other rank, knocking before the store is there, joins it."""
    spec_file = write_spec(tmp_path, digits, train={"epochs": 1, "max_steps": 2})
    with holding("77") as (port, name):
        ranks = [
            subprocess.Popen(
                [sys.executable, "-P", "-m", "lance_hpc.run", str(spec_file)],
                env={**rank_environ(rank, int(port)), HANDOFF_VARIABLE: name},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in (1, 0)
        ]
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n---\n".join(outputs)
    assert "is held by another process" not in outputs[1], outputs[1]
