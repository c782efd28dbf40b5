"""The restart supervisor's files in a log directory other users may write: the program the batch
script runs (``<name>.restarts.pyz``) and the records (``<name>.attempts/``), which neither the
supervisor nor ``lance-hpc status`` uses unless they are the job's user's own regular files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lance_hpc.launch import restart_script
from lance_hpc.launch.paths import JobPaths
from lance_hpc.spec import JobSpec, validate_spec

RAN_SRUN = '#!/bin/bash\necho "the step ran" > "$RAN"\n'


def job(log_dir: Path) -> JobSpec:
    return validate_spec({"name": "job", "data": {"uri": "/d"}, "slurm": {"log_dir": str(log_dir)}}).spec


def batch_step(tmp_path: Path, spec: JobSpec, srun: str = RAN_SRUN, **variables: str) -> subprocess.CompletedProcess[str]:
    """The supervisor's line of the job's batch script, run by bash around a fake srun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "python3").unlink(missing_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    line = f"{restart_script.restart_supervisor(spec)} srun true"
    environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RAN": str(tmp_path / "ran"), "SLURM_JOB_ID": "7", **variables}
    return subprocess.run(["bash", "-c", line], env=environ, capture_output=True, text=True, timeout=60, cwd=tmp_path)


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
