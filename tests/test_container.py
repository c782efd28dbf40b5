"""Containers: golden scripts for both runtimes, validation of slurm.container, the requeue handler
the script runs outside the container, and on the real SLURM cluster a job run through a stand-in
``apptainer`` (no scontrol inside) that is preempted by USR2, requeued by its batch script and
resumed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lance_hpc.errors import UserError
from lance_hpc.launch import render
from lance_hpc.loading import build_train_loader, load_task
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.runtime.preemption import requeue_sbatch
from lance_hpc.runtime.restart_variables import REQUEUE_REQUEST_VARIABLE
from lance_hpc.spec import JobSpec, SpecError, load_spec, validate_spec
from tests.support.jobs import REPO_ROOT, Digits, final_state, write_spec
from tests.support.ports import free_port
from tests.support.render import check_golden, write_restarts_program
from tests.support.slurm import job_fields, signal_steps, wait_for_runs, wait_for_text
from tests.support.slurm_cluster import SlurmCluster

CONTAINER: dict[str, Any] = {
    "image": "/images/train.sif",
    "mounts": ["/scratch:/scratch", "/datasets:/data:ro"],
    "workdir": "/scratch/run",
}


def spec_with(container: dict[str, Any], **slurm: Any) -> JobSpec:
    raw = {
        "name": "boxed",
        "data": {"uri": "/data/train.lance"},
        "slurm": {"nodes": 2, "gpus_per_node": 4, "log_dir": "/scratch/logs", "container": container, **slurm},
    }
    return validate_spec(raw, base_dir="/project").spec


@pytest.mark.parametrize("runtime", ["apptainer", "pyxis"])
def test_container_scripts_match_golden(runtime: str) -> None:
    spec = spec_with({**CONTAINER, "runtime": runtime})
    check_golden(f"container-{runtime}.sbatch", render.render_sbatch(spec, "/scratch/logs/boxed.spec.yaml"))


def test_apptainer_runs_python_inside_the_image() -> None:
    script = render.render_sbatch(spec_with(CONTAINER), "/s.yaml")
    words = shlex.split(script.rstrip().split("\n")[-1])
    assert words[words.index("apptainer"):] == [
        "apptainer", "exec", "--nv", "--bind=/scratch:/scratch,/datasets:/data:ro", "--pwd=/scratch/run",
        "/images/train.sif", "python3", "-P", "-m", "lance_hpc.run", "/s.yaml",
    ]  # fmt: skip
    cpu = render.render_sbatch(spec_with({"image": "/i.sif"}, gpus_per_node=0), "/s.yaml")
    assert shlex.split(cpu.rstrip().split("\n")[-1])[-7:] == ["exec", "/i.sif", "python3", "-P", "-m", "lance_hpc.run", "/s.yaml"]


def test_pyxis_passes_the_image_to_srun() -> None:
    script = render.render_sbatch(spec_with({**CONTAINER, "runtime": "pyxis"}), "/s.yaml")
    words = shlex.split(script.rstrip().split("\n")[-1])
    assert words[0] == "srun" and words[-5:] == ["python3", "-P", "-m", "lance_hpc.run", "/s.yaml"]
    assert {
        "--container-image=/images/train.sif",
        "--container-mounts=/scratch:/scratch,/datasets:/data:ro",
        "--container-workdir=/scratch/run",
    } <= set(words)


@pytest.mark.parametrize(
    ("container", "path", "message", "fix"),
    [
        (
            {"image": "/i.sif", "runtime": "docker"},
            "slurm.container.runtime",
            "'docker' is not a valid choice",
            "apptainer, pyxis",
        ),
        ({"runtime": "pyxis"}, "slurm.container.image", "required key is missing", "add 'image: ...'"),
        ({"image": ""}, "slurm.container.image", "must not be empty", "image"),
        (
            {"image": "/i.sif", "mounts": ["data:/data"]},
            "slurm.container.mounts",
            "mount 'data:/data' is not /host/path",
            "absolute paths",
        ),
        ({"image": "/i.sif", "mounts": ["/a,/b"]}, "slurm.container.mounts", "is not /host/path", "without commas"),
        ({"image": "/i.sif", "mounts": ["/a:/b:rx"]}, "slurm.container.mounts", "is not /host/path", ":ro"),
        ({"image": "/i.sif", "mount": ["/a"]}, "slurm.container.mount", "unknown key 'mount'", "did you mean 'mounts'?"),
        ("/i.sif", "slurm.container", "", ""),
    ],
)
def test_bad_container_settings_name_the_yaml_path_and_the_fix(container: Any, path: str, message: str, fix: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec_with(container)
    found = [(problem.path, problem.message, problem.fix) for problem in caught.value.problems]
    assert any(p == path and message in m and fix in f for p, m, f in found), found


def test_container_values_with_control_characters_are_refused() -> None:
    with pytest.raises(SpecError, match="slurm.container.image"):
        render.render_sbatch(spec_with({"image": "/i.sif\ntouch /tmp/x"}), "/s.yaml")


def test_a_site_template_without_the_requeue_handler_is_refused(tmp_path: Path) -> None:
    template = tmp_path / "site.j2"
    template.write_text("#!/bin/bash\n{% for line in sbatch_lines %}\n{{ line }}\n{% endfor %}\n{{ launch }}\n")
    with pytest.raises(UserError, match="leaves out the requeue handler"):
        render.render_sbatch(spec_with(CONTAINER, template=str(template)), "/s.yaml")
    template.write_text(
        template.read_text().replace("{{ launch }}", "{% for line in requeue_handler %}\n{{ line }}\n{% endfor %}\n{{ launch }}")
    )
    assert "trap requeue_if_asked EXIT" in render.render_sbatch(spec_with(CONTAINER, template=str(template)), "/s.yaml")


# ---- the requeue handler, run with bash ---------------------------------------------------------


def run_script_with_shims(
    spec: JobSpec, tmp_path: Path, srun_body: str, **variables: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the rendered script for a job whose srun shim runs ``srun_body``; returns the result
    and the scontrol calls the script made."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    (shims / "srun").write_text(f"#!/bin/bash\n{srun_body}\n")
    (shims / "scontrol").write_text(f'#!/bin/bash\necho "$*" >> {shlex.quote(str(tmp_path / "scontrol.calls"))}\n')
    (shims / "sleep").write_text('#!/bin/bash\necho "sleep $*"\n')  # the script waits for SLURM to end it
    for shim in shims.iterdir():
        shim.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render.render_sbatch(spec, "/s/{index}.yaml" if spec.sweep else "/s.yaml"))
    write_restarts_program(spec)
    environ = {"PATH": f"{shims}:{os.environ['PATH']}", "SLURM_JOB_ID": "73", **variables}
    result = subprocess.run(["bash", str(script)], env=environ, capture_output=True, text=True, timeout=30)
    calls = tmp_path / "scontrol.calls"
    # the restart supervisor's questions (scontrol show job) left out: these tests are about requeues
    return result, [call for call in calls.read_text().splitlines() if not call.startswith("show ")] if calls.exists() else []


def test_the_script_requeues_a_run_of_an_array_when_rank_0_asks(tmp_path: Path) -> None:
    spec = validate_spec(
        {
            "name": "boxed",
            "data": {"uri": "/d"},
            "sweep": {"train.lr": [0.1, 0.05]},
            "slurm": {"log_dir": str(tmp_path), "container": {"image": "/i.sif"}, "max_requeues": 2},
        }
    ).spec
    asks = f'touch "${REQUEUE_REQUEST_VARIABLE}"'  # what rank 0 does inside the container
    result, calls = run_script_with_shims(
        spec, tmp_path, asks, SLURM_ARRAY_JOB_ID="70", SLURM_ARRAY_TASK_ID="1", SLURM_RESTART_COUNT="1"
    )
    assert result.returncode == 0, result.stderr
    assert calls == ["requeue 70_1"]  # the run itself, not the array 70
    assert "requeueing job 70_1 (requeue 2 of at most 2)" in result.stdout
    assert "sleep 300" in result.stdout  # until SLURM ends the script, as it does when it requeues a job
    assert not (tmp_path / "requeue-73").exists()  # the request is used up


def test_the_script_leaves_a_job_alone_unless_asked_even_when_srun_fails(tmp_path: Path) -> None:
    spec = spec_with({"image": "/i.sif"}, log_dir=str(tmp_path))
    result, calls = run_script_with_shims(spec, tmp_path, "exit 0")
    assert result.returncode == 0 and calls == []
    result, calls = run_script_with_shims(spec, tmp_path, "exit 1")
    assert result.returncode == 1 and calls == []
    # a submitit task that asked for a requeue exits with an error; the script still requeues it
    result, calls = run_script_with_shims(spec, tmp_path, f'touch "${REQUEUE_REQUEST_VARIABLE}"; exit 255')
    assert calls == ["requeue 73"] and "requeueing job 73 (requeue 1 of at most 3)" in result.stdout


def slurm_env(**fields: Any) -> DistEnv:
    return DistEnv("slurm", 0, 0, 2, 2, 0, 1, "node1", 23456, **fields)


def test_rank_0_in_a_container_asks_instead_of_calling_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere: the request must not need it
    request = tmp_path / "requeue-73"
    env = slurm_env(job_id="73", restart_count=0, array_job_id="70", array_task_id="1")
    assert requeue_sbatch(env, 3, str(request)) == (True, "asked the batch script to requeue job 70_1 (requeue 1 of at most 3)")
    assert request.read_text() == "70_1\n"
    request.unlink()
    requeued, message = requeue_sbatch(slurm_env(job_id="73", restart_count=3), 3, str(request))
    assert not requeued and "requeued 3 times already (slurm.max_requeues: 3)" in message and not request.exists()
    requeued, message = requeue_sbatch(slurm_env(job_id="73"), 3, str(tmp_path / "missing" / "requeue-73"))
    assert not requeued and "mount slurm.log_dir in the container at the same path" in message


# ---- the real SLURM cluster, with a stand-in apptainer ------------------------------------------

FAKE_APPTAINER = """#!/bin/bash
# Stands in for apptainer: records how it was called, then runs the command after the image with
# a PATH that has python but no SLURM commands, as inside an image.
printf '%s\\n' "$(printf '%q ' "$@")" >> {record}
shift  # exec
while [[ "$1" == --* ]]; do
    case "$1" in --pwd=*) cd "${{1#--pwd=}}" ;; esac
    shift
