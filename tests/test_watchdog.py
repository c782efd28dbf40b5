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
from tests.support.ranks import launch

pytestmark = pytest.mark.slow

WATCHDOG = {"watchdog": {"floor_s": 3, "factor": 5}, "collective_timeout_s": 60, "epochs": 50}


def three_faults(straggler: int, silent_worker: int, stuck: int) -> dict[str, float]:
    """HangingMLP's options for one job that shows the three cases in turn: ``straggler`` is slower
    at every step; ``silent_worker``'s DataLoader worker stops answering for 12 s at its 25th batch
    (then answers: the job goes on); ``stuck``'s own loop blocks for good at its 45th batch."""
    return {
        "slow_rank": straggler,
        "slow_s": 0.05,
        "worker_hang_rank": silent_worker,
        "worker_hang_step": 25,
        "worker_hang_s": 12,
        "hang_rank": stuck,
        "hang_step": 45,
    }


def hanging_spec(tmp_path: Path, digits, options: dict[str, float], restarts: int = 0, **sections) -> Path:
    """A job of HangingMLP; without ``restarts`` (slurm.max_restarts) the watchdog only reports a
    hang, with them a hang it names ends the attempt."""
    task = {"name": f"{REPO_ROOT}/tests/custom_task.py:HangingMLP", "options": {"hidden": 8, **options}}
    slurm = {"max_restarts": restarts, **sections.pop("slurm", {})}
    train = {**WATCHDOG, **sections.pop("train", {})}
    return write_spec(
        tmp_path,
        digits,
        task=task,
        train=train,
        logging={"progress": False, "log_every_steps": 5},
        data={"num_workers": 1},  # a worker to hang
        slurm=slurm,
        **sections,
    )


