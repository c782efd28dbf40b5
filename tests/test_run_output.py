"""What a local run prints, read as a person reads it in a log file (``... --local > run.log``, or
SLURM's log): progress as plain lines, not a bar redrawn with carriage returns; every line whole
though two ranks write into the same file; epochs numbered alike in every line; and, at the end,
where the checkpoint went. Then what ``lance-hpc status`` and ``logs`` say of a local run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lance_hpc.checkpoint import manifests
from lance_hpc.checkpoint.manifests import checkpoint_name, manifest, manifest_name
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.output import ProgressLines
from tests.support.jobs import REPO_ROOT, write_spec

CHATTER_LINES = 3000
CHATTER = re.compile(r"rank [01] line \d+ x{60}")
PROGRESS = re.compile(r"^epoch (\d+): (\d+)/(\d+) steps \(\d+%\)", re.MULTILINE)
VALIDATION = re.compile(r"^epoch (\d+) step (\d+): validation accuracy", re.MULTILINE)


def chatter(ctx: Any) -> dict[str, float]:
    """A script-mode entry that prints many lines from every rank at once, each in several pieces."""
    whole = sys.stdout.line_buffering and not sys.stdout.write_through  # type: ignore[attr-defined]
    print(f"rank {ctx.rank} stdout line-buffered: {whole}")
    ctx.all_reduce({"ready": 1.0})  # the ranks start printing together
    for index in range(CHATTER_LINES):
        print(f"rank {ctx.rank}", "line", index, "x" * 60)
    return {}


def run_logged(spec_file: Path, log: Path) -> str:
    """``python -m lance_hpc.submit SPEC --local`` on 2 ranks with its output in ``log``, Python
    unbuffered (as submitit starts its tasks, and as many users set it); the log's text."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lance_hpc.submit", str(spec_file), "--local", "--nproc", "2"]
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=REPO_ROOT, timeout=600)
    with open(log, newline="") as file:  # carriage returns kept as they are
        text = file.read()
    assert done.returncode == 0, text
    return text


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, digits) -> tuple[Path, str]:
    """A run with its progress bar on, stopped by train.max_steps in its second epoch (about 45
    steps an epoch): its directory and its log."""
    directory = tmp_path_factory.mktemp("logged")
    spec_file = write_spec(directory, digits, train={"epochs": 2, "max_steps": 60}, logging={"progress": True})
    return directory, run_logged(spec_file, directory / "run.log")


@pytest.mark.slow
def test_a_log_file_gets_progress_lines_not_carriage_returns(trained: tuple[Path, str]) -> None:
    _, log = trained
    assert "\r" not in log, f"carriage returns in the log:\n{log!r}"
    progress = [(int(epoch), int(done), int(total)) for epoch, done, total in PROGRESS.findall(log)]
    assert progress and progress[0][0] == 1 and progress[0][1] == progress[0][2], log  # epoch 1 whole
    assert progress[-1][0] == 2 and progress[-1][1] == 60 - progress[0][2], log  # where max_steps stopped it


@pytest.mark.slow
def test_every_line_numbers_epochs_from_1_as_the_progress_lines_do(trained: tuple[Path, str]) -> None:
    _, log = trained
    progress_epochs = [int(epoch) for epoch, _, _ in PROGRESS.findall(log)]
    validations = [(int(epoch), int(step)) for epoch, step in VALIDATION.findall(log)]
    assert validations and progress_epochs, log
    # epoch 1's evaluation at its end; the last one in epoch 2, where train.max_steps stopped the run
    assert [epoch for epoch, _ in validations] == sorted(set(progress_epochs)) == [1, 2], log
    assert validations[-1][1] == 60, log


@pytest.mark.slow
def test_the_end_of_a_run_says_where_its_checkpoint_is(trained: tuple[Path, str]) -> None:
    directory, log = trained
    saved = manifests.latest(open_store(directory / "checkpoints"))
    assert saved is not None and saved.step == 60
    assert f"\ncheckpoint step 60: {saved.location}\n" in log, log
    assert Path(saved.location).is_file()


