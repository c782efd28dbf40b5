"""Sweeps: parsing --sweep and the sweep section, the cartesian product, errors with their YAML
paths, the files a sweep writes, dry run and local runs; on the real SLURM cluster, a 4-run job
array in which every run trains, checkpoints and logs on its own, and a preempted run requeues
itself alone and resumes, and a sweep submitted through submitit's default path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lance_hpc.checkpoint.stores import open_store
from lance_hpc.cli import submit
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.launch import render
from lance_hpc.loading import build_train_loader, load_task
from lance_hpc.runtime.environment import detect
from lance_hpc.spec import SpecError, expand, load_spec, validate_spec
from lance_hpc.spec.sweep import combinations, parse_sweep_option
from tests.support.jobs import REPO_ROOT, Digits, hparams_logged, scalars, write_spec
from tests.support.ports import free_port
from tests.support.slurm import environ, job_fields, signal_steps, wait_for_runs, wait_for_text
from tests.support.slurm_cluster import SlurmCluster

BASE: dict[str, Any] = {
    "name": "lr-sweep",
    "data": {"uri": "/d"},
    "checkpoint": {"dir": "/ck/{name}"},
    "logging": {"tensorboard_dir": "/tb/{name}"},
    "slurm": {"log_dir": "/logs/{name}"},
}


def sweep_spec(sweep: dict[str, Any] | None = None, options: tuple[str, ...] = (), **extra: Any):
    return validate_spec({**BASE, **extra, **({"sweep": sweep} if sweep is not None else {})}, sweeps=options).spec


def problems_of(sweep: Any = None, options: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    with pytest.raises(SpecError) as caught:
        sweep_spec(sweep, options)
    return [(problem.path, problem.message, problem.fix) for problem in caught.value.problems]


# ---- parsing and the product -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "parsed"),
    [
        ("train.lr=0.1,0.05", ("train.lr", [0.1, 0.05])),
        ("data.batch_size=64", ("data.batch_size", [64])),
        ("data.shuffle=true,false", ("data.shuffle", [True, False])),
        ("task.options.model=small_cnn,resnet18", ("task.options.model", ["small_cnn", "resnet18"])),
        ("data.storage_options=[{region: a}, {region: b}]", ("data.storage_options", [{"region": "a"}, {"region": "b"}])),
    ],
)
def test_sweep_options_parse_as_yaml_values(option: str, parsed: tuple[str, list[Any]]) -> None:
    assert parse_sweep_option(option) == parsed


def test_runs_are_the_cartesian_product_first_key_slowest() -> None:
    spec = sweep_spec({"train.lr": [0.1, 0.05]}, ("data.batch_size=64,128,256",))
    runs = expand(spec)
    assert [run.values for run in runs] == combinations({"train.lr": [0.1, 0.05], "data.batch_size": [64, 128, 256]})
    assert [(run.spec.train.lr, run.spec.data.batch_size) for run in runs] == [
        (0.1, 64), (0.1, 128), (0.1, 256), (0.05, 64), (0.05, 128), (0.05, 256)
    ]  # fmt: skip
    assert [run.index for run in runs] == list(range(6))
    assert runs[2].spec.name == "lr-sweep-lr0.1-batch_size256"
    for run in runs:
        assert run.spec.checkpoint.dir == f"/ck/lr-sweep/{run.spec.name}"
        assert run.spec.logging.tensorboard_dir == f"/tb/lr-sweep/{run.spec.name}"
        assert run.spec.slurm.log_dir == "/logs/lr-sweep" and run.spec.sweep == {}
        # everything else is the sweep's own spec
        rest = {**run.spec.to_dict(), "name": None, "checkpoint": None, "logging": None, "train": None, "data": None}
        assert rest == {
            **spec.to_dict(),
            "name": None,
            "checkpoint": None,
            "logging": None,
            "train": None,
            "data": None,
            "sweep": {},
        }


def test_an_option_replaces_the_same_key_of_the_spec_and_keeps_the_order() -> None:
    spec = sweep_spec({"train.lr": [0.1, 0.05], "train.seed": [0, 1]}, ("train.lr=0.2",))
    assert spec.sweep == {"train.lr": [0.2], "train.seed": [0, 1]}
    assert [run.spec.name for run in expand(spec)] == ["lr-sweep-lr0.2-seed0", "lr-sweep-lr0.2-seed1"]


def test_names_fall_back_to_indices_when_values_would_clash() -> None:
    runs = expand(sweep_spec({"data.storage_options.region": ["a/b", "a_b"]}))  # both would be named region-a_b
    assert [run.spec.name for run in runs] == ["lr-sweep-0", "lr-sweep-1"]


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sweep", "path", "message", "fix"),
    [
        ({"train.lrr": [0.1]}, "sweep.train.lrr", "'train.lrr' is not a field of the job spec", "did you mean 'train.lr'?"),
        ({"trian.lr": [0.1]}, "sweep.trian.lr", "is not a field", "did you mean 'train.lr'?"),
        ({"slurm.nodes": [1, 2]}, "sweep.slurm.nodes", "share one sbatch script", "submit a second job"),
        ({"name": ["a"]}, "sweep.name", "cannot be swept", "rename the sweep"),
        ({"checkpoint.dir": ["/x"]}, "sweep.checkpoint.dir", "own subdirectory of checkpoint.dir", "set checkpoint.dir once"),
        ({"train": [1]}, "sweep.train", "is a whole section", "name a field, e.g. train.epochs"),
        ({"train.lr.x": [1]}, "sweep.train.lr.x", "'train.lr' is a value, not a section", "sweep over train.lr itself"),
        ({"train.lr": 0.1}, "sweep.train.lr", "expected a list of values, got 0.1", "train.lr: [0.1, ...]"),
        ({"train.lr": []}, "sweep.train.lr", "expected a list of values", ""),
        ({"train.lr": [0.1, 0.1]}, "sweep.train.lr", "0.1 listed twice", "list each value once"),
        ({"data.batch_size": [64, 0]}, "sweep.data.batch_size", "value 0: must be >= 1, got 0", "set a value >= 1"),
        ({"train.optimizer": ["sgd", "lamb"]}, "sweep.train.optimizer", "value lamb: 'lamb' is not a valid choice", "sgd, adamw"),
        (
            {"data.sampler": ["sharded_batch"]},
            "sweep.data.sampler",
            "value sharded_batch: sampler 'sharded_batch' does not",
            "with style 'map' use",
        ),
        (
            {"data.style": ["iterable"]},
            "sweep",
            "run lr-sweep-styleiterable: data.sampler: sampler 'distributed' does not work",
            "sharded_batch",
        ),
        ([0.1], "sweep", "must map spec fields to lists of values", "sweep: {train.lr: [0.1, 0.05]}"),
    ],
)
def test_bad_sweeps_name_the_yaml_path_and_the_fix(sweep: Any, path: str, message: str, fix: str) -> None:
    found = problems_of(sweep)
    assert any(p == path and message in m and fix in f for p, m, f in found), found


def test_every_sweep_problem_is_reported_at_once() -> None:
    found = problems_of({"train.lrr": [1], "train.lr": [-1, 0.1], "slurm.time": ["10"]}, ("data.batch_size", "x=[1,"))
    assert {path for path, _, _ in found} == {"sweep.train.lrr", "sweep.slurm.time", "--sweep data.batch_size", "--sweep x=[1,"}
    # a run's values are checked once the sweep's shape is right
    assert [path for path, _, _ in problems_of({"train.lr": [-1, 0.1]})] == ["sweep.train.lr"]


def test_too_many_runs_for_a_job_array() -> None:
    found = problems_of({"train.seed": list(range(40)), "data.seed": list(range(30))})
    assert found == [
        (
            "sweep",
            "1200 runs are more than a SLURM job array holds by default (1001)",
            "sweep fewer values, or split the sweep into several specs",
        )
    ]


def test_array_flag_is_not_an_extra_flag() -> None:
    spec = sweep_spec({"train.lr": [0.1]}, slurm={"extra_flags": {"array": "0-9"}})
    with pytest.raises(UserError, match="--array is set from sweep"):
        render.render_sbatch(spec, "/x/{index}.spec.yaml")


# ---- rendering and the files a sweep writes ----------------------------------------------------


def test_array_range_respects_array_parallelism() -> None:
    assert render.array_range(sweep_spec({"train.seed": [0, 1, 2, 3, 4]}, slurm={"array_parallelism": 2})) == "0-4%2"
    assert render.array_range(sweep_spec({"train.seed": [0, 1]}, slurm={"array_parallelism": 8})) == "0-1%2"
    assert render.array_range(sweep_spec()) is None


def test_render_only_writes_one_spec_per_run_and_one_array_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(
        yaml.safe_dump({**BASE, "slurm": {"log_dir": str(tmp_path / "logs")}, "sweep": {"train.lr": [0.1, 0.05]}})
    )
    assert submit.main([str(spec_path), "--render-only", "--sweep", "train.seed=1,2"]) == 0
    logs = tmp_path / "logs"
    assert f"(its tasks read {logs}/lr-sweep.sweep/{{index}}.spec.yaml)" in capsys.readouterr().out
    written = sorted(path.name for path in (logs / "lr-sweep.sweep").iterdir())
    assert written == ["0.spec.yaml", "1.spec.yaml", "2.spec.yaml", "3.spec.yaml"]
    runs = expand(load_spec(logs / "lr-sweep.spec.yaml").spec)  # the sweep's own resolved spec, written beside
    for run in runs:
        assert load_spec(logs / "lr-sweep.sweep" / f"{run.index}.spec.yaml").spec == run.spec
    script = (logs / "lr-sweep.sbatch").read_text()
    flags = dict(render.sbatch_directives(script))
    assert flags["array"] == "0-3%4" and flags["output"] == f"{logs}/lr-sweep-%A_%a.out"


def test_the_script_starts_the_spec_of_its_array_task(tmp_path: Path) -> None:
    """Run the rendered array script with bash for task 2; srun is a shim that runs its command
    line's last word through the shell as the real one would hand it to the task."""
    spec = sweep_spec({"train.lr": [0.1, 0.05, 0.01]}, slurm={"log_dir": str(tmp_path / "a b")})
    _, script_path = render.write_job_files(spec)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS_FILE"\n')
    (shims / "srun").chmod(0o755)
    environ = {
        "PATH": f"{shims}:{os.environ['PATH']}",
        "SRUN_ARGS_FILE": str(tmp_path / "srun.args"),
        "SLURM_ARRAY_JOB_ID": "70",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_ID": "73",
    }
    result = subprocess.run(["bash", str(script_path)], env=environ, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "job 70_2 (restart 0)" in result.stdout
    spec_file = (tmp_path / "srun.args").read_text().splitlines()[-1]
    assert spec_file == f"{tmp_path}/a b/lr-sweep.sweep/2.spec.yaml"
    assert load_spec(spec_file).spec.train.lr == 0.01


def test_an_array_run_is_requeued_by_its_own_id() -> None:
    environ = {
        "SLURM_JOB_ID": "73",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_ARRAY_JOB_ID": "70",
        "SLURM_ARRAY_TASK_ID": "2",
    }
    assert detect(environ).job_ref == "70_2"
    assert detect({key: value for key, value in environ.items() if "ARRAY" not in key}).job_ref == "73"


def test_dry_run_lists_the_runs_and_what_sets_them_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "s", "data": {"uri": "/d"}, "sweep": {"train.lr": [0.1, 0.05]}}))
    before = sorted(tmp_path.rglob("*"))
    assert submit.main([str(spec_path), "--dry-run", "--sweep", "data.batch_size=64,128"]) == 0
    out = capsys.readouterr().out
    assert "# sweep: 4 runs as one job array (--array=0-3%4: at most 4 at once)" in out
    assert re.search(r"\[3\] s-lr0\.05-batch_size128 +train\.lr=0\.05 data\.batch_size=128", out)
    assert f"tensorboard --logdir {tmp_path}/runs/s  (HParams tab)" in out
    assert "#SBATCH --array=0-3%4" in out and "nothing written, nothing submitted" in out
    assert sorted(tmp_path.rglob("*")) == before


