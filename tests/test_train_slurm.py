"""The trainer on the real two-node SLURM test cluster: 4 ranks (2 nodes x 2 tasks) over gloo.

A job trains to the accuracy bar; a job sent USR2 mid-epoch checkpoints, requeues itself, resumes
and ends with the reference job's weights (through sbatch and through submitit); a job stopped on
4 ranks finishes on 2, reading every row once. Restarts inside the allocation: a job whose rank is
SIGKILLed starts again without a requeue and ends with the reference job's weights; a job that loses
a node goes on with the other; a task that raises at the same step every time stops after its
second attempt with its own error.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lance_hpc.checkpoint import manifests
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.kinds.rank import SubmititJob
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.render import write_job_files
from lance_hpc.launch.restarts import ATTEMPTS_FILE, read_attempts
from lance_hpc.launch.submit import make_executor, wait_for
from lance_hpc.loading import build_train_loader, load_task
from lance_hpc.slurm.queue import FINAL_STATES
from lance_hpc.spec import JobSpec, load_spec
from tests.support.jobs import (
    FINAL_ACCURACY,
    REPO_ROOT,
    Digits,
    assert_epoch_resumes_in_place,
    final_state,
    logged_rows,
    planned_rows,
    same_weights,
    scalars,
    write_spec,
)
from tests.support.slurm import is_rank_command, is_standby, job_log, lance_hpc, sbatch, signal_steps
from tests.support.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TASKS = 4


@dataclass(frozen=True)
class SlurmRun:
    spec: JobSpec
    job_id: str
    state: str
    output: str


def job_spec(directory: Path, dataset: Digits, cluster: SlurmCluster, **sections: Any) -> JobSpec:
    """2 nodes x 2 CPU tasks; 22 steps per epoch; every step logged so tests can follow along."""
    slurm = {
        "partition": cluster.partition,
        "nodes": 2,
        "tasks_per_node": 2,
        "cpus_per_task": 1,
        "time": "00:15:00",
        "max_requeues": 2,
        "log_dir": str(directory / "logs"),
    }
    base = {
        "slurm": slurm,
        "train": {"epochs": 5},
        "logging": {"log_every_steps": 1, "progress": False},
        "checkpoint": {"every_steps": 50, "keep": 10},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(section, {}).update(values)
        else:
            base[section] = values
    return load_spec(write_spec(directory, dataset, name="digits4", **base)).spec


def environ(cluster: SlurmCluster) -> dict[str, str]:
    return {**os.environ, **cluster.env, "PYTHONPATH": str(REPO_ROOT)}


def job_state(cluster: SlurmCluster, job_id: str) -> tuple[str, int]:
    """(JobState, restart count) as scontrol shows them."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=environ(cluster), capture_output=True, text=True).stdout
    fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
    return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", 0))


def wait_for_job(cluster: SlurmCluster, job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = job_state(cluster, job_id)
        if state in FINAL_STATES:
            return state
        time.sleep(1)
    log = job_log(cluster, job_id)  # before scancel: SLURM forgets a job soon after
    subprocess.run(["scancel", job_id], env=environ(cluster))
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s\n{log}")


def output_of(spec: JobSpec, job_id: str) -> str:
    logs = Path(spec.slurm.log_dir)
    return "".join((logs / f"{spec.name}-{job_id}.{kind}").read_text() for kind in ("out", "err"))


def wait_for_output(read, marker: str, timeout_s: float = 300) -> None:
    """Wait until ``read()`` (a job's log) holds ``marker``; past ``timeout_s``, fail showing the log."""
    deadline = time.monotonic() + timeout_s
    text = "(not written)"
    while time.monotonic() < deadline:
        try:
            text = read()
            if marker in text:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{marker!r} never appeared; the end of the log:\n" + "\n".join(text.splitlines()[-60:]))


def run_to_end(cluster: SlurmCluster, spec: JobSpec, timeout_s: float = 600) -> SlurmRun:
    job_id = sbatch(cluster, spec)
    state = wait_for_job(cluster, job_id, timeout_s)
    return SlurmRun(spec, job_id, state, output_of(spec, job_id))


@pytest.fixture(scope="module")
def reference(slurm_cluster: SlurmCluster, digits: Digits, tmp_path_factory: pytest.TempPathFactory) -> SlurmRun:
    """The uninterrupted 4-rank sbatch job every other job here is compared with."""
    return run_to_end(slurm_cluster, job_spec(tmp_path_factory.mktemp("reference"), digits, slurm_cluster))


def steps_per_epoch(spec: JobSpec) -> int:
    return build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, TASKS).steps_per_epoch