@pytest.mark.slow
def test_status_after_a_local_run_shows_what_it_left_and_logs_says_where_its_output_went(trained: tuple[Path, str]) -> None:
    directory, _ = trained
    spec_file = directory / "digits.spec.yaml"
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    status = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "status", str(spec_file)], capture_output=True, text=True, env=environ, timeout=300
    )
    assert status.returncode == 0, status.stdout + status.stderr
    saved = manifests.latest(open_store(directory / "checkpoints"))
    assert saved is not None
    assert status.stdout.startswith(f"{spec_file} (digits): no SLURM job; what its --local runs left\n"), status.stdout
    assert f"  checkpoint  step 60, epoch 2: {saved.location}\n" in status.stdout
    assert re.search(r"  last log    step 60: loss [0-9.]+, [0-9,.]+ samples/s\n", status.stdout), status.stdout
    assert "  finished    step 60 of 60\n" in status.stdout and "submit it with" not in status.stdout
    assert "  output      a --local run prints to the terminal (or the file) it ran in" in status.stdout
    logs = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "logs", str(spec_file)], capture_output=True, text=True, env=environ, timeout=300
    )
    assert logs.returncode == 2 and "Traceback" not in logs.stderr, logs.stderr
    assert "a --local run prints to the terminal (or the file) it ran in" in logs.stderr, logs.stderr
    assert f"checkpoints in {directory / 'checkpoints'}" in logs.stderr, logs.stderr


@pytest.mark.slow
def test_ranks_sharing_a_log_write_each_line_whole(tmp_path: Path, digits) -> None:
    spec_file = write_spec(tmp_path, digits, entry="tests.test_run_output:chatter")
    log = run_logged(spec_file, tmp_path / "run.log")
    # interleaving is a race: that each rank's stdout is line-buffered says it cannot happen
    assert log.count("stdout line-buffered: True") == 2, log[:2000]
    lines = [line for line in log.splitlines() if "rank " in line and " line " in line]
    broken = [line for line in lines if not CHATTER.fullmatch(line)]
    assert not broken and len(lines) == 2 * CHATTER_LINES, f"{len(broken)} lines cut or mixed, e.g. {broken[:5]}"


def test_progress_lines_come_at_an_interval_and_at_the_end(tmp_path: Path) -> None:
    log = tmp_path / "progress.log"
    with open(log, "w") as stream:
        every_time = ProgressLines(10, "epoch 3", unit="steps", stream=stream, every_s=0.0)
        every_time.update(4)
        quiet = ProgressLines(10, "epoch 4", unit="steps", stream=stream, every_s=3600.0)
        for _ in range(10):
            quiet.update()
        quiet.set_postfix({"loss": "0.250"})
        quiet.close()
        every_time.close()
    lines = log.read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "epoch 3: 4/10 steps (40%)",
        "epoch 4: 10/10 steps (100%)",
    ]
    assert lines[1].endswith(", loss 0.250") and len(lines) == 2, lines


@pytest.mark.parametrize(
    ("step", "epoch", "mid_epoch", "shown"),
    [(10, 0, True, 1), (45, 1, False, 1), (60, 1, True, 2), (90, 2, False, 2)],
    ids=["in epoch 1", "end of epoch 1", "in epoch 2", "end of epoch 2"],
)
def test_status_names_a_checkpoints_epoch_as_the_progress_lines_do(
    tmp_path: Path, step: int, epoch: int, mid_epoch: bool, shown: int
) -> None:
    """A manifest's epoch is the epoch being read, from 0 (after an epoch's last step: the count
    finished); status shows the epoch the checkpoint's step read, from 1."""
    (tmp_path / checkpoint_name(step)).write_bytes(b"")
    (tmp_path / manifest_name(step)).write_bytes(manifest({"step": step, "epoch": epoch, "mid_epoch": mid_epoch}, 2))
    saved = manifests.latest(open_store(tmp_path))
    assert saved is not None and saved.epoch == shown
