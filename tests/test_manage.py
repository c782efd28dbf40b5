"""``lance-hpc status | logs | cancel``: parsing what SLURM prints, the time-left estimate and the
log readers as units; then the real thing on the SLURM test cluster, which has no accounting
(``sacct`` fails there): a small training job is watched, its logs read and followed, and it is
cancelled so that it saves a checkpoint, through sbatch and through submitit; ``logs -f`` follows
a job through its requeue, ``cancel --now`` stops one without a save, and a pending job is
cancelled at once."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.launch.render import write_job_files
from lance_hpc.loading import build_train_loader, load_task
from lance_hpc.manage import logs, progress
from lance_hpc.slurm import queue, records
from lance_hpc.spec import JobSpec, expand, load_spec
from tests.support.jobs import REPO_ROOT, Digits, write_spec
from tests.support.ports import free_port
from tests.support.slurm import job_fields, job_log, signal_steps
from tests.support.slurm import lance_hpc as run_lance_hpc
from tests.support.slurm_cluster import SlurmCluster, log_hint

RUNNING_LINE = (
    "JobId=42 JobName=digits UserId=me(1000) GroupId=me(1000) Priority=1 JobState=RUNNING Reason=None "
    "Requeue=1 Restarts=2 BatchFlag=1 ExitCode=0:0 RunTime=00:03:12 TimeLimit=00:15:00 "
    "SubmitTime=2026-11-23T18:17:13 StartTime=2026-11-23T18:17:13 EndTime=2026-11-23T18:32:13 "
    "NodeList=node[1-2] NumTasks=4 Command=/home/me/my runs/digits.sbatch WorkDir=/home/me/my runs "
    "StdErr=/home/me/my runs/logs/digits-42.err StdIn=/dev/null StdOut=/home/me/my runs/logs/digits-42.out Power="
)
ARRAY_LINE = (
    "JobId=57 ArrayJobId=55 ArrayTaskId=2 JobName=sweep JobState=PENDING Reason=Resources Restarts=0 "
    "ExitCode=0:0 StartTime=Unknown NodeList=(null) StdOut=/l/sweep-55_2.out"
)


# ---- units: what SLURM prints ------------------------------------------------------------------


def test_scontrol_fields_keep_values_with_spaces() -> None:
    (fields,) = queue.parse_scontrol(RUNNING_LINE + "\n")
    assert fields["Command"] == "/home/me/my runs/digits.sbatch"
    assert fields["StdOut"] == "/home/me/my runs/logs/digits-42.out" and fields["Power"] == ""
    job = queue.job_from_scontrol(fields)
    assert (job.job_id, job.name, job.state, job.restarts, job.nodes) == ("42", "digits", "RUNNING", 2, "node[1-2]")
    assert job.reason == "" and job.started and not job.ended and job.describe_exit() == ""


def test_array_tasks_are_named_by_array_job_and_task() -> None:
    jobs = [queue.job_from_scontrol(fields) for fields in queue.parse_scontrol(f"{RUNNING_LINE}\n{ARRAY_LINE}\n")]
    assert [job.job_id for job in jobs] == ["42", "55_2"]
    pending = jobs[1]
    assert pending.reason == "Resources" and not pending.started and pending.start_time == "" and pending.nodes == ""


@pytest.mark.parametrize(("state", "exit_code", "described"), [
    ("FAILED", "3:0", "exit 3 (stopped by a signal, checkpoint saved)"),
    ("FAILED", "2:0", "exit 2 (a problem in the spec or data, see the log)"),
    ("CANCELLED", "0:15", "exit 0, killed by signal 15"),
    ("FAILED", "143:0", "exit 143 (a task ended by SIGTERM)"),
    ("COMPLETED", "0:0", "exit 0"),
    ("RUNNING", "0:0", ""),
])  # fmt: skip
def test_exit_codes_say_what_lance_hpc_meant(state: str, exit_code: str, described: str) -> None:
    job = queue.SlurmJob("1", "x", state, "scontrol", exit_code=exit_code)
    assert job.describe_exit() == described


def test_sacct_runs_of_a_requeued_job_count_its_restarts() -> None:
    text = (
        "77|digits|PREEMPTED|0:0|2026-01-01T10:00:00|2026-01-01T11:00:00|01:00:00|node1\n"
        "77|digits|REQUEUED|0:0|2026-01-01T11:01:00|2026-01-01T11:30:00|00:29:00|node2\n"
        "77|digits|CANCELLED by 1000|0:15|2026-01-01T11:32:00|2026-01-01T11:40:00|00:08:00|node2\n"
    )
    job = queue.parse_sacct(text, "77")
    assert job is not None and (job.state, job.restarts, job.exit_code, job.source) == ("CANCELLED", 2, "0:15", "sacct")
    assert queue.parse_sacct(text, "78") is None and queue.parse_sacct("", "77") is None


def test_squeue_ids_sort_as_numbers_with_array_tasks_after_their_job() -> None:
    assert queue.parse_squeue_ids("100\n99\n100_10\n100_2\n\n99\n") == ["99", "100", "100_2", "100_10"]


# ---- units: time left, outcomes, logs ----------------------------------------------------------


@pytest.mark.parametrize(("step", "total", "per_step", "left"), [
    (0, 100, 0.5, 50.0),
    (60, 100, 2.0, 80.0),
    (100, 100, 2.0, 0.0),
    (120, 100, None, 0.0),  # past the end (max_steps lowered on resume): nothing left
    (10, 100, None, None),  # nothing logged yet: unknown, not zero
])  # fmt: skip
def test_time_left_is_steps_left_times_recent_seconds_per_step(
    step: int, total: int, per_step: float | None, left: float | None
) -> None:
    assert progress.seconds_left(step, total, per_step) == left


def test_recent_seconds_per_step_averages_the_last_log_points() -> None:
    step_times = [(step, 9.0) for step in range(1, 20)] + [(20, 1.0), (21, 2.0), (22, 3.0), (23, 4.0), (24, 5.0)]
    assert progress.recent_seconds_per_step(step_times) == 3.0  # the slow start is no longer recent
    assert progress.recent_seconds_per_step([(1, 2.0), (2, float("nan"))]) == 2.0
    assert progress.recent_seconds_per_step([]) is None


@pytest.mark.parametrize(("seconds", "text"), [
    (0.4, "0 s"), (59, "59 s"), (61, "1 min 1 s"), (3600 * 3 + 7 * 60, "3 h 07 min"), (86400 * 2 + 3600 * 4, "2 d 04 h"),
])  # fmt: skip
def test_durations_read_like_a_person_would_say_them(seconds: float, text: str) -> None:
    assert progress.format_duration(seconds) == text


def test_outcome_is_read_from_the_last_run_of_the_job() -> None:
    requeued = (
        "job 7 (restart 0) on node1: 2 tasks\n0: step 30/90: train/loss 1.2\n"
        "0: stopped at step 31 by SIGUSR2; checkpoint /c/step-00000031.pt; requeued job 7 (requeue 1 of at most 2)\n"
        "job 7 (restart 1) on node2: 2 tasks\n0: resuming from /c/step-00000031.pt at step 31 (epoch 0)\n"
    )
    assert progress.outcome_from_log(requeued) is None  # the restarted run has not ended yet
    finished = requeued + "0: final validation accuracy: 0.95 after 90 steps\n"
    assert progress.outcome_from_log(finished) == "finished after 90 steps, validation accuracy: 0.95"
    stopped = requeued + "0: stopped at step 40 by SIGTERM; checkpoint /c/step-00000040.pt; not requeued: ...\n"
    assert progress.outcome_from_log(stopped) == "stopped at step 40 by SIGTERM, checkpoint /c/step-00000040.pt"
    failed = "1: lance_hpc.run: rank 1 failed: out of memory\n"
    assert progress.outcome_from_log(requeued, failed) == "failed: rank 1 failed: out of memory"
    traceback = (
        '0: Traceback (most recent call last):\n0:   File "x.py", line 1, in f\n'
        "0: lance_hpc.run.TrainingFailed: rank 0/2: lost contact with another rank\n"
        "srun: error: node1: task 0: Exited with exit code 1\n"
    )
    assert progress.outcome_from_log("", traceback) == "failed: TrainingFailed: rank 0/2: lost contact with another rank"


def test_rank_filter_keeps_one_ranks_labelled_lines_without_the_label() -> None:
    keep = logs.rank_filter(1)
    assert keep(b"1: hello") == b"hello" and keep(b" 1: padded when there are 10+ tasks") == b"padded when there are 10+ tasks"
    assert keep(b"11: another rank") is None and keep(b"job 3 (restart 0)") is None
    assert logs.rank_filter(None)(b"anything") == b"anything"


def test_tail_returns_complete_lines_and_keeps_a_cut_off_one(tmp_path: Path) -> None:
    path = tmp_path / "x.out"
    tail = logs.Tail(path)
    assert tail.read() == []  # not written yet
    path.write_bytes(b"one\ntw")
    assert tail.read() == [b"one"]
    with open(path, "ab") as file:
        file.write(b"o\nthree")
    assert tail.read() == [b"two"] and tail.read(final=True) == [b"three"]


def test_tail_reads_in_chunks_and_only_regular_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job found by id alone has whatever log path SLURM shows: a FIFO or a device there is
    refused at once instead of blocking or never ending, and a big log is read a chunk at a time."""
    monkeypatch.setattr(logs, "READ_CHUNK", 8)
    path = tmp_path / "x.out"
    path.write_bytes(b"0: a\n0: bcdefghijk\n1: c")
    tail = logs.Tail(path)
    assert tail.read() == [b"0: a"] and tail.more
    assert tail.read() == [b"0: bcdefghi"]  # a line past the chunk size comes in pieces
    assert tail.read() == [b"jk"] and not tail.more and tail.read(final=True) == [b"1: c"]
    fifo = tmp_path / "fifo.out"
    os.mkfifo(fifo)
    for special in (fifo, Path("/dev/zero")):
        with pytest.raises(UserError, match="is not a regular file"):
            logs.Tail(special).read()
        with pytest.raises(UserError, match="is not a regular file"):
            logs.check_labels(logs.JobLogs([special], labelled=True), rank=0)