def test_four_ranks_on_two_nodes_train_to_the_bar(reference: SlurmRun) -> None:
    assert reference.state == "COMPLETED", reference.output
    assert float(FINAL_ACCURACY.search(reference.output).group(1)) >= 0.90, reference.output
    final = final_state(Path(reference.spec.checkpoint.dir).parent)
    assert len(final["ranks"]) == TASKS and final["step"] == reference.spec.train.epochs * steps_per_epoch(reference.spec)
    saved = manifests.latest(open_store(reference.spec.checkpoint.dir))  # rank 0 says where it went (srun labels its lines)
    assert saved is not None and f"0: checkpoint step {final['step']}: {saved.location}\n" in reference.output


def test_usr2_mid_epoch_requeues_and_resumes_to_the_same_weights(
    slurm_cluster: SlurmCluster, digits: Digits, reference: SlurmRun, tmp_path: Path
) -> None:
    spec = job_spec(tmp_path, digits, slurm_cluster)
    job_id = sbatch(slurm_cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), f"step {steps_per_epoch(spec) + 3}/")  # early in epoch 2
    signal_steps(environ(slurm_cluster), job_id)
    assert wait_for_job(slurm_cluster, job_id, 600) == "COMPLETED", output_of(spec, job_id)
    output = output_of(spec, job_id)
    assert job_state(slurm_cluster, job_id)[1] == 1, output
    assert f"requeued job {job_id} (requeue 1 of at most 2)" in output and "restart 1" in output

    step, path = re.search(r"stopped at step (\d+) by SIGUSR2; checkpoint (\S+?);", output).groups()
    assert f"resuming from {path} at step {step}" in output
    stopped = torch.load(path, map_location="cpu", weights_only=True)
    assert stopped["mid_epoch"] and steps_per_epoch(spec) < stopped["step"] < 2 * steps_per_epoch(spec)
    assert (
        same_weights(
            final_state(tmp_path)["objects"]["model"], final_state(Path(reference.spec.checkpoint.dir).parent)["objects"]["model"]
        )
        == []
    )
    assert_epoch_resumes_in_place(spec, stopped["ranks"])


def interrupt_with_usr2(cluster: SlurmCluster, spec: JobSpec) -> tuple[str, str, dict]:
    """sbatch ``spec``, send USR2 early in epoch 2, wait for the requeued job to complete; returns
    (job id, its output, the checkpoint the interrupted run saved)."""
    job_id = sbatch(cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), f"step {steps_per_epoch(spec) + 3}/")
    signal_steps(environ(cluster), job_id)
    assert wait_for_job(cluster, job_id, 600) == "COMPLETED", output_of(spec, job_id)
    output = output_of(spec, job_id)
    assert job_state(cluster, job_id)[1] == 1 and f"requeued job {job_id} (requeue 1 of at most 2)" in output, output
    step, path = re.search(r"stopped at step (\d+) by SIGUSR2; checkpoint (\S+?);", output).groups()
    assert f"resuming from {path} at step {step}" in output
    stopped = torch.load(path, map_location="cpu", weights_only=True)
    assert stopped["mid_epoch"] and steps_per_epoch(spec) < stopped["step"] < 2 * steps_per_epoch(spec)
    return job_id, output, stopped


