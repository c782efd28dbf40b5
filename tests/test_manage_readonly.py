"""Looking at a job never runs its code: ``status``, ``logs`` and ``cancel`` read only spec files
the caller owns, and validate them without importing the task or entry they name; what they read
from a log others may have written (a FIFO there, escape sequences in it) neither blocks them nor
reaches the terminal raw. SLURM is faked (``queue`` answers from a table), so these run without a
cluster."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from lance_hpc.cli import cancel, logs, status
from lance_hpc.manage import logs as manage_logs
from lance_hpc.slurm import queue, records
from lance_hpc.spec import SpecError, load_spec

JOB_ID = "77"
COMMANDS = {"status": status.main, "logs": logs.main, "cancel": cancel.main}
OTHER_UID = 12345
# Escape sequences that set the terminal's title and clear it, and a line break that forges a line.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\nforged line\r"
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An ended job ``evil`` whose spec, beside its log, names a task and an entry that each leave a
    marker file when imported. Yields the spec file."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # an imported file's directory is put on sys.path
    for module in ("evil_task", "evil_entry"):
        (tmp_path / f"{module}.py").write_text(
            f"from pathlib import Path\nPath(__file__).with_name('{module}.imported').write_text('ran')\n"
        )
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    spec_file = log_dir / "evil.spec.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "name": "evil",
                "data": {"uri": str(tmp_path / "train.lance")},
                "task": {"name": f"{tmp_path}/evil_task.py:EvilTask"},
                "entry": f"{tmp_path}/evil_entry.py:main",
                "checkpoint": {"dir": str(tmp_path / "checkpoints")},
                "logging": {"tensorboard_dir": str(tmp_path / "runs")},
                "slurm": {"log_dir": str(log_dir)},
            }
        )
    )
    (log_dir / f"evil-{JOB_ID}.out").write_text("0: hello from rank 0\n")
    (log_dir / f"evil-{JOB_ID}.err").write_text("")
    shown = queue.SlurmJob(
        JOB_ID,
        "evil",
        "COMPLETED",
        "scontrol",
        exit_code="0:0",
        stdout=str(log_dir / f"evil-{JOB_ID}.out"),
        stderr=str(log_dir / f"evil-{JOB_ID}.err"),
    )
    monkeypatch.setattr(queue, "have_slurm", lambda: True)
    monkeypatch.setattr(queue, "require", lambda command: None)
    monkeypatch.setattr(queue, "show_job", lambda job_id: shown if job_id == JOB_ID else None)
    monkeypatch.setattr(queue, "jobs_named", lambda name: [])
    yield spec_file
    for module in ("evil_task", "evil_entry"):
        sys.modules.pop(module, None)  # the next test's control must import them afresh


def markers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.imported"))


@pytest.mark.parametrize("by", ["job id", "spec path"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_reading_a_job_never_imports_what_its_spec_names(
    command: str, by: str, job: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    target = JOB_ID if by == "job id" else str(job)
    assert COMMANDS[command]([target]) == 0
    out, err = capfd.readouterr()
    assert markers(job.parent.parent) == [], "reading the job ran code its spec names"
    assert "Traceback" not in out + err
    # the control: validating for submission does import them, which is what the marker shows
    with pytest.raises(SpecError):
        load_spec(job)
    assert markers(job.parent.parent) == ["evil_entry.imported", "evil_task.imported"]


def test_the_job_ids_spec_is_used_when_the_caller_owns_it(job: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert status.main([JOB_ID]) == 0
    out = capfd.readouterr().out
    assert f"spec        {job}" in out and "checkpoint  none yet" in out


@NEEDS_ROOT
def test_another_users_spec_beside_the_log_is_not_read(job: Path, capfd: pytest.CaptureFixture[str]) -> None:
    os.chown(job, OTHER_UID, -1)
    assert status.main([JOB_ID]) == 0
    out = capfd.readouterr().out
    assert f"job {JOB_ID} (evil): COMPLETED" in out  # what SLURM knows is still reported
    assert f"its spec {job} belongs to uid {OTHER_UID}, not to you, so lance-hpc did not read it" in out
    assert "spec        " not in out and "checkpoint  " not in out
    assert not (job.parent / records.RECORDS_FILE).exists()  # nothing written where that spec says
    assert cancel.main([JOB_ID]) == 0
    assert "belongs to uid 12345" not in capfd.readouterr().out  # an ended job: nothing to report
    assert logs.main([JOB_ID]) == 0  # from the log path SLURM shows, read with the caller's permissions
    assert markers(job.parent.parent) == []


@NEEDS_ROOT
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_another_users_spec_named_on_the_command_line_is_refused(
    command: str, job: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    os.chown(job, OTHER_UID, -1)
    assert COMMANDS[command]([str(job)]) == 2
    err = capfd.readouterr().err
    assert f"{job} belongs to uid {OTHER_UID}, not to you" in err
    assert "fix: give the job id instead" in err and "Traceback" not in err


def test_a_link_beside_the_log_is_not_followed(job: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere.yaml"
    job.rename(target)
    job.symlink_to(target)
    assert status.main([JOB_ID]) == 0
    assert "its spec was not found beside its log" in capfd.readouterr().out


def test_a_fifo_in_place_of_the_spec_does_not_hang(job: Path, capfd: pytest.CaptureFixture[str]) -> None:
    job.unlink()
    os.mkfifo(job)
    assert status.main([JOB_ID]) == 0
    assert "its spec was not found beside its log" in capfd.readouterr().out


def test_status_escapes_the_control_characters_of_a_jobs_log(job: Path, capfd: pytest.CaptureFixture[str]) -> None:
    (job.parent / f"evil-{JOB_ID}.err").write_text(f"lance_hpc.run: {ESCAPES}\n")
    assert status.main([str(job)]) == 0
    out = capfd.readouterr().out
    assert "ended       failed: \\x1b]0;pwned\\x07" in out and "\x1b" not in out and "\x07" not in out, repr(out)
    assert not any(line.startswith("forged line") for line in out.splitlines()), out


def test_status_reads_only_the_end_of_a_regular_log(
    job: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log that is a FIFO is refused at once (read whole, it would block status forever), and of a
    long log only the end is read: the outcome is in its last lines."""
    monkeypatch.setattr(manage_logs, "OUTCOME_BYTES", 64)
    err = job.parent / f"evil-{JOB_ID}.err"
    err.write_text("lance_hpc.run: an early failure, before the end\n" + "x" * 100 + "\nlance_hpc.run: the last one\n")
    assert status.main([str(job)]) == 0
    assert "ended       failed: the last one" in capfd.readouterr().out
    err.unlink()
    os.mkfifo(err)
    ended: dict[str, int] = {}
    reader = threading.Thread(target=lambda: ended.update(code=status.main([str(job)])), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():
        os.close(os.open(err, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader's writer: it reads the end and returns
        reader.join()
        pytest.fail("status blocked reading a FIFO")
    assert ended["code"] == 2 and f"{err} is not a regular file" in capfd.readouterr().err