def test_log_paths_fill_in_job_and_array_ids() -> None:
    assert logs.expand_job_id("/l/x-%j.out", "42") == Path("/l/x-42.out")
    assert logs.expand_job_id("/l/x-%A_%a.out", "55_2") == Path("/l/x-55_2.out")


def fake_commands(directory: Path, monkeypatch: pytest.MonkeyPatch, bodies: dict[str, str]) -> None:
    """Put a shell script for each named command first on PATH, with the body given."""
    directory.mkdir()
    for name, body in bodies.items():
        script = directory / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


def fake_slurm(directory: Path, monkeypatch: pytest.MonkeyPatch, scancel_stderr: str) -> None:
    """squeue lists two steps of job 77; scancel fails for each with ``scancel_stderr``. Only the
    handling of a failed scancel is under test here: the real cluster tests signal real steps."""
    bodies = {"squeue": "printf '77.batch\\n77.0\\n77.1\\n'", "scancel": f"echo '{scancel_stderr}' >&2; exit 1"}
    fake_commands(directory, monkeypatch, bodies)


def test_signalling_a_job_whose_steps_all_refuse_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    denied = "scancel: error: Kill job error on job id 77.0: Access/permission denied"
    fake_slurm(tmp_path / "bin", monkeypatch, denied)
    with pytest.raises(UserError) as refused:
        queue.signal_steps("77", "TERM")
    message = str(refused.value)
    assert message.startswith(f"scancel --signal=TERM could not signal job 77: {denied}\n")
    assert "fix: check the job id with squeue --me" in message