def test_a_task_from_a_test_module_requeues_and_resumes_to_the_same_weights(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """A task no lance_hpc module defines, named by file path, decoding in DataLoader workers."""
    # 40 ms per batch, 44 steps: about two seconds per epoch, so USR2 lands in epoch 2 however busy the machine is
    custom = {
        "task": {"name": f"{REPO_ROOT}/tests/custom_task.py:PixelMLP", "options": {"hidden": 32, "decode_delay_s": 0.04}},
        "data": {"num_workers": 1, "batch_size": 8},
        "train": {"epochs": 2, "lr": 0.01},
    }
    # The uninterrupted reference runs beside the interrupted job (4 of the cluster's 16 CPUs each).
    reference = job_spec(tmp_path / "reference", digits, slurm_cluster, **custom)
    reference_id = sbatch(slurm_cluster, reference)
    spec = job_spec(tmp_path / "interrupted", digits, slurm_cluster, **custom)
    interrupt_with_usr2(slurm_cluster, spec)
    assert wait_for_job(slurm_cluster, reference_id, 600) == "COMPLETED", output_of(reference, reference_id)
    assert "final validation accuracy" in output_of(reference, reference_id)
    final, expected = final_state(tmp_path / "interrupted"), final_state(tmp_path / "reference")
    assert final["step"] == expected["step"] == 2 * steps_per_epoch(spec)
    assert same_weights(final["objects"]["model"], expected["objects"]["model"]) == []


def test_script_mode_example_requeues_and_resumes_on_the_cluster(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """examples/script_mode (its own loop) through sbatch, preempted mid-epoch: saves, requeues,
    resumes and finishes with every rank on the same step."""
    spec = job_spec(tmp_path, digits, slurm_cluster, entry=f"{REPO_ROOT}/examples/script_mode/train.py:main", train={"epochs": 2})
    _, output, _ = interrupt_with_usr2(slurm_cluster, spec)
    assert "final validation accuracy" in output
    assert final_state(tmp_path)["step"] == 2 * steps_per_epoch(spec)


def test_submitit_preemption_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, digits: Digits, reference: SlurmRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = job_spec(tmp_path, digits, slurm_cluster)
    spec_file, _ = write_job_files(spec)
    for key, value in environ(slurm_cluster).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO_ROOT)
    job = make_executor(spec, tmp_path / "submitit").submit(SubmititJob(str(spec_file)))
    wait_for_output(lambda: Path(job.paths.stdout).read_text(), f"step {steps_per_epoch(spec) + 3}/")
    job._interrupt()  # what SLURM does to a preempted job: SIGTERM, then submitit's USR2
    assert wait_for_job(slurm_cluster, job.job_id, 600) == "COMPLETED", Path(job.paths.stderr).read_text()
    assert job_state(slurm_cluster, job.job_id)[1] == 1
    result = job.task(0).result()
    assert result["status"] == "completed" and result["metrics"]["val/accuracy"] >= 0.90
    assert (
        "by SIGUSR2; checkpoint" in Path(job.paths.stdout).read_text()
        and "requeued by submitit" in Path(job.paths.stdout).read_text()
    )
    assert (
        same_weights(
            final_state(tmp_path)["objects"]["model"], final_state(Path(reference.spec.checkpoint.dir).parent)["objects"]["model"]
        )
        == []
    )


def test_scancel_saves_a_checkpoint_and_ends_without_requeue(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    spec = job_spec(tmp_path, digits, slurm_cluster, train={"epochs": 100})
    job_id = sbatch(slurm_cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), "step 3/")
    subprocess.run(["scancel", job_id], env=environ(slurm_cluster), check=True)  # SIGTERM to every task
    assert wait_for_job(slurm_cluster, job_id, 120) == "CANCELLED"
    time.sleep(5)  # long enough for a wrongful requeue to show
    assert job_state(slurm_cluster, job_id) == ("CANCELLED", 0)
    output = output_of(spec, job_id)
    step, path = re.search(r"stopped at step (\d+) by SIGTERM; checkpoint (\S+?); not requeued", output).groups()
    assert torch.load(path, map_location="cpu", weights_only=True)["step"] == int(step)


def test_a_rank_killed_mid_epoch_restarts_in_the_allocation_and_ends_with_the_reference_weights(
    slurm_cluster: SlurmCluster, digits: Digits, reference: SlurmRun, tmp_path: Path
) -> None:
    """Rank 1 early in epoch 2 is stopped (SIGSTOP) until the next attempt's ranks are started and
    waiting, then killed: srun ends the step, and the job starts again in the same allocation (no
    requeue: SLURM's restart count stays 0) with those ranks, from the latest checkpoint, redoing only
    the steps since it, and ends with the uninterrupted reference job's weights (deterministic mode).
    status lists both attempts; TensorBoard has what the restart cost."""
    # the hang of the stopped rank is the test's own: neither the watchdog nor a timeout ends it first
    patient = {"collective_timeout_s": 300, "watchdog": {"floor_s": 600}}
    spec = job_spec(tmp_path, digits, slurm_cluster, slurm={"restart_standby": True}, train=patient)
    job_id = sbatch(slurm_cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), f"step {steps_per_epoch(spec) + 3}/")
    rank_1 = task_pid(job_id, rank=1)
    os.kill(rank_1, signal.SIGSTOP)
    wait_for_output(lambda: output_of(spec, job_id), "lance_hpc: attempt 2's 4 ranks are started and waiting", timeout_s=240)
    os.kill(rank_1, signal.SIGKILL)
    assert wait_for_job(slurm_cluster, job_id, 600) == "COMPLETED", output_of(spec, job_id)
    output = output_of(spec, job_id)
    assert job_state(slurm_cluster, job_id)[1] == 0, output  # never requeued
    assert re.search(
        r"lance_hpc: attempt 1 failed after \d+ s: rank 1 on node1 was killed \(srun: Killed\); restart 1 of at most 2", output
    )
    assert "lance_hpc: attempt 2 of at most 3 on node1, node2: 4 ranks (its ranks were started and waiting)" in output
    assert "task 1: Killed" in output and f"job {job_id} (restart 0) on" in output and "(restart 1)" not in output

    # resumed from the checkpoint at the epoch's start, the latest (the next would be at step 50),
    # redoing at most the steps since it
    resumed = int(re.search(r"resuming from \S+ at step (\d+)", output).group(1))
    before = output[: output.index("lance_hpc: attempt 1 failed")]
    reached = max(int(step) for step in re.findall(r"^0: step (\d+)/", before, flags=re.MULTILINE))
    assert resumed == steps_per_epoch(spec) < reached < spec.checkpoint.every_steps, output
    redone = re.search(r"restart 1: first step [\d.]+ s after the failure \(step (\d+)\); (\d+) step\(s\) since", output)
    assert redone and int(redone.group(1)) == resumed + 1 and int(redone.group(2)) <= reached + 1 - resumed, output
    logged = scalars(Path(spec.logging.tensorboard_dir))
    assert [step for step, _ in logged["restarts/downtime_s"]] == [resumed + 1] and logged["restarts/attempt"][0][1] == 1
    assert (
        same_weights(
            final_state(tmp_path)["objects"]["model"], final_state(Path(reference.spec.checkpoint.dir).parent)["objects"]["model"]
        )
        == []
    )
    status = lance_hpc(slurm_cluster, "status", job_id).stdout
    assert re.search(r"attempts +2 attempt\(s\) \(slurm.max_restarts: 2 per allocation\)", status), status
    assert re.search(r"attempt 1 on node1,node2 \(4 ranks\): failed after \d+ s: rank 1 on node1 was killed", status), status
    assert re.search(r"attempt 2 on node1,node2 \(4 ranks\): finished", status), status


