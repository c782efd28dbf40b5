"""USR1 (a profiler trace, ``scancel --signal=USR1``) never ends a job: training takes it as a
profile request, every other kind says once that it ignores it, and the DataLoader workers ignore
it too. The watchdog signals a DataLoader worker only while the process its pid file names (pid and
start time) still runs, and forgets the pid files an earlier attempt left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import yaml

from lance_hpc.runtime import preemption
from lance_hpc.runtime.preemption import hold, ignore_profile_requests
from lance_hpc.runtime.profile import StepProfiler
from lance_hpc.runtime.watchdog import Progress, Watchdog
from lance_hpc.signals import PROFILE_SIGNAL, WORKER_DUMP_SIGNAL, start_time
from lance_hpc.spec import load_spec
from tests.support.jobs import BASE_SPEC, REPO_ROOT, write_spec
from tests.support.ranks import launch, rank_pid, read_until

IGNORED = "USR1 ignored"
_announced = False


def slow_twice(model: None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Twice each row's label, a third of a second per batch; says when its rank reads its first
    batch, so that the test can signal the job while it runs."""
    global _announced
    if not _announced:
        _announced = True
        print(f"rank {os.environ.get('RANK')} reads its rows", flush=True)
    time.sleep(0.3)
    return {"twice": batch["label"] * 2}


@pytest.fixture
def usr1_restored() -> Iterator[None]:
    """This process's USR1 handler and held signals as they were before the test."""
    previous, held = signal.getsignal(PROFILE_SIGNAL), list(preemption.received)
    yield
    signal.signal(PROFILE_SIGNAL, previous)
    preemption.received[:] = held


@pytest.mark.parametrize("kind", ["ingest", "infer", "evaluate"])
def test_a_job_kind_without_steps_to_profile_survives_usr1_and_says_so_on_rank_0(kind: str, usr1_restored, capfd) -> None:
    hold()  # as python -m lance_hpc.run does on its first line
    signal.raise_signal(PROFILE_SIGNAL)  # while the rank still starts
    ignore_profile_requests(kind, 0)
    signal.raise_signal(PROFILE_SIGNAL)  # while the kind runs
    said = capfd.readouterr().err
    assert said.count(IGNORED) == 2 and f"job: {kind}" in said, said
    ignore_profile_requests(kind, 1)
    signal.raise_signal(PROFILE_SIGNAL)
    assert IGNORED not in capfd.readouterr().err  # one line for the job: rank 0's


def test_usr1_held_while_a_training_rank_starts_becomes_its_profile_request(tmp_path: Path, digits, usr1_restored) -> None:
    hold()
    signal.raise_signal(PROFILE_SIGNAL)
    spec = load_spec(write_spec(tmp_path, digits)).spec
    profiler = StepProfiler(spec.train, spec.logging, 0, torch.device("cpu"))
    profiler.listen()
    assert profiler.requested, "a USR1 that came before the profiler listened was lost"


@pytest.mark.slow
def test_a_local_infer_job_signalled_usr1_in_every_process_mid_run_completes(tmp_path: Path, digits) -> None:
    uri = tmp_path / "val.lance"
    shutil.copytree(digits.val, uri)
    raw = {
        "name": "usr1_infer",
        "job": "infer",
        "slurm": {"tasks_per_node": 2, "log_dir": str(tmp_path / "logs")},
        "data": {"uri": str(uri), "batch_size": 16, "num_workers": 1},  # a DataLoader worker to signal too
        "task": BASE_SPEC["task"],
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"tensorboard_dir": str(tmp_path / "runs"), "progress": False},
        "infer": {"function": "tests.test_signals:slow_twice", "outputs": {"twice": "int64"}},
    }
    spec = tmp_path / "infer.yaml"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    launcher = launch(spec)
    try:
        os.kill(first_handler(launcher, 0), PROFILE_SIGNAL)  # while rank 0 still starts (imports torch)
        output = read_until(launcher, "rank 0 reads its rows")
        # as scancel --signal=USR1 does: every process of the job, the ranks' workers too (each
        # local rank leads its own process group, which holds its worker server and workers)
        for rank in (0, 1):
            os.killpg(rank_pid(launcher, rank), PROFILE_SIGNAL)
        output += launcher.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=60)
    assert launcher.returncode == 0, output
    assert output.count(IGNORED) == 2 and "job: infer" in output, output  # rank 0's, held and mid-run
    assert "committed:" in output, output