def test_local_runs_every_run_in_turn_and_goes_on_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """run_local is replaced by a recorder here; test_sweep_trains_locally runs the real thing."""
    import lance_hpc.launch.local

    started: list[tuple[str, int]] = []

    def fake_run_local(spec_file: Path, nproc: int) -> int:
        started.append((load_spec(spec_file).spec.name, nproc))
        return 1 if len(started) == 2 else 0

    monkeypatch.setattr(lance_hpc.launch.local, "run_local", fake_run_local)
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "s", "data": {"uri": "/d"}, "slurm": {"log_dir": str(tmp_path)}}))
    assert submit.main([str(spec_path), "--local", "--nproc", "2", "--sweep", "train.seed=0,1,2"]) == 1
    assert started == [("s-seed0", 2), ("s-seed1", 2), ("s-seed2", 2)]
    out = capsys.readouterr().out
    assert "2 of 3 runs finished" in out and "[1] s-seed1: failed (exit 1)" in out and "[2] s-seed2: finished" in out


def test_local_stops_the_sweep_when_a_run_is_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lance_hpc.launch.local

    started: list[str] = []
    monkeypatch.setattr(
        lance_hpc.launch.local, "run_local", lambda spec_file, nproc: started.append(str(spec_file)) or ExitCode.STOPPED
    )
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump({"name": "s", "data": {"uri": "/d"}, "slurm": {"log_dir": str(tmp_path)}}))
    assert submit.main([str(spec_path), "--local", "--sweep", "train.seed=0,1"]) == ExitCode.STOPPED
    out = capsys.readouterr().out
    assert len(started) == 1 and "[0] s-seed0: stopped; run the same command again" in out and "[1] s-seed1: not started" in out


