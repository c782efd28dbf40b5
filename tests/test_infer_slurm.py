"""An inference job on the real two-node SLURM test cluster: USR2 in the middle stops each rank at
a fragment boundary and rank 0 requeues the job; the requeued run writes only the fragments still
missing and commits once; the column equals, row for row, a single-process run's, and its
provenance (checkpoint, weights, version read) and lineage read back after the requeue; lance-hpc
status and logs show the job's fragments and its commit; lance-hpc cancel stops a second one at a
fragment boundary with nothing committed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import lance
import pytest
import yaml

from lance_hpc.ingest import ensure_dataset
from lance_hpc.launch.paths import JobPaths
from lance_hpc.lineage.provenance import provenance_of
from lance_hpc.slurm.queue import FINAL_STATES
from lance_hpc.spec import DataSpec, IngestSpec, load_spec
from tests.support.jobs import BASE_SPEC, REPO_ROOT, Digits, train_here, write_spec
from tests.support.slurm import environ, job_fields, sbatch, signal_steps, wait_for_text
from tests.support.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def wait_for(cluster: SlurmCluster, job_id: str, restarts: int, timeout_s: float = 300) -> dict[str, str]:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(cluster, job_id)
        if fields.get("JobState") in FINAL_STATES and int(fields.get("Restarts", 0)) >= restarts:
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=environ(cluster))
    raise AssertionError(f"job {job_id}: {job_fields(cluster, job_id)}")


def test_usr2_stops_an_inference_job_at_fragment_boundaries_and_its_requeue_commits_once(
    tmp_path: Path, slurm_cluster: SlurmCluster
) -> None:
    dataset = Digits(str(tmp_path / "train.lance"), str(tmp_path / "val.lance"))
    ingest = IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=32, seed=0)
    ensure_dataset(DataSpec(uri=dataset.train, val_uri=dataset.val, ingest=ingest))  # validation: 12 fragments
    assert train_here(write_spec(tmp_path / "train", dataset, train={"epochs": 1})).status == "completed"
    local = tmp_path / "local.lance"
    shutil.copytree(dataset.val, local)

    def spec_for(uri: str | Path, name: str, nodes: int) -> Path:
        raw = {
            "name": name,
            "job": "infer",
            "slurm": {
                "partition": slurm_cluster.partition,
                "nodes": nodes,
                "tasks_per_node": 1,
                "cpus_per_task": 1,
                "time": "00:10:00",
                "max_requeues": 2,
                "log_dir": str(tmp_path / "logs"),
            },
            "data": {"uri": str(uri), "batch_size": 16, "num_workers": 0},
            "task": BASE_SPEC["task"],
            "checkpoint": {"dir": str(tmp_path / f"{name}-checkpoints")},
            "logging": {"tensorboard_dir": str(tmp_path / "runs"), "progress": False},
            "infer": {
                "checkpoint": str(tmp_path / "train" / "checkpoints"),
                "outputs": {"predicted": "int64"},
                "function": f"{REPO_ROOT}/tests/support/infer.py:slow_predict",
            },
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    here = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", str(spec_for(local, "local", 1)), "--local", "--nproc", "1"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**environ(slurm_cluster)},
    )
    assert here.returncode == 0, here.stdout + here.stderr
    spec = load_spec(spec_for(dataset.val, "infer2", 2)).spec
    job_id = sbatch(slurm_cluster, spec)
    out = Path(spec.slurm.log_dir) / f"{spec.name}-{job_id}.out"
    wait_for_text(out, "fragment 1:", timeout_s=120)  # rank 1 has written one fragment
    signal_steps(environ(slurm_cluster), job_id)
    fields = wait_for(slurm_cluster, job_id, restarts=1)
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED", log
    assert "stopped with" in log and "requeued" in log, log
    assert log.count("committed:") == 1 and "written before" in log, log
    table = lance.dataset(dataset.val)
    assert table.version == 2
    assert table.to_table(columns=["predicted"]) == lance.dataset(str(local)).to_table(columns=["predicted"])
    status = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "status", str(JobPaths.of(spec).spec_file)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environ(slurm_cluster),
    )
    assert "12 fragment(s) written" in status.stdout and "committed: version 2" in status.stdout, status.stdout + status.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "logs", str(JobPaths.of(spec).spec_file)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environ(slurm_cluster),
    )
    assert "committed:" in shown.stdout, shown.stdout + shown.stderr
    # the provenance the requeued run committed, and the chain read back from it and the checkpoint
    document = provenance_of(table.schema, "predicted")
    assert document is not None, table.schema
    checkpoints = str(tmp_path / "train" / "checkpoints")
    assert (document["checkpoint"]["dir"], document["dataset"], document["rows"], document["fragments"]) == (
        checkpoints,
        {"uri": dataset.val, "version": 1},
        359,
        12,
    ), document
    assert document["checkpoint"]["weights"].startswith("blake2b:") and document["function"].endswith("infer.py:slow_predict")
    chain = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "lineage", dataset.val], capture_output=True, text=True, cwd=REPO_ROOT
    )
    step = document["checkpoint"]["step"]
    assert f"{dataset.train} version 1 -> checkpoint {checkpoints} step {step}" in chain.stdout, chain.stdout + chain.stderr
    assert "-> predicted: read version 1, 359 rows in 12 fragment(s)" in chain.stdout and "warning" not in chain.stdout

    raw = yaml.safe_load(spec_for(dataset.val, "infer3", 2).read_text())  # the same model, a new column
    raw["infer"]["outputs"] = {"predicted_again": "int64"}
    raw["data"]["batch_size"] = 4  # 2 s a fragment: time for lance-hpc cancel to start and signal
    raw["infer"]["function"] = f"{REPO_ROOT}/tests/support/infer.py:slow_predict_again"
    (tmp_path / "infer3.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    other = load_spec(tmp_path / "infer3.yaml").spec
    job_id = sbatch(slurm_cluster, other)
    out = Path(other.slurm.log_dir) / f"{other.name}-{job_id}.out"
    wait_for_text(out, "fragment 1:", timeout_s=120)
    cancelled = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "cancel", str(JobPaths.of(other).spec_file), "--timeout", "120"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environ(slurm_cluster),
    )
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    fields = wait_for(slurm_cluster, job_id, restarts=0)
    log = out.read_text()
    assert fields["JobState"] != "COMPLETED" and "stopped with" in log and "run or submit the same job again" in log, log
    assert "predicted_again" not in lance.dataset(dataset.val).schema.names