def test_signalling_steps_that_ended_meanwhile_is_no_error(tmp_path: Path, monkeypatch) -> None:
    fake_slurm(
        tmp_path / "bin", monkeypatch, "scancel: error: Kill job error on job id 77.0: Job/step already completing or completed"
    )
    assert queue.signal_steps("77", "TERM") == ["77.0", "77.1"]  # the job is ending: the caller waits for it


def test_cancel_now_cancels_only_once_slurm_shows_the_job_paused(tmp_path: Path, monkeypatch) -> None:
    """SLURM records a pause (STOPPED) when the node answers it; an answer after the cancel would
    overwrite CANCELLED, and the job would show STOPPED for good. scontrol here answers RUNNING
    twice, then STOPPED: the steps and the job are cancelled only after that."""
    calls = tmp_path / "calls"
    scontrol = (
        f'echo scontrol >> {calls}; n=$(grep -c scontrol {calls}); state=RUNNING; [ "$n" -ge 3 ] && state=STOPPED\n'
        'echo "JobId=77 JobName=x JobState=$state Reason=None"'
    )
    bodies = {
        "squeue": f"echo squeue >> {calls}; printf '77.batch\\n77.0\\n'",
        "scancel": f'echo "scancel $*" >> {calls}',
        "scontrol": scontrol,
    }
    fake_commands(tmp_path / "bin", monkeypatch, bodies)
    queue.kill_now("77")
    assert calls.read_text().splitlines() == [
        "scancel --batch --signal=STOP 77",
        *["scontrol"] * 3,
        "squeue",
        "scancel 77.0",
        "scancel 77",
    ]


