"""Ingest as a job on the real two-node SLURM test cluster: a rank killed before its shards are
written, or in the middle of one, fails the job; the requeued job writes only the missing shards and commits once, and the
dataset equals, row for row, a single-worker ingest of the same source on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import lance
import pytest

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.ingest.plan import plan_for_data
from lance_hpc.launch.paths import JobPaths
from lance_hpc.slurm.queue import FINAL_STATES
from lance_hpc.spec import JobSpec, load_spec
from tests.support.shards import digit_rows, write_webdataset
from tests.support.slurm import environ, is_rank_command, job_fields, sbatch, signal_steps, wait_for_text
from tests.support.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def rank_process(spec_file: str, rank: int, timeout_s: float = 120) -> int:
    """The pid of the job rank ``rank`` (by its SLURM_PROCID) running ``spec_file``, as soon as it starts."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if not is_rank_command(command) or spec_file.encode() not in command:
                    continue
                variables = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"SLURM_PROCID={rank}".encode() in variables:
                return int(entry)
        time.sleep(0.02)
    raise AssertionError(f"rank {rank} of {spec_file} never started")


def wait_until(cluster: SlurmCluster, job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(cluster, job_id)
        if done(fields):
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=environ(cluster))
    raise AssertionError(f"job {job_id}: {job_fields(cluster, job_id)}")


def ingest_job(tmp_path: Path, cluster: SlurmCluster) -> tuple[JobSpec, str]:
    """A 2-rank ingest job of 12 shards (6 per rank), and the source ingested locally by one
    worker into local.lance for comparison; returns the spec and the source."""
    rows = digit_rows(96)
    write_webdataset(tmp_path / "wds", rows, per_tar=8)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest_main([source, str(tmp_path / "local.lance")]) == 0
    (tmp_path / "job.yaml").write_text(
        f"""
name: ingest2
job: ingest
slurm:
  partition: {cluster.partition}
  nodes: 2
  tasks_per_node: 1
  cpus_per_task: 1
  time: "00:10:00"
  max_requeues: 2
  log_dir: {tmp_path / "logs"}
data:
  uri: {tmp_path / "cluster.lance"}
  ingest:
    source: {source}
"""
    )
    return load_spec(tmp_path / "job.yaml").spec, source


def start_with_rank1_stopped(cluster: SlurmCluster, spec: JobSpec) -> tuple[str, int, Path]:
    """Submit ``spec``; stop rank 1 while it is still importing (none of its shards written) and
    wait until rank 0 has written its six and waits for rank 1. Returns job id, rank 1's pid, log."""
    job_id = sbatch(cluster, spec)
    rank1 = rank_process(str(JobPaths.of(spec).spec_file), 1)
    os.kill(rank1, signal.SIGSTOP)
    out = Path(spec.slurm.log_dir) / f"{spec.name}-{job_id}.out"
    wait_for_text(out, "waiting for the other ranks", timeout_s=90)
    return job_id, rank1, out


def assert_finished_like_local(tmp_path: Path, cluster: SlurmCluster, job_id: str, out: Path) -> str:
    fields = wait_until(cluster, job_id, lambda f: f.get("JobState") in FINAL_STATES and int(f.get("Restarts", 0)) >= 1, 300)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED", log
    assert "rank 0: 0 shard(s) written, 6 written before" in log, log
    assert "rank 1: 6 shard(s) written, 0 written before" in log, log
    assert log.count("committed:") == 1
    dataset = lance.dataset(str(tmp_path / "cluster.lance"))
    assert dataset.version == 1
    assert dataset.to_table().to_pylist() == lance.dataset(str(tmp_path / "local.lance")).to_table().to_pylist()
    return log


def test_a_killed_rank_then_requeue_writes_only_the_missing_shards_and_equals_a_local_ingest(
    tmp_path: Path, slurm_cluster: SlurmCluster
) -> None:
    spec, _ = ingest_job(tmp_path, slurm_cluster)
    job_id, rank1, out = start_with_rank1_stopped(slurm_cluster, spec)
    os.kill(rank1, signal.SIGKILL)
    fields = wait_until(slurm_cluster, job_id, lambda f: f.get("JobState") in FINAL_STATES, 120)
    assert fields["JobState"] != "COMPLETED", fields
    with pytest.raises(ValueError):  # nothing committed: no dataset to read
        lance.dataset(str(tmp_path / "cluster.lance"))
    subprocess.run(["scontrol", "requeue", job_id], env=environ(slurm_cluster), check=True)
    assert_finished_like_local(tmp_path, slurm_cluster, job_id, out)