def read_reports(launcher, count: int, timeout_s: float = 240) -> str:
    """The launcher's output up to the end of its ``count``-th watchdog report."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum("every rank's stacks" in line for line in lines) < count:
        line = launcher.stdout.readline()
        if not line:
            break
        lines.append(line)
    output = "".join(lines)
    assert output.count("every rank's stacks") == count, output
    return output


def reports(output: str) -> list[str]:
    """Each watchdog hang report in ``output``, from its first line to its stacks line."""
    return re.findall(r"lance_hpc\.watchdog: rank .*?every rank's stacks[^\n]*", output, flags=re.DOTALL)


def worker_stacks(stacks: Path, rank: int) -> str:
    """What the DataLoader workers of ``rank`` wrote (training's and evaluation's, each by its pid)."""
    return "".join(path.read_text() for path in sorted(stacks.glob(f"rank-{rank}-worker-*.txt")))


def seconds_stuck(report: str) -> int:
    return int(re.search(r"for (\d+) s, at step", report).group(1))


def test_a_straggler_a_silent_dataloader_worker_and_a_stuck_rank_are_each_named_with_their_stacks(tmp_path: Path, digits) -> None:
    launcher = launch(hanging_spec(tmp_path, digits, three_faults(straggler=1, silent_worker=0, stuck=1)))
    stacks = tmp_path / "logs" / "digits.watch" / "local" / "stacks"
    try:
        first = read_reports(launcher, 1)
        worker = worker_stacks(stacks, 0)  # written while the worker still sleeps
        output = first + read_reports(launcher, 1)
        time.sleep(1)  # the ranks finish writing their stacks
    finally:
        stop(launcher)
    print(output)
    straggler = next(line for line in output.splitlines() if "lance_hpc.watchdog: straggler" in line)
    assert re.search(r"straggler rank 1 on \S+: [\d.]+ s per step \(0\.0[5-9]\d* s of its own work", straggler), straggler
    assert "rank 0:" not in straggler

    silent_worker, stuck = reports(output)
    assert re.search(r"^lance_hpc\.watchdog: rank 0 on \S+ is stuck waiting for its next batch for \d+ s", silent_worker), (
        silent_worker
    )
    assert "waiting for it in a collective: rank 1" in silent_worker, silent_worker
    assert "custom_task.py" in worker and "in decode" in worker, worker
    assert re.search(r"DataLoader worker \(pid \d+\): \S+/rank-0-worker-0-\d+\.txt", (stacks / "rank-0.txt").read_text())

    assert re.search(
        r"^lance_hpc\.watchdog: rank 1 on \S+ is stuck in the loop's own work \(forward, backward, optimizer\) for \d+ s, at step 4\d",
        stuck,
    ), stuck
    assert "custom_task.py" in stuck and "time.sleep(3600)" in stuck, stuck
    assert "waiting for it in a collective: rank 0" in stuck, stuck
    # Named a few seconds past the 3 s limit, long before the 60 s collective timeout would end the job.
    assert all(seconds_stuck(report) < 30 for report in (silent_worker, stuck)), output
    for rank in (0, 1):
        text = (stacks / f"rank-{rank}.txt").read_text()
        assert f"rank {rank} on" in text and 'Thread "MainThread"' in text
    assert "time.sleep(3600)" in (stacks / "rank-1.txt").read_text()
    status = json.loads((tmp_path / "logs" / "digits.watch" / "local" / "rank-1.json").read_text())
    assert status["overdue"] and status["phase"] == "compute" and 40 <= status["step"] < 50


def test_with_a_restart_left_a_hang_the_watchdog_names_ends_the_attempt_and_the_job_completes(tmp_path: Path, digits) -> None:
    """Rank 1 blocks for good at its 40th batch (step 40 of the epoch's 45): rank 0's watchdog
    names it, notes the hang and ends the attempt, long before the 60 s collective timeout; the
    next attempt resumes from step 30, runs its 15 steps and the job completes."""
    spec = hanging_spec(tmp_path, digits, {"hang_rank": 1, "hang_step": 40}, restarts=1, train={"epochs": 1})
    launcher = launch(spec)
    try:
        output = launcher.communicate(timeout=300)[0]
    finally:
        launcher.kill()
    print(output)
    assert launcher.returncode == 0, output
    assert output.count("ending this attempt so that the job starts again from its checkpoint") == 1, output
    assert re.search(
        r"restart 1 of at most 1, from the latest checkpoint, after: rank 1 on \S+ at step 39: hung in the loop's own work "
        r"\(forward, backward, optimizer\) \(named by the watchdog\)",
        output,
    ), output
    assert re.search(r"resuming from \S+ at step 30", output) and "final validation accuracy" in output, output


def stop(launcher) -> None:
    launcher.send_signal(signal.SIGKILL)  # the ranks die with it (PR_SET_PDEATHSIG)
    launcher.communicate(timeout=60)


@pytest.mark.slurm
def test_a_straggler_a_silent_worker_and_a_stuck_rank_on_the_cluster_are_named_and_status_shows_it_stuck(
    slurm_cluster, digits, tmp_path: Path
) -> None:
    """4 ranks on 2 nodes through sbatch: rank 3 is a straggler, rank 1's DataLoader worker stops
    answering for 12 s, then rank 2 blocks in its loop. The job log names each with its node (the
    hangs with the top of their stacks), and lance-hpc status shows the job as stuck."""
    import subprocess

    from lance_hpc.runtime.watchdog import activity_line, watch_dir
    from lance_hpc.spec import load_spec
    from tests.support.slurm import environ, lance_hpc, sbatch, wait_for_text

    slurm = {"partition": slurm_cluster.partition, "nodes": 2, "tasks_per_node": 2, "cpus_per_task": 1, "time": "00:10:00"}
    spec_path = hanging_spec(tmp_path, digits, three_faults(straggler=3, silent_worker=1, stuck=2), name="stuck", slurm=slurm)
    spec = load_spec(spec_path).spec
    job_id = sbatch(slurm_cluster, spec)
    try:
        log = Path(spec.slurm.log_dir) / f"stuck-{job_id}.err"
        directory = watch_dir(spec.slurm.log_dir, spec.name, job_id)
        wait_for_text(log, "every rank's stacks", timeout_s=240)
        worker = worker_stacks(directory / "stacks", 1)  # while the worker still sleeps
        wait_for_text(log, "is stuck in the loop's own work", timeout_s=120)
        wait_for_text(log, "every rank's stacks", count=2, timeout_s=30)
        text = log.read_text()
        print(text)
        assert re.search(r"lance_hpc\.watchdog: straggler rank 3 on node\d: ", text), text
        silent_worker, stuck = reports(text)
        assert re.search(r"^lance_hpc\.watchdog: rank 1 on node\d is stuck waiting for its next batch", silent_worker), text
        assert "custom_task.py" in worker and "in decode" in worker, worker
        assert re.search(r"^lance_hpc\.watchdog: rank 2 on node\d is stuck in the loop's own work", stuck), text
        assert "time.sleep(3600)" in stuck and "waiting for it in a collective: rank 0, 1, 3" in stuck, text
        assert sorted(path.name for path in (directory / "stacks").glob("rank-?.txt")) == [f"rank-{r}.txt" for r in range(4)]
        line = activity_line(directory)
        assert line is not None and line.startswith("STUCK: rank 2 on node"), line
        status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
        print(status)
        assert re.search(r"ranks +STUCK: rank 2 on node\d in the loop's own work", status), status
    finally:
        subprocess.run(["scancel", job_id], env=environ(slurm_cluster), capture_output=True)