def first_handler(launcher: subprocess.Popen, rank: int, timeout_s: float = 60) -> int:
    """The pid of local rank ``rank`` once it has a handler for USR1 (its /proc SigCgt mask shows
    it), which must be before it loads torch: it holds USR1 from its first line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = rank_pid(launcher, rank)
            caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
            loaded = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except (AssertionError, OSError):
            time.sleep(0.01)
            continue
        held = bool(int(caught.split()[1], 16) >> (PROFILE_SIGNAL - 1) & 1)
        assert held or not loaded, f"rank {rank} loaded torch before it held USR1"
        if held:
            return pid
        time.sleep(0.005)
    raise AssertionError(f"rank {rank} never caught USR1 within {timeout_s} s")


def sleeper() -> subprocess.Popen:
    """A child process of this one, as a DataLoader worker is of its rank; WORKER_DUMP_SIGNAL's
    default action ends it, so being signalled shows in its exit status."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_the_watchdog_signals_a_worker_only_while_its_pid_and_start_time_still_match(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    child = sleeper()
    try:
        started = start_time(child.pid)
        assert started is not None
        # an earlier attempt's worker whose pid this child now has: another start time
        stale = stacks / f"rank-0-worker-0-{child.pid}.pid"
        stale.write_text(f"{child.pid} {started - 1}")
        other_rank = stacks / "rank-1-worker-0-7.pid"
        other_rank.write_text(f"{child.pid} {started - 1}")
        watchdog = Watchdog(Progress(), tmp_path, 0, 1, factor=5, floor_s=1, ceiling_s=10)
        assert not stale.exists(), "a pid file of an earlier attempt was kept at start"
        assert other_rank.exists(), "a rank forgets only its own workers"
        stale.write_text(f"{child.pid} {started - 1}")  # reused while the job runs
        watchdog.dump_stacks()
        assert child.poll() is None, "a process that only reuses a worker's pid was signalled"
        assert not stale.exists() and "DataLoader worker" not in (stacks / "rank-0.txt").read_text()

        current = stacks / f"rank-0-worker-1-{child.pid}.pid"
        current.write_text(f"{child.pid} {started}")
        watchdog.dump_stacks()
        assert child.wait(timeout=30) == -WORKER_DUMP_SIGNAL, "the worker itself was not signalled"
        assert f"DataLoader worker (pid {child.pid})" in (stacks / "rank-0.txt").read_text()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_worker_records_its_pid_with_its_start_time(tmp_path: Path, monkeypatch) -> None:
    import faulthandler

    from lance_hpc.signals import init_worker_dumps

    monkeypatch.setenv("RANK", "0")
    try:
        init_worker_dumps(3, str(tmp_path))
    finally:
        faulthandler.unregister(WORKER_DUMP_SIGNAL)
    (pid_file,) = (tmp_path / "stacks").glob("rank-0-worker-3-*.pid")
    assert pid_file.read_text() == f"{os.getpid()} {start_time(os.getpid())}"


@pytest.mark.parametrize("entry", [["lance_hpc", "ingest"], ["lance_hpc.ingest"]], ids=["lance-hpc", "python-m-shim"])
def test_lance_hpc_ingest_run_by_hand_survives_usr1(tmp_path: Path, entry: list[str]) -> None:
    """The command itself (not only its workers and a job's ranks), as lance-hpc or its python -m
    shim: USR1 sent to it while it writes leaves it running to the end."""
    command = [sys.executable, "-m", *entry, "sklearn-digits", str(tmp_path / "train.lance")]
    command += ["--val-uri", str(tmp_path / "val.lance")]
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=environ)
    deadline = time.monotonic() + 120
    while process.poll() is None and not (tmp_path / "val.lance").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = 0
    for _ in range(3):
        if process.poll() is None:
            process.send_signal(signal.SIGUSR1)
            sent += 1
    output = process.communicate(timeout=300)[0]
    assert sent, f"the ingest ended before it could be signalled:\n{output}"
    assert process.returncode == 0, output
    assert (tmp_path / "train.lance").exists()