def test_usr2_stops_the_ingest_at_a_shard_boundary_and_requeues_it(tmp_path: Path, slurm_cluster: SlurmCluster) -> None:
    """USR2 while rank 0 waits for rank 1: rank 0 requeues the job (scontrol), writing nothing more;
    the requeued run writes rank 1's shards and commits once."""
    spec, _ = ingest_job(tmp_path, slurm_cluster)
    job_id, _, out = start_with_rank1_stopped(slurm_cluster, spec)
    signal_steps(environ(slurm_cluster), job_id)
    log = assert_finished_like_local(tmp_path, slurm_cluster, job_id, out)
    assert "ingest stopped with 6/12 shards written; requeued" in log, log


def test_a_rank_killed_in_the_middle_of_a_shard_is_redone_whole_on_requeue(tmp_path: Path, slurm_cluster: SlurmCluster) -> None:
    """Rank 0's one big shard is being written (fragments on disk, no record yet) when the rank is
    killed: the requeued job writes that shard again, the commit takes only recorded fragments, and
    the dataset equals a single-worker local ingest row for row."""
    rows = digit_rows(1710)
    write_webdataset(tmp_path / "wds", rows[:1700], per_tar=1700)  # shard 0: rank 0's, written in 425 fragments
    write_webdataset(tmp_path / "small", rows[1700:], per_tar=10)  # rank 1's: 3 fragments
    (tmp_path / "wds" / "shard-0001.tar").write_bytes((tmp_path / "small" / "shard-0000.tar").read_bytes())
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest_main([source, str(tmp_path / "local.lance"), "--rows-per-fragment", "4"]) == 0
    (tmp_path / "job.yaml").write_text(
        f"""
name: ingest_mid
job: ingest
slurm: {{partition: {slurm_cluster.partition}, nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: "00:10:00",
        max_requeues: 2, log_dir: {tmp_path / "logs"}}}
data:
  uri: {tmp_path / "cluster.lance"}
  ingest: {{source: "{source}", rows_per_fragment: 4}}
"""
    )
    spec = load_spec(tmp_path / "job.yaml").spec
    records = plan_for_data(spec.data, check_targets=False).shard_records()
    assert plan_for_data(spec.data, check_targets=False).assignment(2) == [[0], [1]]
    job_id = sbatch(slurm_cluster, spec)
    rank0 = rank_process(str(JobPaths.of(spec).spec_file), 0)
    data = tmp_path / "cluster.lance" / "data"
    deadline = time.monotonic() + 120
    while not (data.is_dir() and len(list(data.glob("*.lance"))) >= 40):  # past rank 1's 3: rank 0 is writing its shard
        assert time.monotonic() < deadline, "rank 0 never started writing its shard"
        time.sleep(0.01)
    os.kill(rank0, signal.SIGSTOP)
    finished = records.finished()
    recorded = {
        json.loads(text)["files"][0]["path"]
        for record in finished.values()
        for texts in record.fragments.values()
        for text in texts
    }
    written = {path.name for path in data.glob("*.lance")}
    assert 0 not in finished and written - recorded, (sorted(finished), len(written))  # in the middle of shard 0
    os.kill(rank0, signal.SIGKILL)
    fields = wait_until(slurm_cluster, job_id, lambda f: f.get("JobState") in FINAL_STATES, 120)
    assert fields["JobState"] != "COMPLETED", fields
    subprocess.run(["scontrol", "requeue", job_id], env=environ(slurm_cluster), check=True)
    fields = wait_until(
        slurm_cluster, job_id, lambda f: f.get("JobState") in FINAL_STATES and int(f.get("Restarts", 0)) >= 1, 300
    )
    log = (Path(spec.slurm.log_dir) / f"{spec.name}-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED", log
    rerun = log[log.index("(restart 1)") :]
    assert "rank 0: 1 shard(s) written, 0 written before" in rerun and log.count("committed:") == 1, log
    dataset = lance.dataset(str(tmp_path / "cluster.lance"))
    assert dataset.version == 1 and dataset.count_rows() == 1710
    assert dataset.to_table().to_pylist() == lance.dataset(str(tmp_path / "local.lance")).to_table().to_pylist()