def test_a_node_taken_down_mid_run_the_job_goes_on_on_the_other_with_fewer_ranks(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """node2 set DOWN early in epoch 2 of a job that may go on with one node (slurm.min_nodes): the
    allocation stays (--no-kill), node2 leaves it, and the next attempt runs on node1 alone with 2
    ranks, resuming the 4 ranks' checkpoint, to the end."""
    spec = job_spec(tmp_path, digits, slurm_cluster, slurm={"min_nodes": 1}, train={"epochs": 3})
    job_id = sbatch(slurm_cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), f"step {steps_per_epoch(spec) + 3}/")
    try:
        slurm_cluster.run("scontrol", "update", "nodename=node2", "state=down", "reason=lance_hpc test: taken down")
        state = wait_for_job(slurm_cluster, job_id, 600)
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=node2", "state=resume", check=False)
    output = output_of(spec, job_id)
    assert state == "COMPLETED" and job_state(slurm_cluster, job_id)[1] == 0, output
    assert "lance_hpc: attempt 1 failed after" in output and "node node2 failed" in output, output
    assert re.search(r"lance_hpc: attempt 2 of at most 3 on node1: 2 ranks, down from 4; left out: node2 \(", output), output
    assert "written by 4 ranks, continued by 2" in output
    final = final_state(tmp_path)
    assert final["world_size"] == 2 and final["epoch"] == 3 and "final validation accuracy" in output


