"""``command:`` jobs: a program of the user's own on every task, with torchrun's variables; its
spec, its batch script, its dry run, and local runs of real programs (the environment each rank
gets, a gloo process group over it, a signal passed on, a rerun, a program that is not there)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from lance_hpc.launch import render
from lance_hpc.spec import SpecError, expand, load_spec, validate_spec
from lance_hpc.spec.command_section import expand_argv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "jobs" / "command_example.yaml"

# A program that records the variables a rank gives it, meets the other ranks over them with gloo,
# and on a signal writes which one it got and ends; it fails on its first run when asked to.
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "LANCE_HPC_RUN_COUNT", "SLURM_RESTART_COUNT",
            "LANCE_HPC_OPTION_LR", "PYTHONSAFEPATH"]
    seen = {key: os.environ.get(key) for key in keys}
    seen.update(argv=sys.argv[1:], cwd=os.getcwd())
    run = seen["LANCE_HPC_RUN_COUNT"]
    mode = sys.argv[2]
    if mode == "fail-first" and run == "0":
        sys.exit(7)
    if mode == "wait":
        def stop(signum, frame):
            (out / f"signal-{rank}-{run}").write_text(signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGUSR1, stop)
        signal.signal(signal.SIGTERM, stop)
        (out / f"waiting-{rank}-{run}").write_text(str(os.getppid()))
        time.sleep(300)
        sys.exit(9)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    seen["world"] = dist.get_world_size()
    (out / f"rank-{rank}-{run}.json").write_text(json.dumps(seen))
    if mode == "slurm" and run == "0":  # wait for SLURM's warning, passed on as TERM
        def stopped(signum, frame):
            (out / f"signal-{rank}-{run}").write_text(signal.Signals(signum).name)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stopped)
        (out / f"waiting-{rank}-{run}").write_text(str(os.getppid()))
        time.sleep(300)
        sys.exit(9)
    dist.destroy_process_group()
    """
)


def command_spec(**command: Any) -> dict[str, Any]:
    return {"name": "mine", "command": command or ["python3", "train.py"]}


# --- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, argv",
    [
        ("python3 train.py --name 'my run'", ["python3", "train.py", "--name", "my run"]),
        (["python3", "train.py", "a b"], ["python3", "train.py", "a b"]),
        ({"argv": ["./run.sh"], "signal": "USR1"}, ["./run.sh"]),
    ],
)
def test_a_command_in_any_form_is_a_command_job_without_data(command: Any, argv: list[str]) -> None:
    spec = validate_spec({"name": "mine", "command": command}, base_dir="/project").spec
    assert spec.job == "command" and spec.command is not None and spec.command.argv == argv
    dumped = spec.to_dict()
    assert not {"data", "task", "train", "infer", "entry"} & set(dumped)
    assert validate_spec(yaml.safe_load(spec.to_yaml())).spec == spec  # the resolved spec loads again, as a rank reads it


@pytest.mark.parametrize(
    "raw, path, words",
    [
        ({**command_spec(), "data": {"uri": "x.lance"}}, "data", "does not read"),
        ({**command_spec(), "task": {"name": "image_classification"}}, "task", "does not read"),
        ({**command_spec(), "train": {"lr": 0.1}}, "train", "does not read"),
        ({**command_spec(), "infer": {"function": "a:b"}}, "infer", "does not read"),
        ({**command_spec(), "entry": "my_pkg.train:main"}, "entry", "not a function"),
        ({**command_spec(), "job": "train"}, "job", "not command:"),
        ({"name": "mine", "job": "command"}, "command", "no program"),
        ({"name": "mine", "command": {"argv": ["x"], "signal": "KILL"}}, "command.signal", "not a valid choice"),
        ({"name": "mine", "command": []}, "command.argv", ""),
        ({"name": "mine", "command": "python3 'unclosed"}, "command", "cannot split"),
        ({"name": "mine", "command": ["python3", "t.py", "${lr}"]}, "command.argv[2]", "names no value"),
        ({"name": "mine", "command": ["python3", "t.py", "${checkpoint.nope}"]}, "command.argv[2]", "names no value"),
    ],
)
def test_a_command_with_what_it_does_not_read_is_refused(raw: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, base_dir="/project")
    found = [problem for problem in caught.value.problems if problem.path == path]
    assert len(found) == 1 and words in f"{found[0].message} {found[0].fix}" and found[0].fix, caught.value.problems
    assert len(caught.value.problems) == 1, caught.value.problems  # one message for one problem