done
shift  # the image
export PATH={python_dir}
exec "$@"
"""


@pytest.mark.slow
@pytest.mark.slurm
def test_apptainer_job_is_preempted_requeued_by_its_script_and_resumes(
    slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path
) -> None:
    shims = tmp_path / "bin"
    shims.mkdir()
    record = tmp_path / "apptainer.calls"
    apptainer = shims / "apptainer"
    apptainer.write_text(
        FAKE_APPTAINER.format(record=shlex.quote(str(record)), python_dir=shlex.quote(str(Path(sys.executable).parent)))
    )
    apptainer.chmod(0o755)
    assert not (Path(sys.executable).parent / "scontrol").exists()

    container = {"image": "/images/lance-hpc.sif", "mounts": [f"{tmp_path}:{tmp_path}"], "workdir": str(REPO_ROOT)}
    slurm = {
        "partition": slurm_cluster.partition,
        "nodes": 1,
        "tasks_per_node": 2,
        "cpus_per_task": 1,
        "time": "00:15:00",
        "max_requeues": 2,
        "container": container,
    }
    spec_path = write_spec(
        tmp_path,
        digits,
        name="boxed",
        slurm=slurm,
        train={"epochs": 8},
        logging={"log_every_steps": 1, "progress": False},
        checkpoint={"every_steps": 200, "keep": 3},
    )
    spec = load_spec(spec_path).spec
    spec_file, script = render.write_job_files(spec)
    # A port of our own: the port derived from the job id would be the same for job 1 of every
    # test cluster that other sessions run on this machine at the same time.
    environ = {
        **os.environ,
        **slurm_cluster.env,
        "PYTHONPATH": str(REPO_ROOT),
        "PATH": f"{shims}:{os.environ['PATH']}",
        "MASTER_PORT": str(free_port()),
    }
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=environ, cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    job_id = submitted.stdout.strip().split(";")[0]
    log = Path(spec.slurm.log_dir) / f"boxed-{job_id}.out"
    wait_for_text(log, "step 50/")  # early in epoch 2 of 44-step epochs
    signal_steps(environ, job_id)
    states = wait_for_runs(slurm_cluster, [job_id], 900)
    output = log.read_text() + (Path(spec.slurm.log_dir) / f"boxed-{job_id}.err").read_text()
    assert states == {job_id: "COMPLETED"}, output
    assert job_fields(slurm_cluster, job_id)["Restarts"] == "1", output
    assert f"asked the batch script to requeue job {job_id} (requeue 1 of at most 2)" in output
    assert f"requeueing job {job_id} (requeue 1 of at most 2)" in output and "restart 1" in output
    assert re.search(r"stopped at step \d+ by SIGUSR2; checkpoint \S+?;", output) and "resuming from" in output
    steps_per_epoch = build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch
    assert final_state(tmp_path)["step"] == 8 * steps_per_epoch

    expected = [
        "exec",
        f"--bind={tmp_path}:{tmp_path}",
        f"--pwd={REPO_ROOT}",
        "/images/lance-hpc.sif",
        "python3",
        "-P",
        "-m",
        "lance_hpc.run",
        str(spec_file),
    ]
    calls = [shlex.split(line) for line in record.read_text().splitlines()]
    assert calls == [expected] * 4  # 2 tasks, before and after the requeue