def test_a_task_raising_at_the_same_step_stops_after_its_second_attempt_with_its_own_error(
    slurm_cluster: SlurmCluster,
    digits: Digits,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through submitit, whose srun line runs through the same supervisor: rank 1 raises at its
    5th batch in every attempt, a bug rather than a fault, so the second attempt is the last; the
    job fails with that error and that rank, not with the others' lost contact."""
    task = {"name": f"{REPO_ROOT}/tests/custom_task.py:FailingMLP", "options": {"hidden": 8, "fail_rank": 1, "fail_step": 5}}
    spec = job_spec(tmp_path, digits, slurm_cluster, task=task, train={"epochs": 1})
    spec_file, _ = write_job_files(spec)
    for key, value in environ(slurm_cluster).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO_ROOT)
    job = make_executor(spec, JobPaths.of(spec).submitit_folder).submit(SubmititJob(str(spec_file)))
    assert wait_for_job(slurm_cluster, job.job_id, 600) == "FAILED"
    batch_log = Path(job.paths.stderr).read_text()  # the batch script's stderr, task 0's too
    assert job_state(slurm_cluster, job.job_id)[1] == 0, batch_log
    assert (
        "lance_hpc: the job failed after 2 attempt(s) in this allocation: the same error at step 4 in attempts 1 and 2, so "
        "a restart would fail again: rank 1 on node1 at step 4: ValueError: bad batch on rank 1 at step 5"
    ) in batch_log, batch_log
    attempts = read_attempts(JobPaths.of(spec).attempts / job.job_id / ATTEMPTS_FILE)
    assert len(attempts) == 2 and all(attempt.exit_code for attempt in attempts), attempts
    assert attempts[0].outcome.startswith("restarted") and attempts[1].outcome.startswith("the same error"), attempts
    assert wait_for(job) == 1
    assert "task 1 failed first: " in capsys.readouterr().err


