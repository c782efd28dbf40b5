"""Resuming on another world size, and Ctrl-C on a local run, with real local gloo ranks.

A run stopped mid-epoch on 2 ranks finishes on 3: the rows the first run trained on are not read
again, the rest of the epoch is read exactly once, every rank takes the same steps, and progress
continues in samples, the learning rate's warmup and decay with it. An epoch-end checkpoint
resumes on another world size with more epochs.
Ctrl-C saves and stops with one line and exit 3 (the rerun continues); a second Ctrl-C stops at
once and leaves no process behind.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lance_hpc.errors import ExitCode
from lance_hpc.loading.sampling import epoch_batches, fragment_table
from lance_hpc.runtime.trainer import lr_factor
from lance_hpc.spec import load_spec
from lance_hpc.storage.datasets import open_dataset
from tests.support.jobs import REPO_ROOT, final_state, logged_rows, planned_rows, scalars, write_spec
from tests.support.ranks import rank_pid, read_until

pytestmark = pytest.mark.slow


def row_logging_spec(directory: Path, dataset, row_log: Path, **sections) -> Path:
    """The digits with a task that logs the rows every rank trains on, under ``row_log``."""
    row_log.mkdir(parents=True, exist_ok=True)
    task = {"name": "tests.custom_task:RowLoggingMLP", "options": {"hidden": 16, "row_log": str(row_log)}}
    return write_spec(directory, dataset, task=task, **sections)


def submit_local(spec_file: Path, nproc: int) -> subprocess.Popen:
    """``python -m lance_hpc.submit SPEC --local --nproc N`` as a terminal runs it: in a process
    group of its own (the terminal's foreground group), stdout and stderr piped together."""
    return subprocess.Popen(
        [sys.executable, "-m", "lance_hpc.submit", str(spec_file), "--local", "--nproc", str(nproc)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


@pytest.mark.parametrize("style,sampler", [("map", "distributed"), ("iterable", "sharded_fragment")])
def test_stopped_on_two_ranks_mid_epoch_finishes_on_three_reading_every_row_once(
    tmp_path: Path, digits, style: str, sampler: str
) -> None:
    sections = dict(
        data={"style": style, "sampler": sampler, "num_workers": 1},
        train={"epochs": 2, "lr": 0.01},
        logging={"log_every_steps": 1, "progress": False},
    )
    spec_file = row_logging_spec(tmp_path, digits, tmp_path / "rows2", **sections)
    spec = load_spec(spec_file).spec
    steps_per_epoch = sum(
        1
        for _ in epoch_batches(
            fragment_table(open_dataset(spec.data.uri, None, {})), sampler, 0, 2, spec.data.batch_size, uneven=spec.data.uneven
        )
    )
    first = submit_local(spec_file, 2)
    read_until(first, f"step {steps_per_epoch + 4}/")  # early in epoch 2 of 2
    first.send_signal(signal.SIGUSR2)
    output = first.communicate(timeout=120)[0]
    assert first.returncode == ExitCode.STOPPED, output
    stopped = final_state(tmp_path)
    assert stopped["mid_epoch"] and stopped["epoch"] == 1 and stopped["world_size"] == 2

    spec_file = row_logging_spec(tmp_path, digits, tmp_path / "rows3", **sections)
    second = submit_local(spec_file, 3)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output
    assert f"at step {stopped['step']}, epoch 2" in output and "written by 2 ranks, continued by 3" in output

    before, after = logged_rows(tmp_path / "rows2", 2), logged_rows(tmp_path / "rows3", 3)
    epoch_one = collections.Counter(row for batches in before for batch in batches[:steps_per_epoch] for row in batch)
    assert epoch_one == planned_rows(spec, 2, epoch=0)
    assert len({len(batches) for batches in after}) == 1  # equal steps on the three ranks
    epoch_two = collections.Counter(row for batches in before for batch in batches[steps_per_epoch:] for row in batch)
    epoch_two.update(row for batches in after for batch in batches for row in batch)
    assert epoch_two == planned_rows(spec, 2, epoch=1)  # the rest read once: none twice, none skipped
    final = final_state(tmp_path)
    assert final["epoch"] == 2 and final["progress"] == 2.0 and final["step"] == stopped["step"] + len(after[0])


def test_the_learning_rate_follows_the_rows_read_across_a_resume_on_three_ranks(tmp_path: Path, digits) -> None:
    """Warmup (80% of the one epoch) and cosine decay: the 2-rank run stops in the warmup, the
    3-rank run finishes it and decays to the end of the epoch. Every logged train/lr is the
    schedule at the rows all ranks trained on before that step (counted from the rows logged), at
    the new world size's peak (linear scaling), not at its step count read as 3-rank steps."""
    train = {"epochs": 1, "warmup_epochs": 0.8, "lr": 0.003, "lr_scaling": "linear", "base_batch_size": 32}
    sections = dict(train=train, logging={"log_every_steps": 1, "progress": False})
    first = submit_local(row_logging_spec(tmp_path, digits, tmp_path / "rows2", **sections), 2)
    read_until(first, "step 5/")
    first.send_signal(signal.SIGUSR2)
    output = first.communicate(timeout=120)[0]
    assert first.returncode == ExitCode.STOPPED, output
    stopped = final_state(tmp_path)
    assert stopped["mid_epoch"] and stopped["epoch"] == 0
    spec_file = row_logging_spec(tmp_path, digits, tmp_path / "rows3", **sections)
    second = submit_local(spec_file, 3)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0 and "written by 2 ranks, continued by 3" in output, output

    spec = load_spec(spec_file).spec
    table = fragment_table(open_dataset(spec.data.uri, None, {}))
    epoch_rows = sum(planned_rows(spec, 2, epoch=0).values())
    peaks = {world_size: train["lr"] * spec.data.batch_size * world_size / train["base_batch_size"] for world_size in (2, 3)}
    expected: dict[int, float] = {}  # step -> the learning rate it should have trained at
    rows_before = 0
    for world_size, row_log, first_step in ((2, "rows2", 1), (3, "rows3", stopped["step"] + 1)):
        steps_per_epoch = sum(1 for _ in epoch_batches(table, spec.data.sampler, 0, world_size, spec.data.batch_size))
        for index, batches in enumerate(zip(*logged_rows(tmp_path / row_log, world_size))):
            epochs_read = rows_before / epoch_rows
            expected[first_step + index] = peaks[world_size] * lr_factor(
                epochs_read * steps_per_epoch, train["warmup_epochs"] * steps_per_epoch, steps_per_epoch
            )
            rows_before += sum(len(batch) for batch in batches)
    assert rows_before == epoch_rows and max(expected) == final_state(tmp_path)["step"]
    resumed = [expected[step] for step in sorted(expected) if step > stopped["step"]]
    assert max(resumed) == pytest.approx(peaks[3], rel=0.05) and resumed[-1] < peaks[3] / 4  # the peak, then the decay
    del expected[stopped["step"]]  # the resumed run hides its predecessor's events from the checkpoint's step on
    logged = dict(scalars(tmp_path / "runs")["train/lr"])
    assert logged == pytest.approx(expected, rel=1e-5)
    assert max(logged.values()) <= peaks[3] * (1 + 1e-6)  # a fractional last warmup step does not overshoot it
    final = final_state(tmp_path)
    assert final["epoch"] == 1 and final["progress"] == 1.0 and "final validation accuracy" in output


def test_an_epoch_end_checkpoint_resumes_on_three_ranks_with_more_epochs(tmp_path: Path, digits) -> None:
    """The 2-rank run ends after one epoch; rerun with 3 ranks and train.epochs=2, it reads exactly
    one more epoch, planned for 3 ranks, instead of reading the step count as 3-rank epochs."""
    spec_file = row_logging_spec(tmp_path, digits, tmp_path / "rows2", train={"epochs": 1})
    assert submit_local(spec_file, 2).wait(timeout=300) == 0
    saved = final_state(tmp_path)
    spec_file = row_logging_spec(tmp_path, digits, tmp_path / "rows3", train={"epochs": 2})
    second = submit_local(spec_file, 3)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output
    assert "resuming from" in output and f"at step {saved['step']}, epoch 2" in output
    after = logged_rows(tmp_path / "rows3", 3)
    read = collections.Counter(row for batches in after for batch in batches for row in batch)
    assert read == planned_rows(load_spec(spec_file).spec, 3, epoch=1)
    final = final_state(tmp_path)
    assert final["epoch"] == 2 and final["step"] == saved["step"] + len(after[0])


def test_script_mode_stopped_on_two_ranks_finishes_on_three(tmp_path: Path, digits) -> None:
    """examples/script_mode (its own loop over ctx.steps) stopped mid-epoch on 2 ranks, rerun on 3."""
    spec_file = write_spec(
        tmp_path,
        digits,
        entry=f"{REPO_ROOT}/examples/script_mode/train.py:main",
        train={"epochs": 3},
        logging={"log_every_steps": 1, "progress": False},
    )
    spec = load_spec(spec_file).spec
    steps_per_epoch = sum(
        1 for _ in epoch_batches(fragment_table(open_dataset(spec.data.uri, None, {})), "distributed", 0, 2, spec.data.batch_size)
    )
    first = submit_local(spec_file, 2)
    read_until(first, f"step {steps_per_epoch + 4}/")
    first.send_signal(signal.SIGUSR2)
    output = first.communicate(timeout=120)[0]
    assert first.returncode == ExitCode.STOPPED, output
    stopped = final_state(tmp_path)
    assert stopped["mid_epoch"] and stopped["epoch"] == 1 and 0 < stopped["progress"] - 1 < 1
    second = submit_local(spec_file, 3)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0 and "written by 2 ranks, continued by 3" in output, output
    assert "final validation accuracy" in output
    final = final_state(tmp_path)
    assert final["epoch"] == 3 and final["progress"] == 3.0 and final["world_size"] == 3


def test_ctrl_c_saves_stops_with_one_line_and_the_rerun_continues(tmp_path: Path, digits) -> None:
    spec_file = write_spec(
        tmp_path, digits, data={"num_workers": 1}, train={"epochs": 50}, logging={"log_every_steps": 1, "progress": False}
    )
    run = submit_local(spec_file, 2)
    read_until(run, "step 4/")
    os.killpg(run.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    output = run.communicate(timeout=120)[0]
    assert run.returncode == ExitCode.STOPPED, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    saved = final_state(tmp_path)
    assert f"interrupted at step {saved['step']}, checkpoint saved" in output
    assert "run the same command again to continue" in output and saved["step"] >= 4

    rerun = submit_local(spec_file, 2)
    read_until(rerun, "resuming from")
    os.killpg(rerun.pid, signal.SIGINT)
    output = rerun.communicate(timeout=120)[0]
    assert rerun.returncode == ExitCode.STOPPED and final_state(tmp_path)["step"] > saved["step"], output


def test_a_second_ctrl_c_stops_at_once_and_leaves_no_process(tmp_path: Path, digits) -> None:
    spec_file = write_spec(
        tmp_path, digits, data={"num_workers": 2}, train={"epochs": 50}, logging={"log_every_steps": 1, "progress": False}
    )
    run = submit_local(spec_file, 2)
    read_until(run, "step 2/")
    sessions = {rank_pid(run, rank) for rank in range(2)}  # each rank leads a session: its workers are in it
    assert len(processes_in(sessions)) > 2  # the ranks and their DataLoader workers
    for rank in sessions:  # ranks that do not get to their next step (stuck, or just slow to save)
        os.kill(rank, signal.SIGSTOP)
    os.killpg(run.pid, signal.SIGINT)
    read_until(run, "Ctrl-C again to stop at once")
    os.killpg(run.pid, signal.SIGINT)
    output = run.communicate(timeout=60)[0]
    assert run.returncode == ExitCode.INTERRUPTED, output
    assert "stopping at once" in output and "Traceback" not in output, output
    deadline = time.monotonic() + 60  # DataLoader workers notice a dead parent within seconds
    while processes_in(sessions) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_in(sessions) == [], "processes left behind"


def processes_in(sessions: set[int]) -> list[int]:
    """Live processes whose session is one of ``sessions``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) in sessions:
            found.append(int(entry.name))
    return found
