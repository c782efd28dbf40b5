"""On the real two-node test cluster: rendered scripts and submitit jobs run, fail visibly, requeue."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lance_hpc.kinds.rank import SubmititJob
from lance_hpc.launch import render
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.render import write_job_files
from lance_hpc.launch.submit import make_executor
from lance_hpc.runtime.ports import port_for_job
from lance_hpc.spec import load_spec
from tests.support.jobs import REPO_ROOT, Digits
from tests.support.jobs import write_spec as write_digits_spec
from tests.support.ports import free_ports
from tests.support.render import write_restarts_program
from tests.support.slurm import environ as job_environ
from tests.support.slurm import job_log, signal_steps
from tests.support.slurm import sbatch as sbatch_spec
from tests.support.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "jobs" / "quickstart.yaml"
# The built-in template's header, setup and exports, with the trainer swapped for a probe command,
# run through the restart supervisor as the built-in template runs the trainer.
PROBE_TEMPLATE = textwrap.dedent("""\
    #!/bin/bash
    {% for line in sbatch_lines %}
    {{ line }}
    {% endfor %}
    set -eo pipefail
    {% for line in setup + exports %}
    {{ line }}
    {% endfor %}
    {{ restarts }} {{ srun }} python3 -c PROBE
    """)
# Prints what each task sees, in one line.
ENVIRONMENT_PROBE = (
    'import os; os.write(1, ("PROBE " + " ".join(f"{k}={os.environ.get(k)}" for k in ("SLURM_PROCID", "SLURM_LOCALID", '
    '"SLURM_NTASKS", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "OMP_NUM_THREADS", "SETUP_RAN")) + "\\n").encode())'
)


def environ(cluster: SlurmCluster) -> dict[str, str]:
    return {**os.environ, **cluster.env}


def sbatch(cluster: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sbatch", *args], env=environ(cluster), capture_output=True, text=True, timeout=600)


def lance_submit(
    cluster: SlurmCluster, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lance_hpc.submit", *args]
    return subprocess.run(command, env=env or environ(cluster), cwd=cwd, capture_output=True, text=True, timeout=600)


def write_spec(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def wait_for_end(cluster: SlurmCluster, job_id: str, timeout_s: float = 300) -> tuple[str, str]:
    """The job's final state and exit code, polled every second (``sbatch --wait`` polls at growing
    intervals, so a job of seconds could hold a test for half a minute)."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        shown = cluster.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", shown))
        if fields.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
            return fields["JobState"], fields.get("ExitCode", "")
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {fields.get('JobState', '?')} after {timeout_s}s\n{job_log(cluster, job_id)}")


def wait_for_state(cluster: SlurmCluster, job_id: str, states: set[str], timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    state = "?"
    while time.monotonic() < deadline:
        state = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip() or "GONE"
        if state in states:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {state} after {timeout_s}s")


def run_probe(cluster: SlurmCluster, tmp_path: Path, command: str) -> str:
    """Runs ``python3 -c command`` as a 2-node x 2-task job of the built-in template's making (its
    srun options, setup and exports); the job's output once it has completed."""
    template = tmp_path / "probe.sbatch.j2"
    template.write_text(PROBE_TEMPLATE.replace("PROBE", shlex.quote(command)))
    raw = {
        "name": "probe",
        "slurm": {
            "partition": cluster.partition, "nodes": 2, "tasks_per_node": 2, "cpus_per_task": 1,
            "time": "00:05:00", "setup": ["export SETUP_RAN=yes"], "log_dir": str(tmp_path / "logs"),
        },
        "data": {"uri": "/unused"},
    }  # fmt: skip
    spec = load_spec(write_spec(tmp_path / "probe.yaml", raw)).spec
    (tmp_path / "logs").mkdir()
    probe = render.render_sbatch(
        spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"template": str(template)})}), "/x.yaml"
    )
    assert dict(render.sbatch_directives(probe)) == dict(render.sbatch_directives(render.render_sbatch(spec, "/x.yaml")))
    (tmp_path / "probe.sbatch").write_text(probe)
    write_restarts_program(spec)

    result = sbatch(cluster, "--parsable", str(tmp_path / "probe.sbatch"))
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    assert wait_for_end(cluster, job_id) == ("COMPLETED", "0:0"), job_log(cluster, job_id)
    return (tmp_path / "logs" / f"probe-{job_id}.out").read_text()