def task_pid(job_id: str, rank: int) -> int:
    """The pid of the trainer process of task ``rank`` of ``job_id`` (the emulated nodes are local)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if (
            is_rank_command(command)
            and {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()} <= environ
            and not is_standby(environ)
        ):
            return int(entry.name)
    raise AssertionError(f"task {rank} of job {job_id} not found")


def test_four_ranks_preempted_mid_epoch_continue_on_two_with_every_row_once(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """4 ranks on 2 nodes get USR2 mid-epoch (with no requeues left, so they save and stop); the
    job is resubmitted with --set slurm.nodes=1 and finishes on 2 ranks: the rows of the stopped
    epoch the first job trained on are not read again, the rest exactly once, with equal steps."""
    task = {
        "name": f"{REPO_ROOT}/tests/custom_task.py:RowLoggingMLP",
        # 150 ms per batch: the 20 steps of epoch 2 left after the third take 3 s, time for USR2 to land
        # in them however busy the machine is (at full speed they took 0.6 s, and a busy run missed them)
        "options": {"hidden": 16, "row_log": str(tmp_path / "rows4"), "decode_delay_s": 0.15},
    }
    (tmp_path / "rows4").mkdir()
    spec = job_spec(tmp_path, digits, slurm_cluster, task=task, train={"epochs": 2, "lr": 0.01}, slurm={"max_requeues": 0})
    job_id = sbatch(slurm_cluster, spec)
    wait_for_output(lambda: output_of(spec, job_id), f"step {steps_per_epoch(spec) + 3}/")
    signal_steps(environ(slurm_cluster), job_id)
    wait_for_job(slurm_cluster, job_id, 300)
    assert "not requeued" in output_of(spec, job_id), output_of(spec, job_id)
    stopped = final_state(tmp_path)
    assert stopped["mid_epoch"] and stopped["world_size"] == TASKS

    (tmp_path / "rows2").mkdir()
    spec_file = Path(spec.slurm.log_dir) / f"{spec.name}.spec.yaml"
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "lance_hpc.submit",
            str(spec_file),
            "--render-only",
            "--set",
            "slurm.nodes=1",
            "--set",
            f"task.options.row_log={tmp_path / 'rows2'}",
        ],
        env=environ(slurm_cluster),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    script = Path(spec.slurm.log_dir) / f"{spec.name}.sbatch"
    assert str(script) in rendered.stdout + rendered.stderr
    resized = load_spec(spec_file).spec
    assert resized.slurm.world_size == 2
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env=environ(slurm_cluster),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    second = submitted.stdout.strip().split(";")[0]
    assert wait_for_job(slurm_cluster, second, 600) == "COMPLETED", output_of(resized, second)
    assert "written by 4 ranks, continued by 2" in output_of(resized, second)

    before, after = logged_rows(tmp_path / "rows4", TASKS), logged_rows(tmp_path / "rows2", 2)
    first_epoch = steps_per_epoch(spec)
    assert len({len(batches) for batches in after}) == 1
    rest = collections.Counter(row for batches in before for batch in batches[first_epoch:] for row in batch)
    rest.update(row for batches in after for batch in batches for row in batch)
    assert rest == planned_rows(spec, TASKS, epoch=1)
    assert final_state(tmp_path)["epoch"] == 2


def test_a_filtered_mix_requeued_by_usr2_draws_each_source_epoch_once(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """A mix of the training digits below 5 (weight 3) and the validation digits (weight 1) on 4
    ranks, sent USR2 early in epoch 2: the requeued job resumes with the versions and filter it
    pinned, and over both runs each source's rows come once per source epoch (a row's count is its
    source's whole epochs or one more), the filter holds, every step draws both sources."""
    from lance_hpc.loading.mix import offset_of, source_of

    (tmp_path / "rows").mkdir()
    mix = [
        {"uri": digits.train, "weight": 3, "filter": "label < 5", "val_uri": digits.val},
        {"uri": digits.val, "weight": 1},
    ]
    task = {
        "name": f"{REPO_ROOT}/tests/custom_task.py:RowLoggingMLP",
        # 80 ms per batch: epoch 2 lasts long enough that USR2 lands in it however busy the machine is
        "options": {"hidden": 16, "row_log": str(tmp_path / "rows"), "decode_delay_s": 0.08},
    }
    spec = job_spec(tmp_path, digits, slurm_cluster, task=task, data={"mix": mix}, train={"epochs": 2, "lr": 0.01})
    _, output, stopped = interrupt_with_usr2(slurm_cluster, spec)
    assert re.search(
        rf"pinned at the first start: {digits.train} version \d+, rows where label < 5, weight 3; {digits.val} ", output
    )
    assert stopped["ranks"][0]["loaders"]["loader"]["mix"]["weights"] == [3.0, 1.0]
    # data.val_uri and the first source's own validation set, each reported
    assert re.search(r"step \d+: validation accuracy: [\d.]+ \(loss [\d.]+\) \(359 samples\)", output), output
    assert re.search(r"step \d+: validation of 0_train accuracy: [\d.]+ \(loss [\d.]+\) \(359 samples\)", output), output
    per_rank = logged_rows(tmp_path / "rows", TASKS)
    steps = 2 * steps_per_epoch(spec)
    assert [len(batches) for batches in per_rank] == [steps] * TASKS  # equal steps, none twice, none lost
    rows = [row for batches in per_rank for batch in batches for row in batch]
    ids = torch.tensor(rows).numpy()
    sources, offsets = source_of(ids), offset_of(ids)
    train = build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, TASKS)
    below_five = set(train.source.selections[0].offsets.tolist())
    assert set(offsets[sources == 0].tolist()) <= below_five
    for source, size in ((0, len(below_five)), (1, 359)):
        counts = collections.Counter(offsets[sources == source].tolist())
        whole = sum(counts.values()) // size
        assert set(counts.values()) <= {whole, whole + 1}, source
    assert all(len(set(source_of(torch.tensor(batch).numpy()).tolist())) == 2 for batches in per_rank for batch in batches)


def test_a_sharded_job_saving_in_the_background_requeues_and_resumes(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """train.parallelism fsdp on 4 ranks of 2 nodes, checkpoint.async_save: USR2 early in epoch 2
    waits for the background write, requeues, and the requeued job resumes from the shards and trains
    to the bar."""
    spec = job_spec(tmp_path, digits, slurm_cluster, train={"epochs": 2, "parallelism": "fsdp"}, checkpoint={"async_save": True})
    job_id, output, stopped = interrupt_with_usr2(slurm_cluster, spec)
    assert stopped["shards"] == f"step-{stopped['step']:08d}.dcp", stopped.keys()
    assert (Path(spec.checkpoint.dir) / stopped["shards"] / ".metadata").is_file()
    assert float(FINAL_ACCURACY.search(output).group(1)) >= 0.85, output
    assert "Traceback" not in output, output
