"""The watchdog on real multi-process jobs: a rank stuck in its own loop, a DataLoader worker that
stops answering, a rank slowed down on purpose. Each is named with its rank, host, phase and
stack within the configured time, every rank's stacks are written, and status shows it."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from tests.support.jobs import REPO_ROOT, write_spec
from tests.support.ranks import launch, read_until

pytestmark = pytest.mark.slow

WATCHDOG = {"watchdog": {"floor_s": 3, "factor": 5}, "collective_timeout_s": 60, "epochs": 50}


def hanging_spec(tmp_path: Path, digits, **options) -> Path:
    task = {"name": f"{REPO_ROOT}/tests/custom_task.py:HangingMLP", "options": {"hidden": 8, **options}}
    return write_spec(tmp_path, digits, task=task, train=WATCHDOG, logging={"progress": False, "log_every_steps": 5})


def watchdog_report(launcher) -> tuple[str, float]:
    """The launcher's output up to the end of the watchdog's message, and when its first line came."""
    head = read_until(launcher, "lance_hpc.watchdog: rank", timeout_s=180)
    seen = time.monotonic()
    rest = read_until(launcher, "every rank's stacks", timeout_s=30)
    before = "".join(line for line in head.splitlines(keepends=True)[:-1] if "lance_hpc" in line or "Error" in line)
    return head.splitlines()[-1] + "\n" + rest + ("\nbefore it:\n" + before if before else ""), seen


def stop(launcher) -> None:
    launcher.send_signal(signal.SIGKILL)  # the ranks die with it (PR_SET_PDEATHSIG)
    launcher.communicate(timeout=60)


def test_a_rank_stuck_in_its_loop_is_named_with_its_stack(tmp_path: Path, digits) -> None:
    launcher = launch(hanging_spec(tmp_path, digits, hang_rank=1, hang_step=8, where="forward"))
    try:
        read_until(launcher, "step 5/")
        started = time.monotonic()
        report, seen = watchdog_report(launcher)
    finally:
        stop(launcher)
    print(report)
    assert seen - started < 30  # the step took 3 s past its limit: named within seconds, not at the 60 s timeout
    first = report.splitlines()[0]
    assert re.search(
        r"lance_hpc\.watchdog: rank 1 on \S+ is stuck in the loop's own work \(forward, backward, optimizer\) for \d+ s, at step 7",
        first,
    ), report
    assert "custom_task.py" in report and "time.sleep(3600)" in report, report
    assert "waiting for it in a collective: rank 0" in report, report
    stacks = tmp_path / "logs" / "digits.watch" / "local" / "stacks"
    for rank in (0, 1):
        text = (stacks / f"rank-{rank}.txt").read_text()
        assert f"rank {rank} on" in text and 'Thread "MainThread"' in text
    assert "time.sleep(3600)" in (stacks / "rank-1.txt").read_text()
    status = json.loads((tmp_path / "logs" / "digits.watch" / "local" / "rank-1.json").read_text())
    assert status["overdue"] and status["phase"] == "compute" and status["step"] == 7


def test_a_dataloader_worker_that_stops_answering_is_named_and_its_stack_written(tmp_path: Path, digits) -> None:
    spec = hanging_spec(tmp_path, digits, hang_rank=1, hang_step=9, where="worker")
    text = spec.read_text().replace("num_workers: 0", "num_workers: 1")
    spec.write_text(text)
    launcher = launch(spec)
    try:
        report, _ = watchdog_report(launcher)
        time.sleep(1)  # the worker writes its stacks when the rank signals it
    finally:
        stop(launcher)
    print(report)
    assert re.search(r"rank 1 on \S+ is stuck waiting for its next batch for \d+ s", report), report
    worker = (tmp_path / "logs" / "digits.watch" / "local" / "stacks" / "rank-1-worker-0.txt").read_text()
    assert "custom_task.py" in worker and "in decode" in worker, worker
    assert "rank-1-worker-0.txt" in (tmp_path / "logs" / "digits.watch" / "local" / "stacks" / "rank-1.txt").read_text()


def test_a_rank_slowed_down_on_purpose_is_named_a_straggler(tmp_path: Path, digits) -> None:
    spec = hanging_spec(tmp_path, digits, hang_rank=1, slow_s=0.05)
    launcher = launch(spec)
    try:
        line = read_until(launcher, "lance_hpc.watchdog: straggler", timeout_s=180).splitlines()[-1]
        print(line)
    finally:
        stop(launcher)
    assert re.search(r"straggler rank 1: [\d.]+ s per step \(0\.0[5-9]\d* s of its own work", line), line
    assert "rank 0:" not in line


@pytest.mark.slurm
def test_a_stuck_rank_on_the_cluster_is_named_and_status_shows_it_stuck(slurm_cluster, digits, tmp_path: Path) -> None:
    """4 ranks on 2 nodes through sbatch; rank 2 blocks in its loop: its job log names rank 2 and
    its node with the top of its stack, and lance-hpc status shows the job as stuck."""
    import subprocess
    import sys

    from lance_hpc.runtime.watchdog import activity_line, watch_dir
    from lance_hpc.spec import load_spec
    from tests.support.slurm import environ, sbatch, wait_for_text

    task = {"name": f"{REPO_ROOT}/tests/custom_task.py:HangingMLP", "options": {"hidden": 8, "hang_rank": 2, "hang_step": 8}}
    slurm = {"partition": slurm_cluster.partition, "nodes": 2, "tasks_per_node": 2, "cpus_per_task": 1, "time": "00:10:00"}
    spec_path = write_spec(
        tmp_path, digits, name="stuck", task=task, train=WATCHDOG, logging={"progress": False, "log_every_steps": 5}, slurm=slurm
    )
    spec = load_spec(spec_path).spec
    job_id = sbatch(slurm_cluster, spec)
    try:
        log = Path(spec.slurm.log_dir) / f"stuck-{job_id}.err"
        wait_for_text(log, "every rank's stacks", timeout_s=240)
        text = log.read_text()
        assert re.search(r"lance_hpc\.watchdog: rank 2 on node\d is stuck in the loop's own work", text), text
        assert "time.sleep(3600)" in text and "waiting for it in a collective: rank 0, 1, 3" in text, text
        directory = watch_dir(spec.slurm.log_dir, spec.name, job_id)
        assert sorted(path.name for path in (directory / "stacks").glob("rank-?.txt")) == [f"rank-{r}.txt" for r in range(4)]
        line = activity_line(directory)
        assert line is not None and line.startswith("STUCK: rank 2 on node"), line
        status = subprocess.run(
            [sys.executable, "-m", "lance_hpc", "status", str(spec_path)],
            env=environ(slurm_cluster),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        print(status)
        assert re.search(r"ranks +STUCK: rank 2 on node\d in the loop's own work", status), status
    finally:
        subprocess.run(["scancel", job_id], env=environ(slurm_cluster), capture_output=True)