def test_rendered_script_runs_two_nodes_by_two_tasks(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    output = run_probe(slurm_cluster, tmp_path, ENVIRONMENT_PROBE)
    # srun --label starts every line with its task's rank: "3: PROBE ..."
    seen = sorted(line.split(": ", 1)[1].split()[1:] for line in output.splitlines() if ": PROBE " in line)
    assert seen == [
        [f"SLURM_PROCID={rank}", f"SLURM_LOCALID={rank % 2}", "SLURM_NTASKS=4", "SLURM_JOB_NODELIST=node[1-2]",
         f"SLURMD_NODENAME=node{rank // 2 + 1}", "OMP_NUM_THREADS=1", "SETUP_RAN=yes"]
        for rank in range(4)
    ]  # fmt: skip


def test_every_line_a_rank_writes_reaches_the_log_whole_with_its_label(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Each task writes long lines as fast as it can, each in one write (as a rank's line-buffered
    output does): SLURM must pass them on line by line, or --label cuts one in two and labels both
    halves (`lance-hpc logs --rank` then shows half a line, and drops the other half).

    One exception is SLURM's own: what slurmstepd still holds of a task's output when the task ends
    (its buffer is 4 KiB) goes out in 1 KiB pieces, lines or not, when srun is that far behind. So
    the lines before a task's last 4 KiB are whole, and every piece carries its own task's label."""
    lines, width = 3000, 700
    flood = (
        "import os; rank = os.environ['SLURM_PROCID']\n"
        f"for i in range({lines}): os.write(1, f'LINE {{rank}} {{i}} '.encode() + b'x' * {width} + b' END\\n')"
    )
    output = run_probe(slurm_cluster, tmp_path, flood)
    labelled = re.compile(r"(\d): (.*)")
    by_rank: dict[str, list[str]] = {}
    for line in output.splitlines():
        found = labelled.fullmatch(line)
        assert found, f"a line without its rank's label: {line[:120]!r}"
        by_rank.setdefault(found[1], []).append(found[2])
    assert sorted(by_rank) == ["0", "1", "2", "3"], sorted(by_rank)
    whole = re.compile(rf"LINE (\d) (\d+) x{{{width}}} END")
    end_buffer = 4 * 1024  # slurmstepd's buffer of a task's output, sent in 1 KiB pieces at its end
    for rank, texts in sorted(by_rank.items()):
        # every byte the task wrote, in order, under its own label
        expected = "".join(f"LINE {rank} {i} " + "x" * width + " END" for i in range(lines))
        written = "".join(texts)
        differs = next((at for at, (a, b) in enumerate(zip(written, expected)) if a != b), min(len(written), len(expected)))
        assert written == expected, (
            f"rank {rank}'s lines are not its own, in order, each once: {len(written)} bytes against {len(expected)}, "
            f"first differing at byte {differs}: {written[max(0, differs - 40) : differs + 80]!r}"
        )
        broken = [at for at, text in enumerate(texts) if not whole.fullmatch(text)]
        if broken:
            tail = texts[broken[0] :]
            assert sum(len(text) for text in tail) <= end_buffer, (
                f"rank {rank}: {len(broken)} of {len(texts)} lines cut before its last {end_buffer} bytes, such as:\n"
                + "\n".join(texts[at][:120] for at in broken[:6])
            )


def test_submit_through_submitit_collects_the_result(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    sets = ["--set", "slurm.nodes=2", "--set", "train.epochs=1", "--set", "train.max_steps=3"]
    result = lance_submit(slurm_cluster, tmp_path, str(QUICKSTART), *sets, "--wait")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "submitted job" in result.stdout and "tensorboard --logdir" in result.stdout
    assert "finished: {" in result.stdout and "'status': 'completed'" in result.stdout
    assert (tmp_path / "logs" / "quickstart" / "quickstart.sbatch").exists()


def test_failing_job_reports_exit_status_and_log(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    raw = {
        "name": "fails",
        "slurm": {
            "partition": slurm_cluster.partition,
            "cpus_per_task": 1,
            "time": "00:05:00",
            "setup": ["echo setting up; false"],
        },
        "data": {"uri": str(tmp_path / "missing.lance")},
    }
    spec_path = write_spec(tmp_path / "fails.yaml", raw)
    result = lance_submit(slurm_cluster, tmp_path, str(spec_path), "--wait", "--no-preflight")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ended FAILED with exit code 1:0" in result.stderr
    assert f"logs: {tmp_path}/logs/fails/submitit/" in result.stderr


def test_failing_trainer_reports_the_task_that_failed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    raw = {
        "name": "nodata",
        "slurm": {"partition": slurm_cluster.partition, "cpus_per_task": 1, "time": "00:05:00"},
        "data": {"uri": str(tmp_path / "missing.lance")},  # no dataset and nothing to ingest it from
    }
    spec_path = write_spec(tmp_path / "nodata.yaml", raw)
    # past the preflight check on purpose: a job whose data vanishes after submission
    result = lance_submit(slurm_cluster, tmp_path, str(spec_path), "--wait", "--no-preflight")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "failed; task 0 failed first" in result.stderr and "missing.lance" in result.stderr
    assert f"{tmp_path}/logs/nodata/submitit/" in result.stderr

    # the same job through the rendered script and plain sbatch: non-zero exit, message in the log
    rendered = lance_submit(slurm_cluster, tmp_path, str(spec_path), "--render-only")
    assert rendered.returncode == 0, rendered.stderr
    result = sbatch(slurm_cluster, "--parsable", str(tmp_path / "logs" / "nodata" / "nodata.sbatch"))
    job_id = result.stdout.strip().split(";")[0]
    state, exit_code = wait_for_end(slurm_cluster, job_id)
    assert state == "FAILED" and exit_code != "0:0", (state, exit_code, job_log(slurm_cluster, job_id))
    assert "missing.lance" in (tmp_path / "logs" / "nodata" / f"nodata-{job_id}.err").read_text()


def test_controller_down_is_a_clear_error(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    conf = Path(slurm_cluster.env["SLURM_CONF"]).read_text().splitlines()
    (port,) = free_ports(1)  # nothing listens there
    down = [f"SlurmctldPort={port}" if line.startswith("SlurmctldPort=") else line for line in conf]
    (tmp_path / "down.conf").write_text("\n".join(down) + "\n")
    raw = {"name": "down", "slurm": {"time": "00:05:00"}, "data": {"uri": "/d"}}
    spec_path = write_spec(tmp_path / "down.yaml", raw)
    down_env = {**os.environ, "SLURM_CONF": str(tmp_path / "down.conf")}
    result = lance_submit(slurm_cluster, tmp_path, str(spec_path), "--no-preflight", env=down_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "Unable to contact slurm controller" in result.stderr and "scontrol ping" in result.stderr


def test_quoted_values_reach_slurm_unchanged(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    comment = f'$(touch {marker}) `touch {marker}` it\'s "quoted"; & | > <'
    raw = {
        "name": "quoting",
        "slurm": {"partition": slurm_cluster.partition, "extra_flags": {"comment": comment}, "log_dir": str(tmp_path)},
        "data": {"uri": "/d"},
    }
    spec_path = write_spec(tmp_path / "quoting.yaml", raw)
    assert lance_submit(slurm_cluster, tmp_path, str(spec_path), "--render-only").returncode == 0
    result = sbatch(slurm_cluster, "--parsable", "--hold", str(tmp_path / "quoting.sbatch"))
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    try:
        shown = slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%k").stdout.rstrip("\n")
        assert shown == comment
    finally:
        slurm_cluster.run("scancel", job_id, check=False)
    assert not marker.exists()


def test_requeued_job_runs_again(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """What preemption relies on: a job that requeues itself starts again soon, with a restart count."""
    script = tmp_path / "requeue.sbatch"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --open-mode=append
        #SBATCH --output={tmp_path}/requeue.out
        #SBATCH --partition={slurm_cluster.partition}
        echo "run ${{SLURM_RESTART_COUNT:-0}}"
        if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then scontrol requeue "$SLURM_JOB_ID"; sleep 60; fi
        """)
    )
    result = sbatch(slurm_cluster, "--parsable", str(script))
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip().split(";")[0]
    started = time.monotonic()
    wait_for_state(slurm_cluster, job_id, {"GONE", "COMPLETED"}, timeout_s=120)
    assert (tmp_path / "requeue.out").read_text().count("run ") == 2
    assert "run 1" in (tmp_path / "requeue.out").read_text()
    assert time.monotonic() - started < 90  # cred_expire=10 in the test cluster, not SLURM's 120 s


