"""Submission without a cluster: dry run, render-only, local, errors, the CLI, and the parity of the
submitit and sbatch paths. SLURM commands are shims on PATH that record how they were called."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from submitit.core.utils import DelayedSubmission

from lance_hpc.cli import submit
from lance_hpc.errors import ExitCode
from lance_hpc.launch import render, restart_script
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.submit import IGNORE_USR1
from lance_hpc.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
FULL_SPEC: dict[str, Any] = {
    "name": "full",
    "slurm": {
        "partition": "gpu", "nodes": 2, "gpus_per_node": 4, "cpus_per_task": 6, "mem_gb": 100,
        "time": "02:30:00", "account": "acct", "qos": "normal", "constraint": "a100", "exclusive": True,
        "setup": ["module load cuda", "echo 'quoted; not split'"],
        "extra_flags": {"reservation": "r1", "contiguous": True, "mail_type": "END"},
        "max_requeues": 5, "signal_delay_s": 200,
    },
    "data": {"uri": "/data/x.lance"},
}  # fmt: skip
CONTROLLER_DOWN = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"


@pytest.fixture
def shims(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch/srun/squeue/scontrol/sinfo shims: each appends its argv to calls.log; sbatch keeps a
    copy of the script it was given and answers like SLURM (or fails with $SBATCH_FAIL)."""
    directory = tmp_path / "shims"
    directory.mkdir()
    for name in ("srun", "squeue", "scontrol", "sinfo", "sacct"):
        (directory / name).write_text(f'#!/bin/bash\necho "{name} $*" >> "{directory}/calls.log"\n')
    (directory / "sbatch").write_text(
        f'#!/bin/bash\necho "sbatch $*" >> "{directory}/calls.log"\n'
        'if [ -n "$SBATCH_FAIL" ]; then echo "$SBATCH_FAIL" >&2; exit 1; fi\n'
        f'cp "$1" "{directory}/submitted.sbatch"\necho "Submitted batch job 4242"\n'
    )
    for shim in directory.iterdir():
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}:{os.environ['PATH']}")
    return directory


def write_spec(directory: Path, raw: dict[str, Any], name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(raw))
    return path


def calls(shims: Path) -> list[str]:
    log = shims / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


# ---- dry run, render-only, local --------------------------------------------------------------


