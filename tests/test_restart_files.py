"""The restart supervisor's files in a log directory other users may write: the program the batch
script runs (``<name>.restarts.pyz``) and the records (``<name>.attempts/``), which neither the
supervisor nor ``lance-hpc status`` uses unless they are the job's user's own regular files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lance_hpc.launch import restart_script, restarts
from lance_hpc.launch.paths import JobPaths
from lance_hpc.spec import JobSpec, validate_spec

RAN_SRUN = '#!/bin/bash\necho "the step ran" > "$RAN"\n'


def job(log_dir: Path) -> JobSpec:
    return validate_spec({"name": "job", "data": {"uri": "/d"}, "slurm": {"log_dir": str(log_dir)}}).spec


def batch_step(
    tmp_path: Path, spec: JobSpec, srun: str = RAN_SRUN, umask: str = "077", **variables: str
) -> subprocess.CompletedProcess[str]:
    """The supervisor's line of the job's batch script, run by bash around a fake srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "python3").unlink(missing_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    line = f"umask {umask}; {restart_script.restart_supervisor(spec)} srun true"
    environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RAN": str(tmp_path / "ran"), "SLURM_JOB_ID": "7", **variables}
    return subprocess.run(["bash", "-c", line], env=environ, capture_output=True, text=True, timeout=30, cwd=tmp_path)


def test_the_supervisor_program_runs_when_it_is_the_users_own(tmp_path: Path) -> None:
    spec = job(tmp_path / "logs")
    program = JobPaths.of(spec).restarts_program
    program.parent.mkdir()
    program.write_bytes(restart_script.supervisor_program())
    result = batch_step(tmp_path, spec)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "ran").read_text() == "the step ran\n"


@pytest.mark.parametrize("planted", ["another user's", "a link", "group-writable", "a FIFO"])
def test_a_supervisor_program_another_user_could_have_put_there_is_refused_and_nothing_runs(tmp_path: Path, planted: str) -> None:
    """In a group's log directory the program may have been replaced after submission: the script runs
    it only if it is a regular file of the job's user that nobody else may write."""
    spec = job(tmp_path / "logs")
    program = JobPaths.of(spec).restarts_program
    program.parent.mkdir()
    elsewhere = tmp_path / "elsewhere.pyz"
    elsewhere.write_bytes(restart_script.supervisor_program())
    if planted == "a link":
        program.symlink_to(elsewhere)
    elif planted == "a FIFO":
        os.mkfifo(program)
    else:
        program.write_bytes(restart_script.supervisor_program())
        if planted == "another user's":
            os.chown(program, 65534, 65534)
        else:
            program.chmod(0o664)
    result = batch_step(tmp_path, spec)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"lance_hpc: {program} is not run: "), result.stderr
    assert "fix: submit the job again from a log directory" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ran").exists()


def test_the_records_are_the_users_alone_whatever_the_umask(tmp_path: Path) -> None:
    spec = job(tmp_path / "logs")
    paths = JobPaths.of(spec)
    paths.restarts_program.parent.mkdir()
    paths.restarts_program.write_bytes(restart_script.supervisor_program())
    result = batch_step(tmp_path, spec, umask="022")
    assert result.returncode == 0, result.stdout + result.stderr
    assert stat.S_IMODE(paths.attempts.stat().st_mode) == 0o700
    assert stat.S_IMODE((paths.attempts / "7").stat().st_mode) == 0o700
    assert stat.S_IMODE((paths.attempts / "7" / restarts.ATTEMPTS_FILE).stat().st_mode) == 0o600


# A step that fails with a FIFO where its rank 1's failure note would be.
FIFO_NOTE_SRUN = '#!/bin/bash\nmkfifo "$LANCE_HPC_FAILURE_DIR/rank-1.json"\nexit 1\n'


@pytest.mark.parametrize("planted", ["a FIFO", "a link"])
def test_a_fifo_or_link_in_the_records_neither_blocks_the_supervisor_nor_is_written_through(tmp_path: Path, planted: str) -> None:
    spec = job(tmp_path / "logs")
    paths = JobPaths.of(spec)
    paths.restarts_program.parent.mkdir()
    paths.restarts_program.write_bytes(restart_script.supervisor_program())
    record = paths.attempts / "7"
    record.mkdir(parents=True)
    target = tmp_path / "someone-elses.txt"
    target.write_text("theirs\n")
    if planted == "a FIFO":
        os.mkfifo(record / restarts.ATTEMPTS_FILE)
    else:
        (record / restarts.ATTEMPTS_FILE).symlink_to(target)
    result = batch_step(tmp_path, spec, srun=FIFO_NOTE_SRUN)
    assert result.returncode == 1, result.stdout + result.stderr
    what = "is not a regular file" if planted == "a FIFO" else "is a symbolic link"
    assert f"lance_hpc: cannot record attempt 1 in {record}: {record / restarts.ATTEMPTS_FILE} {what}" in result.stderr
    assert "Traceback" not in result.stderr and target.read_text() == "theirs\n"

    # lance-hpc status shows what it refused instead of the attempts
    shown = subprocess.run(
        [sys.executable, "-c", STATUS_LINES, str(tmp_path / "logs")],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.stdout == f"attempts not shown: {record / restarts.ATTEMPTS_FILE} {what}\n", shown.stdout + shown.stderr


STATUS_LINES = """import sys
from lance_hpc.manage.attempts import attempt_lines
from lance_hpc.slurm.records import JobRef
from lance_hpc.spec import validate_spec
spec = validate_spec({"name": "job", "data": {"uri": "/d"}, "slurm": {"log_dir": sys.argv[1]}}).spec
print("\\n".join(attempt_lines(JobRef("7", spec, "job.yaml"))))
"""
