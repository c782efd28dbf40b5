"""A signal that reaches the restart supervisor between two attempts, while it asks SLURM for the
nodes the next one may use: it starts no further attempt (without a cluster, around fake SLURM
commands that make the signal land during that call)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lance_hpc.launch import restart_script, restarts

# srun fails each attempt; scontrol, asked after a failure, waits for the test's go.
FAKE = {
    "srun": '#!/bin/bash\necho x >> "$WORK/attempts"\ntouch "$WORK/failed"\nexit 1\n',
    "scontrol": (
        "#!/bin/bash\n"
        'if [ -e "$WORK/failed" ] && [ ! -e "$WORK/go" ]; then\n'
        '    touch "$WORK/asking"; until [ -e "$WORK/go" ]; do sleep 0.05; done\n'
        "fi\n"
        '[ "$2" = job ] && echo "JobId=7 NodeList=here" || echo here\n'
    ),
    "sinfo": "#!/bin/bash\necho 'here idle'\n",
}


def wait_for(path: Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


def test_a_sigterm_while_slurm_is_asked_for_the_next_nodes_starts_no_further_attempt(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    program = tmp_path / "job.restarts.pyz"
    program.write_bytes(restart_script.supervisor_program())
    record = tmp_path / "record"
    command = [sys.executable, "-I", str(program), "--max-restarts=2", "--nodes=1", "--min-nodes=1", "--tasks-per-node=1"]
    command += [f"--record={record}", "--no-standby", "--", "srun", "true"]
    environ = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "WORK": str(tmp_path), "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "here"}
    process = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "asking", process)  # the first attempt failed; scontrol is asked for the second's nodes
        process.send_signal(signal.SIGTERM)  # pending before scontrol can answer, which waits for the go below
        (tmp_path / "go").touch()
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert (tmp_path / "attempts").read_text() == "x\n", stdout + stderr  # one attempt, no other
    assert process.returncode == 1, stdout + stderr
    assert "lance_hpc: stopped by a signal before attempt 2; the job ends with attempt 1's error" in stderr, stderr
    attempts = restarts.read_attempts(record / restarts.ATTEMPTS_FILE)
    assert [attempt.number for attempt in attempts] == [0]
    assert attempts[0].outcome == "stopped by a signal before the next attempt"