def test_ranks_meet_on_a_free_port_while_another_process_holds_the_job_id_port(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rendered script and a submitit job, 2 ranks on 2 nodes each. Both are submitted held, so
    their ids are known before they start; this process then listens on each job's derived port,
    on every address of the machine all emulated nodes share, and releases them. The batch step
    picks another port, so the ranks meet and train."""
    specs = []
    for way in ("sbatch", "submitit"):  # each its own checkpoint.dir: the two run at once
        slurm = {
            "partition": slurm_cluster.partition, "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1,
            "time": "00:10:00", "log_dir": str(tmp_path / way / "logs"), "extra_flags": {"hold": True},
        }  # fmt: skip
        train = {"epochs": 1, "max_steps": 2}
        specs.append(load_spec(write_digits_spec(tmp_path / way, digits, name="held", slurm=slurm, train=train)).spec)
    scripted = sbatch_spec(slurm_cluster, specs[0])
    for key, value in job_environ(slurm_cluster).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO_ROOT)
    write_job_files(specs[1])
    executor = make_executor(specs[1], tmp_path / "submitit" / "submitit")
    submitted = executor.submit(SubmititJob(str(JobPaths.of(specs[1]).spec_file)))
    holders = []
    try:
        for job_id in (scripted, submitted.job_id):
            holder = socket.socket()
            holder.bind(("0.0.0.0", port_for_job(job_id)))
            holder.listen()
            holders.append(holder)
        slurm_cluster.run("scontrol", "release", scripted, submitted.job_id)
        for job_id in (scripted, submitted.job_id):
            state, exit_code = wait_for_end(slurm_cluster, job_id)
            assert (state, exit_code) == ("COMPLETED", "0:0"), (
                f"port {port_for_job(job_id)} held\n{job_log(slurm_cluster, job_id)}"
            )
    finally:
        for holder in holders:
            holder.close()
        slurm_cluster.run("scancel", scripted, submitted.job_id, check=False)
    assert submitted.task(0).result()["status"] == "completed"


def usr1_ignored(pid: int) -> bool:
    """Whether process ``pid`` ignores USR1 (its /proc status mask SigIgn)."""
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(ignored & (1 << (signal.SIGUSR1 - 1)))


def waiting_task(folder: Path, timeout_s: float = 120) -> int:
    """The pid of the submitit task that waits for its job's pickle in ``folder`` (it logs
    "Loading pickle" first): the test cluster's nodes run on this machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any("Loading pickle" in log.read_text(errors="replace") for log in folder.glob("*_0_log.out")):
            for entry in Path("/proc").iterdir():
                try:
                    words = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                # not srun's, nor the restart supervisor's (a python3 whose command line holds srun's)
                python = Path(words[0].decode(errors="replace")).name.startswith("python") and b"srun" not in words
                if python and b"submitit.core._submit" in words and str(folder).encode() in words:
                    return int(entry.name)
        time.sleep(0.5)
    logs = "\n".join(f"{log}:\n{log.read_text(errors='replace')}" for log in folder.glob("*_log.*"))
    raise AssertionError(f"no submitit task waiting for its pickle in {folder} after {timeout_s} s\n{logs}")