def test_arguments_name_options_and_fields_and_a_sweep_varies_them() -> None:
    raw = {
        "name": "mine",
        "command": {"argv": ["python3", "t.py", "--lr=${lr}", "${checkpoint.dir}", "$${HOME}"], "options": {"lr": 0.1}},
        "checkpoint": {"dir": "/ckpt/{name}"},
        "sweep": {"command.options.lr": [0.1, 0.01]},
    }
    spec = validate_spec(raw, base_dir="/project").spec
    runs = expand(spec)
    assert [expand_argv(run.spec.to_dict()) for run in runs] == [
        ["python3", "t.py", "--lr=0.1", f"/ckpt/mine/{runs[0].spec.name}", "${HOME}"],
        ["python3", "t.py", "--lr=0.01", f"/ckpt/mine/{runs[1].spec.name}", "${HOME}"],
    ]


def test_the_shipped_example_runs_the_rank_entry_like_every_job() -> None:
    spec = load_spec(EXAMPLE, base_dir="/project").spec
    assert spec.job == "command"
    script = render.render_sbatch(spec, "/project/logs/x.spec.yaml")
    assert "-m lance_hpc.run /project/logs/x.spec.yaml" in script  # the rank starts the program, as every rank runs its kind


def test_dry_run_shows_the_command(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"name": "mine", "command": ["python3", "train.py", "--epochs", "3"]}))
    result = lance_hpc(["submit", "job.yaml", "--dry-run"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "job: command: python3 train.py --epochs 3 on each of 1 rank(s)" in result.stdout
    assert "command:" in result.stdout and "data:" not in result.stdout.split("---- resolved spec")[1].split("---- sbatch")[0]
    assert not (tmp_path / "logs").exists()


def test_status_points_at_the_programs_output() -> None:
    from lance_hpc.kinds import registered_kind

    spec = validate_spec({"name": "mine", "command": ["python3", "train.py", "${name}"]}, base_dir="/project").spec
    kind = registered_kind(spec.job)
    assert kind is not None and kind.progress(spec) == [
        "job: command runs python3 train.py mine; its progress is in its output (lance-hpc logs)"
    ]


def test_a_command_job_in_a_container_starts_its_rank_and_so_its_program_inside_the_image() -> None:
    raw = {"name": "boxed", "command": ["python3", "train.py"], "slurm": {"container": {"image": "/images/train.sif"}}}
    script = render.render_sbatch(validate_spec(raw, base_dir="/project").spec, "/s.yaml")
    words = shlex.split(script.rstrip().split("\n")[-1])
    assert words[words.index("apptainer") :][:2] == ["apptainer", "exec"]
    assert words[-5:] == ["python3", "-P", "-m", "lance_hpc.run", "/s.yaml"]  # the rank, in the image, starts the program


# --- local runs -------------------------------------------------------------------------------


def lance_hpc(args: list[str], cwd: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **environ}
    return subprocess.run(
        [sys.executable, "-m", "lance_hpc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def write_job(tmp_path: Path, mode: str, **command: Any) -> Path:
    (tmp_path / "prog.py").write_text(PROGRAM)
    spec = {"name": "mine", "command": {"argv": ["python3", "prog.py", "out", mode, "${lr}"], "options": {"lr": 0.5}, **command}}
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "out"


def test_each_local_rank_gets_torchruns_variables_and_they_form_a_process_group(tmp_path: Path) -> None:
    out = write_job(tmp_path, "meet")
    result = lance_hpc(["submit", "job.yaml", "--local", "--nproc", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((out / f"rank-{rank}-0.json").read_text()) for rank in (0, 1)]
    for rank, values in enumerate(seen):
        assert values["RANK"] == values["LOCAL_RANK"] == str(rank)
        assert (values["WORLD_SIZE"], values["LOCAL_WORLD_SIZE"], values["NODE_RANK"], values["GROUP_RANK"]) == (
            "2",
            "2",
            "0",
            "0",
        )
        assert values["MASTER_ADDR"] == "127.0.0.1" and values["MASTER_PORT"] == seen[0]["MASTER_PORT"]
        assert (values["TORCHELASTIC_RESTART_COUNT"], values["LANCE_HPC_RUN_COUNT"]) == ("0", "0")
        assert values["LANCE_HPC_OPTION_LR"] == "0.5" and values["argv"] == ["out", "meet", "0.5"]
        assert values["cwd"] == str(tmp_path) and values["PYTHONSAFEPATH"] is None  # `python train.py` imports beside it
        assert values["world"] == 2


def test_a_program_that_fails_restarts_and_knows_it_is_a_rerun(tmp_path: Path) -> None:
    out = write_job(tmp_path, "fail-first")
    result = lance_hpc(["submit", "job.yaml", "--local", "--nproc", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "exited with code 7" in result.stderr
    values = json.loads((out / "rank-0-1.json").read_text())
    assert (values["TORCHELASTIC_RESTART_COUNT"], values["LANCE_HPC_RUN_COUNT"]) == ("1", "1")


def test_slurms_warning_reaches_the_program_as_its_signal_and_a_requeued_run_knows_it(tmp_path: Path) -> None:
    out = write_job(tmp_path, "wait", signal="USR1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lance_hpc", "submit", "job.yaml", "--local", "--nproc", "2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not all((out / f"waiting-{rank}-0").exists() for rank in (0, 1)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        for rank in (0, 1):  # SLURM's warning goes to every task; here, to each rank's own process
            os.kill(int((out / f"waiting-{rank}-0").read_text()), signal.SIGUSR2)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert [(out / f"signal-{rank}-0").read_text() for rank in (0, 1)] == ["SIGUSR1", "SIGUSR1"]
    assert launcher.returncode == 3, stderr  # no queue to go back to here: stopped, to be run again
    assert "the program stopped on SIGUSR2" in stdout
    write_job(tmp_path, "meet", signal="USR1")
    rerun = lance_hpc(["submit", "job.yaml", "--local", "--nproc", "1"], tmp_path, SLURM_RESTART_COUNT="1")  # as requeued
    assert rerun.returncode == 0, rerun.stderr
    values = json.loads((out / "rank-0-1.json").read_text())
    assert (values["SLURM_RESTART_COUNT"], values["LANCE_HPC_RUN_COUNT"], values["TORCHELASTIC_RESTART_COUNT"]) == ("1", "1", "0")


def test_a_program_that_is_not_there_fails_the_job_at_once_with_its_name(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"name": "mine", "command": ["./no-such-program", "--x"]}))
    result = lance_hpc(["submit", "job.yaml", "--local", "--nproc", "2"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "'./no-such-program' is not an executable file" in result.stderr
    assert "restart" not in result.stderr.replace("no restart can help", "")  # one attempt


def test_a_script_without_its_interpreter_line_fails_the_job_at_once_saying_how_to_start_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('never runs')\n")
    (tmp_path / "train.py").chmod(0o755)  # executable, but no #! line: the kernel cannot start it
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"name": "mine", "command": ["./train.py"]}))
    result = lance_hpc(["submit", "job.yaml", "--local", "--nproc", "1"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "program './train.py' could not be started: Exec format error" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "[python3, train.py]" in result.stderr, result.stderr


def test_a_program_killed_by_a_signal_without_a_name_is_said_by_its_number() -> None:
    from lance_hpc.kinds.command import signal_name

    assert (signal_name(9), signal_name(35)) == ("SIGKILL", "signal 35")


# --- on the SLURM test cluster ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.slurm
def test_a_command_job_on_two_nodes_gets_its_ranks_and_is_requeued_on_the_warning(slurm_cluster: Any, tmp_path: Path) -> None:
    """2 tasks on 2 nodes: each program records its variables and meets the other over them; USR2
    to the job's step reaches each as TERM, rank 0 requeues the job, and the rerun's programs know it."""
    from tests.support.slurm import environ, job_log, sbatch, signal_steps

    (tmp_path / "prog.py").write_text(PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    raw = {
        "name": "command-slurm",
        "slurm": {
            "partition": slurm_cluster.partition,
            "nodes": 2,
            "tasks_per_node": 1,
            "cpus_per_task": 1,
            "time": "00:10:00",
            "max_requeues": 2,
            "log_dir": str(tmp_path / "logs"),
        },
        "command": [sys.executable, str(tmp_path / "prog.py"), str(out), "slurm"],
    }
    spec = validate_spec(raw).spec
    job_id = sbatch(slurm_cluster, spec)
    deadline = time.monotonic() + 300
    while not all((out / f"waiting-{rank}-0").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline, job_log(slurm_cluster, job_id)
        time.sleep(0.5)
    signal_steps(environ(slurm_cluster), job_id)
    while not all((out / f"rank-{rank}-1.json").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline + 300, job_log(slurm_cluster, job_id)
        time.sleep(0.5)
    first = [json.loads((out / f"rank-{rank}-0.json").read_text()) for rank in (0, 1)]
    again = [json.loads((out / f"rank-{rank}-1.json").read_text()) for rank in (0, 1)]
    for rank, values in enumerate(first):
        assert (values["RANK"], values["LOCAL_RANK"], values["NODE_RANK"], values["WORLD_SIZE"]) == (
            str(rank),
            "0",
            str(rank),
            "2",
        )
        assert values["LOCAL_WORLD_SIZE"] == "1" and values["world"] == 2 and values["MASTER_PORT"] == first[0]["MASTER_PORT"]
        assert (out / f"signal-{rank}-0").read_text() == "SIGTERM"  # USR2 reached the program as command.signal
    for values in again:
        assert (values["SLURM_RESTART_COUNT"], values["LANCE_HPC_RUN_COUNT"]) == ("1", "1") and values["world"] == 2


@pytest.mark.slow
@pytest.mark.slurm
def test_the_torchrun_example_requeued_by_usr2_on_the_cluster_trains_every_row_once(slurm_cluster: Any, tmp_path: Path) -> None:
    """examples/torchrun_ddp.py as a command job on 2 nodes: SLURM's warning (USR2) reaches it as
    TERM, both ranks save after the same step and exit, rank 0 requeues the job, and the requeued
    run resumes from that checkpoint: every row of the epoch trained on once, over both runs."""
    import collections

    from tests.support.slurm import environ, job_log, sbatch, signal_steps, wait_for_runs
    from tests.test_loader_library import write_rows

    uri = write_rows(str(tmp_path / "rows.lance"), [200, 200, 100])  # 250 rows a rank: 32 steps of 8
    logs = tmp_path / "rows"
    logs.mkdir()
    argv = [sys.executable, str(ROOT / "examples" / "torchrun_ddp.py"), "--data", uri, "--workers", "1"]
    argv += ["--checkpoint", str(tmp_path / "ckpt.pt"), "--rows-log", str(logs), "--save-every", "1000", "--step-seconds", "0.3"]
    slurm = {"partition": slurm_cluster.partition, "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1}
    slurm |= {"time": "00:10:00", "max_requeues": 2, "log_dir": str(tmp_path / "logs")}
    spec = validate_spec({"name": "torchrun-slurm", "slurm": slurm, "command": argv}).spec
    job_id = sbatch(slurm_cluster, spec)
    deadline = time.monotonic() + 300
    while not any(path.stat().st_size for path in logs.iterdir()):  # training has begun
        assert time.monotonic() < deadline, job_log(slurm_cluster, job_id)
        time.sleep(0.2)
    signal_steps(environ(slurm_cluster), job_id)
    states = wait_for_runs(slurm_cluster, [job_id], timeout_s=400)
    assert states[job_id] == "COMPLETED", job_log(slurm_cluster, job_id)
    rows = [int(row) for path in logs.iterdir() for line in path.read_text().splitlines() for row in line.split()[1:]]
    counts = collections.Counter(rows)
    assert sorted(counts.values()) == [1] * 500, f"rows trained on other than once: {job_log(slurm_cluster, job_id)}"
    steps = [len(path.read_text().splitlines()) for path in sorted(logs.iterdir())]
    assert steps == [32, 32], steps  # both ranks, the same steps, over the stopped run and the requeued one
    assert "requeue" in job_log(slurm_cluster, job_id, lines=200).lower(), job_log(slurm_cluster, job_id, lines=200)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_command_job_submitted_through_submitit_runs_and_status_and_logs_follow_it(slurm_cluster: Any, tmp_path: Path) -> None:
    """The same command job through ``lance-hpc submit`` (submitit): both tasks get their ranks and
    meet in the directory submit ran in; ``lance-hpc status`` and ``lance-hpc logs`` of its spec show it."""
    import re

    from tests.support.jobs import REPO_ROOT
    from tests.support.slurm import job_log, wait_for_runs
    from tests.support.slurm import lance_hpc as cluster_cli

    (tmp_path / "prog.py").write_text(PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    slurm = {"partition": slurm_cluster.partition, "nodes": 2, "tasks_per_node": 1, "cpus_per_task": 1}
    slurm |= {"time": "00:10:00", "log_dir": str(tmp_path / "logs")}
    raw = {"name": "command-submitit", "slurm": slurm, "command": [sys.executable, str(tmp_path / "prog.py"), str(out), "meet"]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    submitted = cluster_cli(slurm_cluster, "submit", str(tmp_path / "job.yaml")).stdout
    job_id = re.search(r"submitted job (\d+)", submitted).group(1)  # type: ignore[union-attr]
    assert wait_for_runs(slurm_cluster, [job_id], 300)[job_id] == "COMPLETED", job_log(slurm_cluster, job_id)
    seen = [json.loads((out / f"rank-{rank}-0.json").read_text()) for rank in (0, 1)]
    assert [(values["RANK"], values["NODE_RANK"], values["world"]) for values in seen] == [("0", "0", 2), ("1", "1", 2)]
    assert all(values["cwd"] == str(REPO_ROOT) for values in seen)  # the directory submit ran in
    status = cluster_cli(slurm_cluster, "status", str(tmp_path / "job.yaml")).stdout
    assert job_id in status and "COMPLETED" in status, status
    logs = cluster_cli(slurm_cluster, "logs", str(tmp_path / "job.yaml"))
    assert job_id in logs.stdout + logs.stderr, logs.stdout + logs.stderr