def test_dry_run_prints_everything_and_touches_nothing(
    shims: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    spec_path = write_spec(tmp_path, {"name": "dry", "data": {"uri": "data/{name}.lance"}, "slurm": {"nodes": 2}})
    before = sorted(tmp_path.rglob("*"))
    assert submit.main([str(spec_path), "--dry-run", "--set", "train.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert f"data.uri: data/{{name}}.lance -> {tmp_path}/data/dry.lance" in out  # placeholder resolutions
    assert "lr: 0.01" in out  # the resolved spec, override applied
    assert "#SBATCH --nodes=2" in out and "python3 -P -m lance_hpc.run" in out  # the script
    assert "---- data plan ----\nunavailable:" in out  # no dataset and no ingest: said, not raised
    assert "nothing written, nothing submitted" in out
    assert sorted(tmp_path.rglob("*")) == before and calls(shims) == []


def test_render_only_writes_script_and_resolved_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = write_spec(tmp_path, {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "log_dir": str(tmp_path / "logs")}})
    out_file = tmp_path / "out" / "x.sbatch"
    assert submit.main([str(spec_path), "--render-only", "-o", str(out_file)]) == 0
    spec_file = tmp_path / "logs" / "full.spec.yaml"
    spec = load_spec(spec_file).spec
    assert spec == load_spec(spec_path).spec  # the job runs exactly the spec that was rendered
    assert out_file.read_text() == render.render_sbatch(spec, str(spec_file))
    assert f"sbatch {out_file}" in capsys.readouterr().out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_files_that_hold_the_spec_are_private(tmp_path: Path) -> None:
    """The spec, a sweep's run specs and the script are 0600 whatever the umask; the log directory
    lance_hpc creates is 0700."""
    log_dir = tmp_path / "new" / "logs"
    raw = {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "log_dir": str(log_dir)}, "sweep": {"train.lr": [0.1, 0.2]}}
    old_umask = os.umask(0o022)
    try:
        assert submit.main([str(write_spec(tmp_path, raw)), "--render-only"]) == 0
    finally:
        os.umask(old_umask)
    written = [
        log_dir / "full.spec.yaml",
        log_dir / "full.sbatch",
        log_dir / "full.restarts.pyz",
        log_dir / "full.sweep" / "0.spec.yaml",
        log_dir / "full.sweep" / "1.spec.yaml",
    ]
    assert {path.name: mode(path) for path in written} == {path.name: 0o600 for path in written}
    assert mode(log_dir) == mode(tmp_path / "new") == mode(log_dir / "full.sweep") == 0o700
    assert sorted(path.name for path in log_dir.iterdir()) == [
        "full.restarts.pyz",
        "full.sbatch",
        "full.spec.yaml",
        "full.sweep",
    ]  # no temp files left


def test_an_existing_log_directory_keeps_its_mode_and_links_there_are_replaced(tmp_path: Path) -> None:
    log_dir = tmp_path / "shared-logs"
    log_dir.mkdir()
    log_dir.chmod(0o2775)  # a group's shared directory: the owner's choice, kept
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not yours to overwrite")
    (log_dir / "full.spec.yaml").symlink_to(elsewhere)  # planted where the spec goes
    raw = {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "log_dir": str(log_dir)}}
    assert submit.main([str(write_spec(tmp_path, raw)), "--render-only"]) == 0
    assert mode(log_dir) == 0o2775
    assert elsewhere.read_text() == "not yours to overwrite"
    assert not (log_dir / "full.spec.yaml").is_symlink() and mode(log_dir / "full.spec.yaml") == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_job_files_are_neither_replaced_nor_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In a shared log directory the same job name must not swap someone's spec under their
    queued job, and a rank refuses a spec file another user owns."""
    from lance_hpc.cli.run import rank_main  # imports torch: only here

    log_dir = tmp_path / "shared-logs"
    raw = {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "log_dir": str(log_dir)}}
    assert submit.main([str(write_spec(tmp_path, raw)), "--render-only"]) == 0
    spec_file = log_dir / "full.spec.yaml"
    before = spec_file.read_text()
    os.chown(spec_file, 12345, -1)
    capsys.readouterr()
    assert submit.main([str(write_spec(tmp_path, {**raw, "train": {"lr": 0.5}})), "--render-only"]) == 2
    err = capsys.readouterr().err
    assert f"{spec_file} belongs to uid 12345, not to you" in err and "fix: set another slurm.log_dir" in err
    assert spec_file.read_text() == before and spec_file.stat().st_uid == 12345
    assert rank_main([str(spec_file)]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    assert f"{spec_file} belongs to uid 12345" in err and "never runs code from a file another user owns" in err


def test_a_log_directory_that_cannot_be_written_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    raw = {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "log_dir": str(tmp_path / "file" / "logs")}}
    assert submit.main([str(write_spec(tmp_path, raw)), "--render-only"]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {tmp_path}/file/logs/full.spec.yaml" in err and "fix:" in err and "Traceback" not in err


def test_option_combinations_are_checked(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path, {"name": "x", "data": {"uri": "/d"}})
    for argv in (["--dry-run", "--local"], ["-o", "x.sbatch"], ["--nproc", "2"]):
        with pytest.raises(SystemExit) as caught:
            submit.main([str(spec_path), *argv])
        assert caught.value.code == 2


# ---- submitting -------------------------------------------------------------------------------


def test_submit_prints_job_id_logs_and_tensorboard(shims: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = {
        "name": "sub",
        "data": {"uri": "/d"},
        "slurm": {"log_dir": str(tmp_path / "logs")},
        "logging": {"tensorboard_dir": "/tb/sub"},
    }
    assert submit.main([str(write_spec(tmp_path, raw)), "--no-preflight"]) == 0
    out = capsys.readouterr().out
    assert "submitted job 4242" in out
    assert f"stdout   {tmp_path}/logs/submitit/4242_0_log.out" in out
    assert f"stderr   {tmp_path}/logs/submitit/4242_0_log.err" in out
    assert "tensorboard --logdir /tb/sub" in out
    submitted = DelayedSubmission.load(tmp_path / "logs" / "submitit" / "4242_submitted.pkl")
    assert type(submitted.function).__name__ == "SubmititJob"
    assert submitted.function.spec_file == str(tmp_path / "logs" / "sub.spec.yaml")


def test_preflight_stops_a_job_whose_dataset_is_missing(shims: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = {"name": "x", "data": {"uri": str(tmp_path / "missing.lance")}, "slurm": {"log_dir": str(tmp_path / "logs")}}
    assert submit.main([str(write_spec(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.lance" in err and "Traceback" not in err
    assert not any(call.startswith("sbatch") for call in calls(shims))  # nothing reached the cluster


def test_preflight_passes_a_dataset_that_ingest_will_create(
    shims: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {
        "name": "x",
        "data": {"uri": str(tmp_path / "digits.lance"), "ingest": {"source": "sklearn-digits"}},
        "slurm": {"log_dir": str(tmp_path / "logs")},
    }
    assert submit.main([str(write_spec(tmp_path, raw))]) == 0
    assert "data preflight ok" in capsys.readouterr().out
    assert any(call.startswith("sbatch") for call in calls(shims))


def test_missing_sbatch_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM commands at all
    assert submit.main([str(write_spec(tmp_path, {"name": "x", "data": {"uri": "/d"}}))]) == 2
    err = capsys.readouterr().err
    assert "sbatch and srun not found on PATH" in err and "--local" in err and "--render-only" in err


@pytest.mark.parametrize(
    ("sbatch_error", "fix"),
    [
        (CONTROLLER_DOWN, "the SLURM controller is not reachable: check `scontrol ping` and SLURM_CONF"),
        (
            "sbatch: error: Batch job submission failed: Invalid partition name specified",
            "set slurm.partition to one that `sinfo` lists",
        ),
        ("sbatch: error: Batch job submission failed: Requested node configuration is not available", "ask for fewer nodes"),
    ],
)
def test_sbatch_failures_are_explained(
    sbatch_error: str, fix: str, shims: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SBATCH_FAIL", sbatch_error)
    raw = {"name": "x", "data": {"uri": "/d"}, "slurm": {"log_dir": str(tmp_path / "logs")}}
    assert submit.main([str(write_spec(tmp_path, raw)), "--no-preflight"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sbatch refused the job:\n")
    assert sbatch_error.split("failed: ")[1] in err and fix in err
    assert err.count(sbatch_error) == 1  # submitit's own echo of sbatch's stderr is not repeated


def test_user_errors_exit_without_traceback(tmp_path: Path) -> None:
    spec_path = write_spec(tmp_path, {"name": "x", "data": {"uri": "/d", "sampler": "random"}, "slurm": {"nodes": 0}})
    result = subprocess.run(
        [sys.executable, "-m", "lance_hpc.submit", str(spec_path), "--dry-run"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "2 problems in the job spec" in result.stderr and "data.sampler" in result.stderr


# ---- parity of the submitit and sbatch paths ---------------------------------------------------


def section(script: str, start: str, end: str) -> list[str]:
    """Non-blank, non-comment lines from the first line starting with ``start`` up to ``end``."""
    lines = script.split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i, line in enumerate(lines) if i > first and line.startswith(end))
    return [line for line in lines[first:last] if line.strip() and not line.startswith("#")]


def srun_call(script: str) -> tuple[list[str], list[str]]:
    """(srun options without the log paths, the command srun starts)."""
    words = shlex.split(next(line.strip() for line in script.split("\n") if line.strip().startswith("srun ")))
    options, command, index = [], [], 1
    while index < len(words):
        if words[index] in ("--output", "--error"):
            index += 2
            continue
        if not words[index].startswith("-"):
            command = words[index:]
            break
        options.append(words[index])
        index += 1
    return options, command


CONTAINER = {"image": "/images/train.sif", "mounts": ["/scratch:/scratch", "/data:/data:ro"], "workdir": "/scratch"}
PARITY_CASES = {
    "full-options": FULL_SPEC,
    "apptainer": {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "container": CONTAINER}},
    "pyxis": {**FULL_SPEC, "slurm": {**FULL_SPEC["slurm"], "container": {**CONTAINER, "runtime": "pyxis"}}},
    "sweep": {
        **FULL_SPEC,
        "sweep": {"train.lr": [0.1, 0.05], "data.batch_size": [64, 128, 256]},
        "slurm": {**FULL_SPEC["slurm"], "array_parallelism": 2},
    },
}


@pytest.mark.parametrize("raw", [*PARITY_CASES.values(), *JOBS], ids=[*PARITY_CASES, *(job.name for job in JOBS)])
def test_submitit_asks_for_the_same_job_as_the_script(raw: Any, shims: Path, tmp_path: Path) -> None:
    spec_path = raw if isinstance(raw, Path) else write_spec(tmp_path, raw)
    log_dir = tmp_path / "logs"
    assert submit.main([str(spec_path), "--set", f"slurm.log_dir={log_dir}", "--no-preflight"]) == 0
    spec = load_spec(spec_path, [f"slurm.log_dir={log_dir}"]).spec
    ours = (log_dir / f"{spec.name}.sbatch").read_text()  # written beside the submission
    theirs = (shims / "submitted.sbatch").read_text()

    log_flags = {"output", "error"}
    our_flags = {k: v for k, v in render.sbatch_directives(ours) if k not in log_flags}
    their_flags = {k: v for k, v in render.sbatch_directives(theirs) if k not in log_flags}
    assert our_flags == their_flags
    assert ("array" in our_flags) == bool(spec.sweep)

    setup = section(ours, "#!", 'echo "job ')  # strict mode, setup lines, exports, a container's requeue handler
    # submitit writes its own srun line, which a shell function runs through the restart supervisor
    supervisor = [f'srun() {{ {restart_script.restart_supervisor(spec)} srun "$@"; }}']
    # (the supervisor's launch line spans lines: the check of its archive is a few lines of Python)
    assert setup[0] == render.STRICT_MODE and "\n".join(setup + supervisor) == "\n".join(section(theirs, "# setup", "# command"))
    assert f"{restart_script.restart_supervisor(spec)} \\\n    srun " in ours
    our_options, our_command = srun_call(ours)
    their_options, their_command = srun_call(theirs)
    # the same options, but for how output reaches the log: the script's srun passes whole lines
    # and labels them with their rank (ranks share its log); submitit's is --unbuffered, each task
    # writes a file of its own, and --label would cut its lines where slurmstepd's reads end
    assert "--label" in our_options and "--unbuffered" not in our_options
    assert "--unbuffered" in their_options and "--label" not in their_options
    assert [o for o in our_options if o != "--label"] == [o for o in their_options if o != "--unbuffered"]
    prefix = render.python_command(spec)[:-2]  # the container runtime's, if any
    spec_file = str(log_dir / f"{spec.name}.spec.yaml")
    if spec.sweep:
        spec_file = JobPaths.of(spec).run_specs.replace("{index}", "$SLURM_ARRAY_TASK_ID")
    assert our_command == [*prefix, "python3", "-P", "-m", "lance_hpc.run", spec_file]
    # which runs SubmititJob(spec file), in the same container, started by a shell that ignores USR1
    python = [*prefix, "sh", "-c", IGNORE_USR1, "python3", "-P", "-u", "-m", "submitit.core._submit"]
    assert their_command[: len(python)] == python
