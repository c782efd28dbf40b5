"""Job kinds behind one interface: a kind defined outside the package (examples/job_kind) runs
with --local, shows its plan in a dry run and runs on the SLURM test cluster; a spec naming an
unknown kind, or an import path that is not a JobKind, is one clear error."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import lance
import pytest

from lance_hpc import JobKind
from lance_hpc.errors import UserError
from lance_hpc.imports import child_environment
from lance_hpc.kinds import KINDS, job_kind
from lance_hpc.manage.status import kind_progress
from lance_hpc.spec import SpecError, load_spec, validate_spec
from tests.support.jobs import REPO_ROOT, Digits
from tests.support.slurm import job_log, sbatch, wait_for_runs
from tests.support.slurm_cluster import SlurmCluster

EXAMPLE = REPO_ROOT / "examples" / "job_kind"
BASE = {"name": "kinds", "data": {"uri": "/data/train.lance"}}


def example_checkout(tmp_path: Path) -> Path:
    """The example as a user runs it: from a directory holding examples/job_kind, its paths relative to it."""
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "job_kind")
    return tmp_path


def submit(directory: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "lance_hpc.submit", "examples/job_kind/job.yaml", *arguments]
    return subprocess.run(command, cwd=directory, env=child_environment(), capture_output=True, text=True, timeout=600)


def test_a_kind_of_ones_own_runs_locally_on_two_ranks(tmp_path: Path) -> None:
    directory = example_checkout(tmp_path)
    done = submit(directory, "--local")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    rows = lance.dataset(str(directory / "data" / "digits_train.lance")).count_rows()
    per_rank = [int(count) for count in re.findall(r"rank \d: (\d+) rows", output)]
    assert len(per_rank) == 2 and sum(per_rank) == rows, output
    assert f"count_rows: {rows} rows in {directory}/data/digits_train.lance" in output, output
    assert "count_rows: 8 fragment(s)" in output, output  # the kind's check, before the ranks started


def test_a_dry_run_asks_the_kind_for_its_plan_and_writes_nothing(tmp_path: Path) -> None:
    directory = example_checkout(tmp_path)
    done = submit(directory, "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = done.stdout.partition("# ---- data plan ----")[2]
    assert "digits_train.lance does not exist yet: the job's check ingests" in plan, done.stdout
    assert not (directory / "data").exists() and not (directory / "logs").exists()
    assert submit(directory, "--local").returncode == 0
    plan = submit(directory, "--dry-run").stdout.partition("# ---- data plan ----")[2]
    assert "8 fragment(s) of" in plan and "fragments per rank: [4, 4]" in plan, plan


def test_an_unknown_kind_is_one_error_listing_the_valid_names() -> None:
    with pytest.raises(SpecError) as raised:
        validate_spec({**BASE, "job": "tran"})
    message = str(raised.value)
    assert "job: unknown job kind 'tran'" in message and ", ".join(KINDS) in message, message
    assert message.count("unknown job kind") == 1, message
    with pytest.raises(SpecError, match="unknown job kind 'tran'"):
        validate_spec({**BASE, "job": "tran"}, imports=False)  # status reads specs without importing them
    with pytest.raises(UserError, match="fix: use one of: train, ingest, infer, evaluate"):
        job_kind("tran")


def test_an_import_path_that_is_not_a_job_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "not_kinds.py").write_text("class Counter:\n    pass\n")
    with pytest.raises(SpecError) as raised:
        validate_spec({**BASE, "job": "not_kinds.py:Counter"}, base_dir=tmp_path)
    message = str(raised.value)
    assert f"job: '{tmp_path}/not_kinds.py:Counter' is not a subclass of lance_hpc.JobKind" in message, message
    assert "fix: subclass lance_hpc.JobKind" in message, message
    # without imports (status, logs, cancel) only the form is checked: the file's code never runs
    spec = validate_spec({**BASE, "job": "not_kinds.py:Counter"}, base_dir=tmp_path, imports=False).spec
    assert spec.job == f"{tmp_path}/not_kinds.py:Counter"


def test_the_kind_is_resolved_like_tasks_and_status_never_imports_ones_own() -> None:
    spec = load_spec(EXAMPLE / "job.yaml", base_dir=REPO_ROOT).spec
    kind = job_kind(spec.job)
    assert isinstance(kind, JobKind) and kind.name == "count_rows" and not kind.profiled
    assert all(job_kind(name).name == name for name in KINDS) and job_kind("train").profiled
    missing = validate_spec({**BASE, "job": "/nowhere/kinds.py:Gone"}, imports=False).spec
    assert kind_progress(missing) == (
        "job",
        [f"{missing.job}: its progress is in the log (status does not import a job kind of your own)"],
    )
    assert kind_progress(validate_spec(BASE).spec) is None  # train: the training lines


@pytest.mark.slurm
@pytest.mark.slow
def test_a_kind_of_ones_own_runs_on_the_slurm_cluster(slurm_cluster: SlurmCluster, digits: Digits, tmp_path: Path) -> None:
    """2 nodes x 2 tasks through sbatch: every rank counts its fragments, rank 0 the total."""
    overrides = [
        f"data.uri={digits.train}",
        f"slurm.partition={slurm_cluster.partition}",
        "slurm.nodes=2",
        f"slurm.log_dir={tmp_path / 'logs'}",
    ]
    spec = load_spec(EXAMPLE / "job.yaml", overrides, base_dir=REPO_ROOT).spec
    job_id = sbatch(slurm_cluster, spec)
    states = wait_for_runs(slurm_cluster, [job_id], 300)
    output = "".join((tmp_path / "logs" / f"{spec.name}-{job_id}.{kind}").read_text() for kind in ("out", "err"))
    assert states[job_id] == "COMPLETED", output or job_log(slurm_cluster, job_id)
    rows = lance.dataset(digits.train).count_rows()
    assert f"count_rows: {rows} rows in {digits.train}" in output, output
    # srun --label puts the task before each line: every task counted, as the rank it is
    counted = re.findall(r"^(\d+): rank (\d+): \d+ rows in", output, re.MULTILINE)
    assert sorted(counted) == [(str(task), str(task)) for task in range(4)], output