def test_usr1_while_a_submitit_task_starts_does_not_end_it(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scancel --signal=USR1` reaching a submitit task before lance_hpc runs in it: here while the
    task waits for its job's pickle (moved away until the signal is sent), the window in which
    submitit imports and unpickles. The task ignores USR1 there and trains to the end."""
    slurm = {
        "partition": slurm_cluster.partition, "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1,
        "time": "00:10:00", "log_dir": str(tmp_path / "logs"), "extra_flags": {"hold": True},
    }  # fmt: skip
    spec = load_spec(write_digits_spec(tmp_path, digits, name="usr1", slurm=slurm, train={"epochs": 1, "max_steps": 2})).spec
    for key, value in job_environ(slurm_cluster).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO_ROOT)
    write_job_files(spec)
    folder = tmp_path / "submitit"
    submitted = make_executor(spec, folder).submit(SubmititJob(str(JobPaths.of(spec).spec_file)))
    pickle = submitted.paths.submitted_pickle
    away = pickle.with_name(pickle.name + ".away")
    pickle.rename(away)
    try:
        slurm_cluster.run("scontrol", "release", submitted.job_id)
        pid = waiting_task(folder)
        assert usr1_ignored(pid), f"the submitit task (pid {pid}) would die of USR1 before lance_hpc runs"
        signal_steps(job_environ(slurm_cluster), submitted.job_id, "USR1")
        away.rename(pickle)
        state, exit_code = wait_for_end(slurm_cluster, submitted.job_id)
        assert (state, exit_code) == ("COMPLETED", "0:0"), job_log(slurm_cluster, submitted.job_id)
    finally:
        slurm_cluster.run("scancel", submitted.job_id, check=False)
    assert submitted.task(0).result()["status"] == "completed"