# ---- the real cluster --------------------------------------------------------------------------


def environ(cluster: SlurmCluster) -> dict[str, str]:
    # A port of our own for the jobs submitted with it: the one derived from the job id is the same
    # for job 1 of every test cluster on this machine.
    return {**os.environ, **cluster.env, "PYTHONPATH": str(REPO_ROOT), "MASTER_PORT": str(free_port())}


def lance_hpc(cluster: SlurmCluster, *args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run the real command line, as a user on the login node would, in this module's environment."""
    return run_lance_hpc(cluster, *args, check_rc=check_rc, env=environ(cluster))


def long_job(directory: Path, dataset: Digits, cluster: SlurmCluster, name: str) -> tuple[Path, JobSpec]:
    """2 ranks on one node for 100 epochs (it only ends when cancelled); every step logged."""
    slurm = {
        "partition": cluster.partition,
        "nodes": 1,
        "tasks_per_node": 2,
        "cpus_per_task": 1,
        "time": "00:15:00",
        "max_requeues": 2,
        "log_dir": str(directory / "logs"),
    }
    path = write_spec(
        directory,
        dataset,
        name=name,
        slurm=slurm,
        train={"epochs": 100},
        logging={"log_every_steps": 1, "progress": False},
        checkpoint={"every_steps": 1000},
    )
    return path, load_spec(path).spec


def wait_for(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def logged_step(spec: JobSpec) -> int:
    return progress.last_logged(spec.logging.tensorboard_dir).step or 0


def steps_per_epoch(spec: JobSpec) -> int:
    """What the trainer's loader takes per epoch on each of the job's ranks."""
    task = load_task(spec)
    return build_train_loader(spec.data, task.decoder(train=True), 0, spec.slurm.world_size).steps_per_epoch


def sbatch(cluster: SlurmCluster, spec: JobSpec) -> str:
    """Render the job and submit it with the user's own sbatch (no record: found by name and log)."""
    _, script = write_job_files(spec)
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=environ(cluster), cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return submitted.stdout.strip().split(";")[0]


def scancel_quietly(cluster: SlurmCluster, job_id: str) -> None:
    subprocess.run(["scancel", job_id], env=environ(cluster), capture_output=True)


@pytest.mark.slow
@pytest.mark.slurm
def test_status_logs_and_cancel_an_sbatch_job(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    spec_path, spec = long_job(tmp_path, digits, slurm_cluster, "watched")
    job_id = sbatch(slurm_cluster, spec)  # --render-only, then the user's own sbatch: no record, found by name/log
    try:
        wait_for(lambda: logged_step(spec) >= 3, "the third logged step")
        status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
        assert re.search(rf"job {job_id} \(watched\): RUNNING for \S+ of 00:15:00 on node\d, restarts 0", status), status
        step = int(re.search(r"last log +step (\d+): loss [0-9.]+, [0-9,.]+ samples/s", status).group(1))
        assert step >= 3
        total = 100 * steps_per_epoch(spec)
        assert re.search(rf"time left +about .+: step {step} of {total}, {total - step} steps x", status), status
        by_id = lance_hpc(slurm_cluster, "status", job_id).stdout
        assert f"job {job_id} (watched): RUNNING" in by_id and "last log    step" in by_id, by_id

        out = lance_hpc(slurm_cluster, "logs", str(spec_path), "--stdout").stdout
        assert f"job {job_id} (restart 0)" in out and "0: step 1/" in out
        rank0 = lance_hpc(slurm_cluster, "logs", str(spec_path), "--rank", "0", "--stdout").stdout.splitlines()
        assert rank0 and not [line for line in rank0 if re.match(r"\s*\d+: ", line)], "\n".join(rank0[-40:])
        assert any(line.startswith("step 1/") for line in rank0), rank0
        assert "step 1/" not in lance_hpc(slurm_cluster, "logs", job_id, "--rank", "1").stdout  # rank 0 logs steps

        follower = subprocess.Popen(
            [sys.executable, "-m", "lance_hpc", "logs", str(spec_path), "-f", "--rank", "0", "--stdout"],
            env=environ(slurm_cluster),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        cancelled = lance_hpc(slurm_cluster, "cancel", str(spec_path), "--timeout", "200").stdout
        followed, _ = follower.communicate(timeout=120)  # -f ends by itself once the job has ended
    finally:
        scancel_quietly(slurm_cluster, job_id)
    assert follower.returncode == 0
    stopped_at = int(re.search(r"stopped at step (\d+) by SIGTERM", cancelled).group(1))
    saved = resuming.load_latest(open_store(spec.checkpoint.dir))
    assert saved is not None and saved.step == stopped_at >= step
    assert "SIGTERM to its tasks" in cancelled and f"checkpoint step {stopped_at}: {saved.path}" in cancelled
    assert f"continue with: lance-hpc submit {spec_path}" in cancelled
    assert "\nstep 1/" in f"\n{followed}" and f"stopped at step {stopped_at} by SIGTERM" in followed

    after = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
    # rank 0 exits 3 once saved; srun's --kill-on-bad-exit may end a rank still exiting with SIGTERM
    assert re.search(
        rf"job {job_id} \(watched\): FAILED, exit (3 \(stopped by a signal, checkpoint saved\)|"
        r"143 \(a task ended by SIGTERM\)), restarts 0",
        after,
    ), after
    assert f"ended       stopped at step {stopped_at} by SIGTERM" in after
    # epochs counted from 1, as the progress bar counts them: the one the stop came in
    assert f"checkpoint  step {stopped_at}, epoch {math.ceil(stopped_at / steps_per_epoch(spec))}:" in after
    assert "time left" not in after
    recorded = records.read_records(spec)[job_id]
    assert recorded["state"] == "FAILED" and recorded["exit_code"] in ("3:0", "143:0")
    assert lance_hpc(slurm_cluster, "cancel", job_id).stdout.startswith(f"job {job_id} already ended: FAILED")


@pytest.mark.slow
@pytest.mark.slurm
def test_cancel_a_submitit_job_saves_through_submitits_protocol(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    spec_path, spec = long_job(tmp_path, digits, slurm_cluster, "viasubmitit")
    submitted = lance_hpc(slurm_cluster, "submit", str(spec_path)).stdout
    job_id = re.search(r"submitted job (\d+)", submitted).group(1)
    try:
        assert list(records.read_records(spec)) == [job_id]
        wait_for(lambda: logged_step(spec) >= 2, "the second logged step")
        assert "RUNNING" in lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
        rank1 = lance_hpc(slurm_cluster, "logs", str(spec_path), "--rank", "1").stdout
        assert f"{job_id}_1_log." in rank1 and f"{job_id}_0_log." not in rank1  # task 1's own files
        cancelled = lance_hpc(slurm_cluster, "cancel", str(spec_path), "--timeout", "200").stdout
    finally:
        scancel_quietly(slurm_cluster, job_id)
    assert "SIGUSR2 to its tasks" in cancelled
    stopped_at = int(re.search(r"stopped at step (\d+) by SIGUSR2", cancelled).group(1))
    saved = resuming.load_latest(open_store(spec.checkpoint.dir))
    assert saved is not None and saved.step == stopped_at and f"checkpoint step {stopped_at}" in cancelled
    after = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
    assert f"job {job_id} (viasubmitit): CANCELLED" in after and f"checkpoint  step {stopped_at}" in after, after


@pytest.mark.slow
@pytest.mark.slurm
def test_a_job_slurm_forgot_is_reported_from_records_and_log(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    spec_path, spec = long_job(tmp_path, digits, slurm_cluster, "forgotten")
    log_dir = Path(spec.slurm.log_dir)
    log_dir.mkdir(parents=True)
    (log_dir / "forgotten-987654.out").write_text(
        "job 987654 (restart 0) on node1: 2 tasks\n0: step 7/4500: train/loss 2.1\n"
        f"0: stopped at step 7 by SIGTERM; checkpoint {spec.checkpoint.dir}/step-00000007.pt; not requeued: ...\n"
    )
    (log_dir / "jobs.jsonl").write_text(json.dumps({"job_id": "987654", "state": "FAILED", "exit_code": "3:0"}) + "\n")
    status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
    assert "job 987654 (forgotten): gone from SLURM; it ended FAILED with exit code 3:0" in status, status
    assert "ended       stopped at step 7 by SIGTERM" in status and "checkpoint  none yet" in status
    assert "0: step 7/4500" in lance_hpc(slurm_cluster, "logs", str(spec_path)).stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_is_reported_run_by_run_with_each_runs_own_checkpoints(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    slurm = {"partition": slurm_cluster.partition, "log_dir": str(tmp_path / "logs")}
    spec_path = write_spec(tmp_path, digits, name="swept", slurm=slurm, sweep={"train.lr": [0.01, 0.003]})
    spec = load_spec(spec_path).spec
    runs = expand(spec)
    records.record_submission(spec, "987600", via="submitit")  # an array SLURM has since forgotten
    records.record_submission(spec, "987610", via="submitit")  # and the later resubmission
    (Path(spec.slurm.log_dir) / "swept-987610_1.out").write_text("job 987610 (restart 0)\n0: training finished after 5 steps\n")
    status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
    headlines = [line for line in status.splitlines() if line.startswith("job ")]
    assert headlines == [
        f"job 987610_{run.index} ({run.spec.name}): gone from SLURM (it forgot the job: no accounting, "
        "or long ended), final state not recorded"
        for run in runs
    ], status
    assert f"checkpoint  none yet in {runs[1].spec.checkpoint.dir}" in status and "ended       finished after 5 steps" in status
    assert f"spec        {spec_path} (run 1: train.lr=0.003)" in status
    everything = lance_hpc(slurm_cluster, "status", str(spec_path), "--all").stdout
    assert [line.split(" (")[0] for line in everything.splitlines() if line.startswith("job ")] == [
        "job 987600_0",
        "job 987600_1",
        "job 987610_0",
        "job 987610_1",
    ]
    one = lance_hpc(slurm_cluster, "logs", str(spec_path), "--job", "987610_1", "--stdout").stdout
    assert one == "job 987610 (restart 0)\n0: training finished after 5 steps\n"


@pytest.mark.slow
@pytest.mark.slurm
def test_unknown_jobs_unsubmitted_specs_and_missing_slurm_are_clear_errors(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    unknown = lance_hpc(slurm_cluster, "status", "987655", check_rc=2).stderr
    assert "SLURM does not know job 987655" in unknown and "fix:" in unknown and "Traceback" not in unknown
    spec_path, _ = long_job(tmp_path, digits, slurm_cluster, "neversubmitted")
    for command in ("status", "logs", "cancel"):
        never = lance_hpc(slurm_cluster, command, str(spec_path), check_rc=2).stderr
        assert "has no SLURM job that lance_hpc can find" in never and f"lance-hpc submit {spec_path}" in never
    no_slurm = {**environ(slurm_cluster), "PATH": str(Path(sys.executable).parent / "no-slurm-here")}
    result = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "cancel", "12"], env=no_slurm, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "scancel not found on PATH" in result.stderr, result.stderr


def slurm_job(cluster: SlurmCluster, job_id: str) -> queue.SlurmJob | None:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=environ(cluster), capture_output=True, text=True)
    jobs = [queue.job_from_scontrol(fields) for fields in queue.parse_scontrol(shown.stdout)]
    return jobs[0] if jobs else None


def end_state(cluster: SlurmCluster, job_id: str) -> str:
    """The job's state once it has ended; its ranks are gone by then (COMPLETING is no end). Past
    the wait, fail with what SLURM says of the job, its steps, its log and the nodes' logs."""
    try:
        wait_for(lambda: getattr(slurm_job(cluster, job_id), "ended", False), f"the end of job {job_id}", timeout_s=120)
    except AssertionError as late:
        fields = job_fields(cluster, job_id)
        shown = {key: fields.get(key) for key in ("JobState", "Reason", "NodeList", "BatchHost", "ExitCode")}
        steps = cluster.run("squeue", "--steps", "--jobs", job_id, check=False).stdout
        daemons = log_hint(cluster, lines_each=15)
        raise AssertionError(f"{late}: {shown}\nsteps:\n{steps}\n{job_log(cluster, job_id)}\n{daemons}") from None
    return slurm_job(cluster, job_id).state


def follow(cluster: SlurmCluster, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """``lance-hpc logs ARGS -f`` in the background, its lines gathered as they come (a reader
    thread, so the pipe never fills while the test waits for something else)."""
    follower = subprocess.Popen(
        [sys.executable, "-m", "lance_hpc", "logs", *args, "-f"],
        env=environ(cluster),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def gather() -> None:
        for line in follower.stdout:
            lines.append(line)

    threading.Thread(target=gather, daemon=True).start()
    return follower, lines


@pytest.mark.slow
@pytest.mark.slurm
def test_logs_follow_a_job_through_its_requeue_until_it_ends(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    """Each run takes both nodes whole (1 rank on each), so the requeued run starts only once the
    old one is gone (see test_four_run_sweep_on_the_cluster_each_run_on_its_own)."""
    slurm = {
        "partition": slurm_cluster.partition,
        "nodes": 2,
        "tasks_per_node": 1,
        "cpus_per_task": 1,
        "exclusive": True,
        "time": "00:15:00",
        "max_requeues": 2,
        "log_dir": str(tmp_path / "logs"),
    }
    spec_path = write_spec(
        tmp_path,
        digits,
        name="followed",
        slurm=slurm,
        train={"epochs": 100},
        logging={"log_every_steps": 1, "progress": False},
        checkpoint={"every_steps": 1000},
    )
    spec = load_spec(spec_path).spec
    job_id = sbatch(slurm_cluster, spec)
    follower, lines = follow(slurm_cluster, str(spec_path), "--stdout")  # most likely before the job starts
    try:
        wait_for(lambda: "0: step 2/" in "".join(lines), "the second step, followed")
        signal_steps(environ(slurm_cluster), job_id)
        wait_for(lambda: "by SIGUSR2" in "".join(lines), "the stop on USR2, followed")
        stopped_at = int(re.search(r"stopped at step (\d+) by SIGUSR2", "".join(lines)).group(1))
        wait_for(lambda: f"0: step {stopped_at + 1}/" in "".join(lines), "the restarted run's first step, followed")
        scancel_quietly(slurm_cluster, job_id)
        follower.wait(timeout=60)  # -f notices the end within seconds
    finally:
        scancel_quietly(slurm_cluster, job_id)
        if follower.poll() is None:
            follower.kill()
    followed = "".join(lines)
    out = Path(spec.slurm.log_dir) / f"followed-{job_id}.out"
    assert follower.returncode == 0 and followed == out.read_text()  # all of both runs, each line once
    assert f"job {job_id} (restart 0)" in followed and f"requeued job {job_id} (requeue 1 of at most 2)" in followed
    assert f"job {job_id} (restart 1)" in followed
    restarted = followed.split(f"job {job_id} (restart 1)")[1]
    assert f"resuming from {spec.checkpoint.dir}/step-{stopped_at:08d}.pt at step {stopped_at}" in restarted, followed
    status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
    assert re.search(rf"job {job_id} \(followed\): .*, restarts [1-9]", status), status


@pytest.mark.slow
@pytest.mark.slurm
def test_cancel_now_ends_a_running_job_without_saving(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    """Plain scancel would give the ranks SIGTERM and KillWait seconds, in which they save; --now
    must not. The job saves at every epoch end (an epoch takes seconds here), never mid-epoch."""
    spec_path, spec = long_job(tmp_path, digits, slurm_cluster, "cutshort")
    job_id = sbatch(slurm_cluster, spec)
    out = Path(spec.slurm.log_dir) / f"cutshort-{job_id}.out"
    try:
        wait_for(lambda: out.exists() and "0: step 2/" in out.read_text(), "the second step")
        cancelled = lance_hpc(slurm_cluster, "cancel", str(spec_path), "--now").stdout
        state = end_state(slurm_cluster, job_id)
    finally:
        scancel_quietly(slurm_cluster, job_id)
    assert cancelled == f"cancelled job {job_id}\n" and state == "CANCELLED"
    log = lance_hpc(slurm_cluster, "logs", job_id).stdout
    assert "stopped at step" not in log and re.search(r"srun: error: \S+: tasks? [0-9-]+: Killed", log), log
    saved = resuming.load_latest(open_store(spec.checkpoint.dir))
    assert saved is None or not saved.state["mid_epoch"], f"saved at step {saved.step} on the way out"


@pytest.mark.slow
@pytest.mark.slurm
def test_cancel_a_pending_job_removes_it_at_once(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    slurm = {"partition": slurm_cluster.partition, "log_dir": str(tmp_path / "logs"), "extra_flags": {"begin": "now+1hour"}}
    spec_path = write_spec(tmp_path, digits, name="later", slurm=slurm)
    submitted = lance_hpc(slurm_cluster, "submit", str(spec_path)).stdout
    job_id = re.search(r"submitted job (\d+)", submitted).group(1)
    try:
        status = lance_hpc(slurm_cluster, "status", str(spec_path)).stdout
        waiting = lance_hpc(slurm_cluster, "logs", str(spec_path)).stderr
        cancelled = lance_hpc(slurm_cluster, "cancel", str(spec_path)).stdout
        state = end_state(slurm_cluster, job_id)
    finally:
        scancel_quietly(slurm_cluster, job_id)
    assert f"job {job_id} (later): PENDING (BeginTime)" in status, status
    assert f"job {job_id} has not started (PENDING, BeginTime)" in waiting, waiting
    assert cancelled == f"cancelled job {job_id} (it was PENDING, so there was nothing to save)\n"
    assert state == "CANCELLED"