@pytest.mark.slow
def test_sweep_trains_locally(digits: Digits, tmp_path: Path) -> None:
    """Two real local runs of one rank each, a few steps: each has its own checkpoint and events."""
    spec_path = write_spec(tmp_path, digits, name="tiny", train={"epochs": 1, "max_steps": 4}, sweep={"train.lr": [0.003, 0.001]})
    result = subprocess.run(
        ["python3", "-m", "lance_hpc.submit", str(spec_path), "--local", "--nproc", "1"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 of 2 runs finished" in result.stdout
    for name, lr in (("tiny-lr0.003", 0.003), ("tiny-lr0.001", 0.001)):
        assert checkpoint_step(tmp_path / "checkpoints" / name) == 4
        assert hparams_logged(tmp_path / "runs" / name)["train.lr"] == pytest.approx(lr)


def checkpoint_step(directory: Path) -> int:
    from lance_hpc.checkpoint import resuming

    found = resuming.load_latest(open_store(directory))
    assert found is not None, f"no checkpoint in {directory}"
    return int(found.state["step"])


# ---- the real SLURM cluster --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.slurm
def test_four_run_sweep_on_the_cluster_each_run_on_its_own(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    """lr x epochs: the two 1-epoch runs are short; run 0 (3 epochs) gets USR2 early, requeues
    itself alone (ARRAYID_0) and resumes; all four end COMPLETED with their own checkpoints and
    TensorBoard events under the sweep's directories.

    Each run takes both nodes whole (1 rank on each): SLURM 22.05 may start a requeued run on
    free CPUs while the old srun is still ending, and that srun's last signal then reaches the new
    step (same step id); with whole nodes the run restarts only once the old one is gone."""
    slurm = {
        "partition": slurm_cluster.partition,
        "nodes": 2,
        "tasks_per_node": 1,
        "cpus_per_task": 1,
        "exclusive": True,
        "time": "00:15:00",
        "max_requeues": 2,
        "array_parallelism": 2,
    }
    spec_path = write_spec(
        tmp_path,
        digits,
        name="sw",
        slurm=slurm,
        train={"epochs": 1},
        logging={"log_every_steps": 1, "progress": False},
        checkpoint={"every_steps": 50, "keep": 2},
        sweep={"train.lr": [0.003, 0.001], "train.epochs": [3, 1]},
    )
    spec = load_spec(spec_path).spec
    runs = expand(spec)
    _, script = render.write_job_files(spec)
    # A port of our own (the runs never overlap): one derived from the job id would be the same
    # for the same job id of other test clusters that other sessions run on this machine.
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        env={**environ(slurm_cluster), "MASTER_PORT": str(free_port())},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    array_id = submitted.stdout.strip().split(";")[0]
    jobs = [f"{array_id}_{run.index}" for run in runs]
    logs = Path(spec.slurm.log_dir)
    long_run = runs[0]  # lr 0.003, 3 epochs (135 steps)
    assert long_run.values == {"train.lr": 0.003, "train.epochs": 3}
    wait_for_text(logs / f"sw-{jobs[0]}.out", "step 10/")
    signal_steps(environ(slurm_cluster), jobs[0])

    states = wait_for_runs(slurm_cluster, jobs, 900)
    outputs = {job: (logs / f"sw-{job}.out").read_text() + (logs / f"sw-{job}.err").read_text() for job in jobs}
    ends = "\n".join(f"== {job} {states[job]}:\n" + "\n".join(outputs[job].splitlines()[-15:]) for job in jobs)
    assert set(states.values()) == {"COMPLETED"}, ends
    restarts = {job: int(job_fields(slurm_cluster, job).get("Restarts", -1)) for job in jobs}
    # Only the preempted run was requeued, and once: the signal reached its first run alone
    assert restarts == {jobs[0]: 1, **{job: 0 for job in jobs[1:]}}, ends
    assert len(re.findall(r"stopped at step \d+ by SIGUSR2", outputs[jobs[0]])) == 1, ends
    assert f"requeued job {jobs[0]} (requeue 1 of at most 2)" in outputs[jobs[0]], ends
    assert re.search(r"stopped at step \d+ by SIGUSR2", outputs[jobs[0]]) and "resuming from" in outputs[jobs[0]]

    for run in runs:
        assert Path(run.spec.checkpoint.dir).parent == Path(spec.checkpoint.dir)
        assert Path(run.spec.logging.tensorboard_dir).parent == Path(spec.logging.tensorboard_dir)
        steps_per_epoch = build_train_loader(run.spec.data, load_task(run.spec).decoder(train=True), 0, 2).steps_per_epoch
        assert checkpoint_step(Path(run.spec.checkpoint.dir)) == run.values["train.epochs"] * steps_per_epoch
        logged = scalars(Path(run.spec.logging.tensorboard_dir))
        assert logged["train/lr"] and "val/accuracy" in logged
        assert hparams_logged(Path(run.spec.logging.tensorboard_dir))["train.lr"] == pytest.approx(run.values["train.lr"])
        assert f"job {array_id}_{run.index} (restart 0)" in outputs[f"{array_id}_{run.index}"]


@pytest.mark.slow
@pytest.mark.slurm
def test_a_sweep_submitted_through_submitit_trains_each_run_on_its_own(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    """The default path of ``lance-hpc submit --sweep``: one job array through submitit's
    executor.batch(), waited for with --wait. Two runs of one rank and 4 steps each, side by side."""
    slurm = {"partition": slurm_cluster.partition, "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "time": "00:15:00"}
    spec_path = write_spec(tmp_path, digits, name="viasubmitit", slurm=slurm, train={"epochs": 1, "max_steps": 4})
    sweep = "train.lr=0.003,0.001"
    submitted = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", str(spec_path), "--sweep", sweep, "--wait"],
        env=environ(slurm_cluster),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    array_id = re.search(r"submitted job array (\d+) \(viasubmitit: 2 runs", submitted.stdout).group(1)
    status = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "status", array_id],
        env=environ(slurm_cluster),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # by id: every run
    for run in expand(load_spec(spec_path, sweeps=[sweep]).spec):
        job = f"{array_id}_{run.index}"
        assert f"  {job:<12} {run.spec.name}  (train.lr={run.values['train.lr']})" in submitted.stdout
        assert f"job {job} finished: {{'status': 'completed', 'step': 4," in submitted.stdout, submitted.stdout
        assert f"job {job} ({run.spec.name}): COMPLETED, exit 0, restarts 0" in status.stdout, status.stdout + status.stderr
        assert f"checkpoint  step 4, epoch 1: {run.spec.checkpoint.dir}/step-00000004.pt" in status.stdout
        assert checkpoint_step(Path(run.spec.checkpoint.dir)) == 4
        assert [step for step, _ in scalars(Path(run.spec.logging.tensorboard_dir))["train/loss"]][-1] == 4
        assert hparams_logged(Path(run.spec.logging.tensorboard_dir))["train.lr"] == pytest.approx(run.values["train.lr"])


def test_a_sweep_spec_run_directly_is_refused_not_trained_as_its_base(tmp_path: Path, digits: Digits) -> None:
    spec_file = write_spec(tmp_path, digits)
    raw = yaml.safe_load(spec_file.read_text())
    raw["sweep"] = {"train.lr": [0.1, 0.01]}
    spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    finished = subprocess.run(
        [sys.executable, "-m", "lance_hpc.run", str(spec_file)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert finished.returncode == 2 and "is a sweep, not one run" in finished.stderr, finished.stderr
    assert "lance-hpc submit" in finished.stderr and "Traceback" not in finished.stderr
    assert not (tmp_path / "checkpoints").exists()
