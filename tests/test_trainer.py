"""The trainer on CPU with the real data layer: two local gloo ranks train the digits to the
accuracy bar and log TensorBoard scalars; an interrupted run resumes to the same weights as an
uninterrupted one; a killed rank restarts the job, which ends with the same weights, and a rank that
raises at the same step again stops it with its own error; a second run on the same
checkpoint.dir refuses, a dead run's lease is taken over, and a full disk or a checkpoint of another
model is one message; schedule and model units."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lance_hpc import loading
from lance_hpc.checkpoint import lease
from lance_hpc.checkpoint.manifests import checkpoint_name
from lance_hpc.checkpoint.resuming import Checkpoint, find_resume_point, load_latest
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.loading import load_task
from lance_hpc.loading.selection import pinned_data
from lance_hpc.runtime import trainer
from lance_hpc.runtime.entry import run_entry
from lance_hpc.runtime.environment import DistEnv, detect, process_group
from lance_hpc.runtime.metrics import TAGS
from lance_hpc.runtime.preemption import Preemption, after_preemption
from lance_hpc.spec import REDACTED, load_spec
from lance_hpc.tasks.image import ImageClassification
from lance_hpc.tasks.models import build_model
from tests.support.checkpoints import small_tmpfs
from tests.support.jobs import (
    FINAL_ACCURACY,
    REPO_ROOT,
    assert_epoch_resumes_in_place,
    final_state,
    hparams_logged,
    same_weights,
    scalars,
    write_spec,
)
from tests.support.ranks import launch, rank_pid, read_until


def test_lr_warms_up_linearly_then_decays_to_zero() -> None:
    factors = [trainer.lr_factor(step, warmup_steps=4, total_steps=20) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(later <= earlier for earlier, later in zip(factors[4:], factors[5:]))
    assert trainer.lr_factor(20, 4, 20) == 0.0 and math.isclose(trainer.lr_factor(12, 4, 20), 0.5)
    assert trainer.lr_factor(0, 0, 10) == 1.0  # no warmup


def test_peak_lr_follows_the_linear_scaling_rule(tmp_path: Path, digits) -> None:
    spec = load_spec(
        write_spec(tmp_path, digits, train={"lr": 0.1, "lr_scaling": "linear", "base_batch_size": 256, "grad_accum": 2})
    ).spec
    assert trainer.peak_lr(spec, world_size=8) == pytest.approx(0.1 * 16 * 8 * 2 / 256)
    unscaled = load_spec(write_spec(tmp_path, digits, train={"lr": 0.1, "lr_scaling": "none"})).spec
    assert trainer.peak_lr(unscaled, world_size=8) == 0.1


@pytest.mark.parametrize("name", ["small_cnn", "resnet18", "mobilenet_v3_small", "tests.test_trainer:tiny_classifier"])
def test_models_build_untrained_with_num_classes(name: str) -> None:
    model = build_model(name, num_classes=7).eval()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)


def tiny_classifier(num_classes: int) -> torch.nn.Module:
    """A model factory named by import path in a spec (task.options.model)."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(num_classes))


def test_unknown_model_lists_the_valid_ones() -> None:
    with pytest.raises(UserError, match="unknown model 'vgg'; use small_cnn, a torchvision classification model"):
        build_model("vgg", 10)


def test_one_rank_with_grad_accumulation_and_max_steps(tmp_path: Path, digits) -> None:
    """In-process, world size 1: 3 micro-batches per step, stop after 5 optimizer steps."""
    spec = load_spec(write_spec(tmp_path, digits, train={"grad_accum": 3, "max_steps": 5, "warmup_epochs": 0.1})).spec
    with Preemption() as preemption, process_group(detect({}), spec.train.collective_timeout_s) as device:
        summary = run_entry(trainer.train, spec, detect({}), device, preemption, load_task(spec))
    assert summary.status == "completed" and summary.step == 5 and "val/accuracy" in summary.metrics
    state = final_state(tmp_path)
    loader = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 1)
    assert state["step"] == 5 and state["progress"] == pytest.approx(5 * 3 * 16 / loader.source.plan.rows_per_rank)
    logged = scalars(tmp_path / "runs")
    assert [step for step, _ in logged["train/loss"]] == [5]
    assert math.ceil(loader.steps_per_epoch / 3) > 5  # so max_steps, not the epoch, ended the run


# A task of the user's own whose options hold a credential: validation cannot know its options,
# so only redaction keeps the token out of what the run writes.
TOKEN_TASK = """
from lance_hpc.tasks.image import ImageClassification, ImageOptions

class TokenOptions(ImageOptions):
    hub_api_token: str = ""
    pad_token_id: int = 0

class TokenImage(ImageClassification):
    Options = TokenOptions
"""


def test_the_checkpoint_and_hparams_hold_the_spec_redacted(tmp_path: Path, digits) -> None:
    (tmp_path / "token_task.py").write_text(TOKEN_TASK)
    options = {"model": "small_cnn", "image_size": 16, "augment": "none", "hub_api_token": "hf_s3cr3tvalue", "pad_token_id": 7}
    spec_file = write_spec(
        tmp_path, digits, task={"name": f"{tmp_path}/token_task.py:TokenImage", "options": options}, train={"max_steps": 2}
    )
    spec = load_spec(spec_file).spec
    with Preemption() as preemption, process_group(detect({}), spec.train.collective_timeout_s) as device:
        assert run_entry(trainer.train, spec, detect({}), device, preemption, load_task(spec)).status == "completed"
    saved = final_state(tmp_path)["spec"]["task"]["options"]
    assert saved["hub_api_token"] == REDACTED and saved["pad_token_id"] == 7  # an id, not a credential
    hparams = hparams_logged(tmp_path / "runs")
    assert hparams["task.options.hub_api_token"] == REDACTED and hparams["task.options.pad_token_id"] == 7
    assert "hf_s3cr3tvalue" not in repr(final_state(tmp_path)) + repr(hparams)


def test_only_usr2_requeues_sigterm_stops(tmp_path: Path, digits) -> None:
    spec = load_spec(write_spec(tmp_path, digits)).spec
    env = DistEnv("slurm", 0, 0, 4, 2, 0, 2, "node1", 20001, job_id="7")
    preemption = Preemption()
    asked = []

    def requeue(*args: object) -> tuple[bool, str]:
        asked.append(args)
        return True, "requeued"

    preemption.agreed_signal = signal.SIGTERM
    requeued, message = after_preemption(env, spec, preemption, requeue)
    assert not requeued and not asked and "a cancelled job ends here" in message
    preemption.agreed_signal = signal.SIGUSR2
    assert after_preemption(env, spec, preemption, requeue) == (True, "requeued") and len(asked) == 1


def test_resume_reads_the_checkpointed_dataset_version(tmp_path: Path, digits) -> None:
    spec = load_spec(write_spec(tmp_path, digits)).spec
    saved = Checkpoint(tmp_path / "step-00000001.pt", {"dataset_version": 1}, open_store(tmp_path))
    assert pinned_data(spec.data, saved).version == 1
    pinned = spec.data.model_copy(update={"version": 2})
    with pytest.raises(UserError, match="data.version is 2 but the checkpoint was trained on version 1"):
        pinned_data(pinned, saved)


def test_fresh_start_refuses_a_directory_with_old_checkpoints(tmp_path: Path, digits) -> None:
    spec = load_spec(write_spec(tmp_path, digits, checkpoint={"resume": False})).spec
    assert find_resume_point(spec) is None
    open_store(spec.checkpoint.dir).write(checkpoint_name(1), {"step": 1})
    with pytest.raises(UserError, match="holds checkpoints of an earlier run"):
        find_resume_point(spec)


@dataclass(frozen=True)
class FinishedRun:
    directory: Path
    spec_file: Path
    output: str


@pytest.fixture(scope="module")
def reference_run(digits, tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """Two local ranks train the digits for BASE_SPEC's 4 epochs, uninterrupted."""
    directory = tmp_path_factory.mktemp("reference")
    spec_file = write_spec(directory, digits)
    process = launch(spec_file)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output
    return FinishedRun(directory, spec_file, output)


@pytest.mark.slow
def test_two_ranks_train_to_the_bar_and_log_tensorboard(reference_run: FinishedRun) -> None:
    accuracy = float(FINAL_ACCURACY.search(reference_run.output).group(1))
    assert accuracy >= 0.90, reference_run.output

    spec = load_spec(reference_run.spec_file).spec
    steps_per_epoch = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch
    total_steps = spec.train.epochs * steps_per_epoch
    logged = scalars(reference_run.directory / "runs")
    per_rank = {f"perf/rank/{rank}/{name}" for rank in (0, 1) for name in ("own_work_s", "data_wait_s")}  # the watchdog's
    assert set(logged) == set(TAGS) | set(ImageClassification.tags) | per_rank
    step_lines = [line for line in reference_run.output.splitlines() if "train/loss" in line]
    assert step_lines and not [line for line in step_lines if "perf/rank/" in line], step_lines[-3:]  # TensorBoard's only
    assert [step for step, _ in logged["val/accuracy"]] == [steps_per_epoch * (epoch + 1) for epoch in range(4)]
    assert logged["val/accuracy"][-1][1] == pytest.approx(accuracy, abs=1e-4)
    assert logged["train/loss"][-1][0] == total_steps and logged["train/loss"][-1][1] < logged["train/loss"][0][1]
    assert max(value for _, value in logged["train/lr"]) == pytest.approx(spec.train.lr, rel=0.02)
    assert 0 < logged["train/lr"][-1][1] < spec.train.lr * 1e-3  # the last step's rate: cosine all but at zero
    assert all(0 <= value <= 1 for tag in ("train/accuracy", "perf/data_wait_share") for _, value in logged[tag])
    for (_, global_rate), (_, per_rank) in zip(logged["perf/samples_per_s"], logged["perf/samples_per_s_per_rank"]):
        assert global_rate > 0 and per_rank == pytest.approx(global_rate / 2)
    assert len(logged["perf/epoch_time_s"]) == 4 and all(value > 0 for _, value in logged["perf/epoch_time_s"])
    hparams = hparams_logged(reference_run.directory / "runs")
    assert hparams["task.options.model"] == "small_cnn" and hparams["world_size"] == 2 and hparams["train.lr"] == 0.003

    every, epoch_ends = spec.checkpoint.every_steps, [steps_per_epoch * (epoch + 1) for epoch in range(4)]
    saved_steps = sorted({step for step in range(every, total_steps, every) if step % steps_per_epoch} | set(epoch_ends))
    checkpoints = sorted(path.name for path in (reference_run.directory / "checkpoints").iterdir())
    kept = saved_steps[-spec.checkpoint.keep :]  # each with its manifest; the lease is gone with the run
    assert checkpoints == sorted([f"step-{step:08d}.pt" for step in kept] + [f"step-{step:08d}.json" for step in kept])


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_weights(reference_run: FinishedRun, tmp_path: Path, digits) -> None:
    """SIGUSR2 mid-epoch: the ranks agree, save and stop; a second run resumes from that step and
    ends bit for bit where the uninterrupted reference run ends, having read the rest of the
    interrupted epoch exactly as the uninterrupted run did (no batch twice, none skipped)."""
    spec_file = write_spec(tmp_path, digits)
    spec = load_spec(spec_file).spec
    steps_per_epoch = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch
    interrupted = launch(spec_file)
    read_until(interrupted, f"step {steps_per_epoch + 5}/")  # early in epoch 2 of 4
    interrupted.send_signal(signal.SIGUSR2)
    output = interrupted.communicate(timeout=120)[0]
    assert interrupted.returncode == ExitCode.STOPPED, output
    assert "by SIGUSR2; checkpoint" in output and "run the same command again to resume" in output
    stopped_path, stopped = (
        load_latest(open_store(tmp_path / "checkpoints")).path,
        load_latest(open_store(tmp_path / "checkpoints")).state,
    )
    assert stopped["mid_epoch"] and steps_per_epoch < stopped["step"] < 2 * steps_per_epoch

    resumed = launch(spec_file)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert f"resuming from {stopped_path} at step {stopped['step']}" in output
    assert "Warning" not in output and "find_unused_parameters" not in output, output
    final, reference = final_state(tmp_path), final_state(reference_run.directory)
    assert final["step"] == reference["step"] == spec.train.epochs * steps_per_epoch
    assert same_weights(final["objects"]["model"], reference["objects"]["model"]) == []

    assert_epoch_resumes_in_place(spec, stopped["ranks"])


@pytest.mark.slow
def test_a_killed_rank_restarts_the_local_job_which_ends_with_the_reference_weights(
    reference_run: FinishedRun, tmp_path: Path, digits
) -> None:
    """SIGKILL to rank 1 early in epoch 2: the launcher names it, stops the other rank, starts both
    again from the latest checkpoint and the job ends bit for bit where the reference run ends."""
    spec_file = write_spec(tmp_path, digits)
    spec = load_spec(spec_file).spec
    steps_per_epoch = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch
    launcher = launch(spec_file)
    read_until(launcher, f"step {steps_per_epoch + 5}/")
    killed = rank_pid(launcher, 1)
    os.kill(killed, signal.SIGKILL)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output
    assert f"rank 1 (pid {killed}) was killed by SIGKILL" in output and "rank 0/2: lost contact with another rank" in output
    assert "restart 1 of at most 2, from the latest checkpoint, after: rank 1 on localhost was killed by SIGKILL" in output
    assert re.search(r"resuming from \S+ at step \d+", output) and "restart 1: first step" in output, output
    final, reference = final_state(tmp_path), final_state(reference_run.directory)
    assert final["step"] == reference["step"] and same_weights(final["objects"]["model"], reference["objects"]["model"]) == []
    assert "restarts/downtime_s" in scalars(tmp_path / "runs")


@pytest.mark.slow
def test_a_rank_that_raises_at_the_same_step_again_stops_the_job_with_its_own_error(tmp_path: Path, digits) -> None:
    """Rank 1 raises in its task at its 5th batch, in every attempt; rank 0 then loses contact with
    it. The launcher names rank 1 and its error, not rank 0, whatever order the two exited in; the
    second attempt fails the same way at the same step, and the job stops there."""
    task = {"name": f"{REPO_ROOT}/tests/custom_task.py:FailingMLP", "options": {"hidden": 8, "fail_rank": 1, "fail_step": 5}}
    spec_file = write_spec(tmp_path, digits, task=task, train={"epochs": 5}, logging={"progress": False})
    process = launch(spec_file)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 1, output
    attempts = [line for line in output.splitlines() if "lance_hpc.launch.local: the job failed: rank" in line]
    assert len(attempts) == 2, output
    for line in attempts:
        assert "rank 1 (pid" in line and "exited with code 1: ValueError: bad batch on rank 1 at step 5" in line, output
        assert "(rank 0 then lost contact with it)" in line, output
    assert output.splitlines()[-1].endswith(
        "the job failed after 2 attempts: the same error at step 4 in attempts 1 and 2, so a restart would fail "
        f"again: rank 1 on {socket.gethostname()} at step 4: ValueError: bad batch on rank 1 at step 5"
    ), output
    assert "ValueError: bad batch on rank 1 at step 5" in output  # its traceback too


@pytest.mark.slow
def test_quickstart_prints_a_validation_accuracy_of_at_least_90_percent(tmp_path: Path) -> None:
    """The README's main command, with its outputs moved under tmp_path."""
    overrides = {
        "data.uri": tmp_path / "digits_train.lance",
        "data.val_uri": tmp_path / "digits_val.lance",
        "checkpoint.dir": tmp_path / "checkpoints",
        "logging.tensorboard_dir": tmp_path / "runs",
        "slurm.log_dir": tmp_path / "logs",
        "logging.progress": "false",
    }
    command = [sys.executable, "-m", "lance_hpc.submit", "jobs/quickstart.yaml", "--local"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    finished = subprocess.run(
        command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert float(FINAL_ACCURACY.search(finished.stdout).group(1)) >= 0.90, finished.stdout
    # Nothing a user cannot act on: no warning from the dependencies (see lance_hpc.quiet).
    assert "Warning" not in finished.stderr, finished.stderr


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def has_loaded(pid: int, library: str) -> bool:
    return library in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
def test_a_preemption_warning_while_a_rank_still_starts_is_held_and_honoured(tmp_path: Path, digits) -> None:
    """USR2 (SLURM's warning, or a stale one of a requeued job's old step) that reaches a rank
    while it still imports torch would kill it by default and fail the job: it is held from the
    rank's first line and acted on at the first step boundary, like one that came later."""
    spec_file = write_spec(tmp_path, digits, train={"epochs": 50}, logging={"log_every_steps": 1, "progress": False})
    launcher = launch(spec_file)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "rank 0 never started"
            try:
                rank = rank_pid(launcher, 0)
                held = catches(rank, signal.SIGUSR2)
                loaded = has_loaded(rank, "libtorch")
            except (AssertionError, OSError):
                time.sleep(0.01)
                continue
            assert held or not loaded, "USR2 not held before torch was imported"
            if held:
                break
            time.sleep(0.005)
        os.kill(rank, signal.SIGUSR2)
        output = launcher.communicate(timeout=180)[0]
    finally:
        launcher.kill()
    assert launcher.returncode == ExitCode.STOPPED, output
    assert "by SIGUSR2; checkpoint" in output and "Traceback" not in output, output
    assert load_latest(open_store(tmp_path / "checkpoints")).state["step"] <= 2


def long_job(directory: Path, dataset, **sections) -> Path:
    return write_spec(directory, dataset, train={"epochs": 50}, logging={"log_every_steps": 1, "progress": False}, **sections)


# Starts the ranks of a local run without the launcher's look at the lease, as srun starts them.
RANKS_ONLY = (
    "import sys; from lance_hpc.launch import local; local.lease.refuse_if_held = lambda *args: None; "
    "sys.exit(local.run_local(sys.argv[1], int(sys.argv[2])))"
)


@pytest.mark.slow
def test_a_second_run_on_the_same_checkpoint_dir_refuses_naming_the_first(tmp_path: Path, digits) -> None:
    """Two runs started at the same moment: one trains, the other refuses, naming it. While it
    trains, a third is refused by the launcher before any rank starts; ranks started without the
    launcher (as srun starts them) stop on every rank with the same message, none left waiting."""
    spec_file = long_job(tmp_path, digits)
    racing = [launch(spec_file), launch(spec_file)]
    try:
        finished = None
        while finished is None:
            finished = next((run for run in racing if run.poll() is not None), None)
            time.sleep(0.2)
        trainer_run = racing[1 - racing.index(finished)]
        refused = finished.communicate(timeout=60)[0]
        assert finished.returncode == ExitCode.USER_ERROR and "Traceback" not in refused, refused
        holder = f"is in use by another run: pid {rank_pid(trainer_run, 0)} on {socket.gethostname()}, a local run"
        assert f"checkpoint.dir {tmp_path / 'checkpoints'} {holder}" in refused, refused
        read_until(trainer_run, "step 3/")

        environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        third = subprocess.run(
            [sys.executable, "-m", "lance_hpc", "submit", str(spec_file), "--local", "--nproc", "2"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=120,
            env=environ,
        )
        assert third.returncode == ExitCode.USER_ERROR and third.stdout == "", third.stdout + third.stderr
        assert third.stderr.startswith("error: checkpoint.dir") and third.stderr.count(holder) == 1
        assert "rank 0" not in third.stderr  # no rank started

        ranks = subprocess.run(
            [sys.executable, "-c", RANKS_ONLY, str(spec_file), "2"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=300,
            env=environ,
        )
        assert ranks.returncode == ExitCode.USER_ERROR and "Traceback" not in ranks.stderr, ranks.stderr
        assert ranks.stderr.count(f"lance_hpc.run: checkpoint.dir {tmp_path / 'checkpoints'} {holder}") == 2

        trainer_run.send_signal(signal.SIGUSR2)
        output = trainer_run.communicate(timeout=120)[0]
        assert trainer_run.returncode == ExitCode.STOPPED, output
    finally:
        for run in racing:
            run.kill()
    assert not (tmp_path / "checkpoints" / lease.LEASE_NAME).exists()  # a local run that stopped gives it back
    assert not list((tmp_path / "checkpoints").glob(".step-*"))


@pytest.mark.slow
def test_the_lease_of_a_run_that_died_is_taken_over_with_a_message(tmp_path: Path, digits) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = dataclasses.replace(lease.this_process(None, 0), pid=dead.pid, token="killed-with-sigkill")
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / lease.LEASE_NAME).write_bytes(stale.encode())
    run = launch(write_spec(tmp_path, digits, train={"max_steps": 3}))
    output = run.communicate(timeout=300)[0]
    assert run.returncode == 0, output
    assert (
        f"lance_hpc: checkpoint.dir {tmp_path / 'checkpoints'}: taking over the lease of a run that is gone "
        f"(pid {dead.pid} is no longer running on {socket.gethostname()}); it was held by pid {dead.pid}"
    ) in output
    assert not (tmp_path / "checkpoints" / lease.LEASE_NAME).exists()


@pytest.mark.slow
def test_resuming_a_checkpoint_of_another_model_is_one_message(tmp_path: Path, digits) -> None:
    first = launch(write_spec(tmp_path, digits, train={"max_steps": 2}))
    output = first.communicate(timeout=300)[0]
    assert first.returncode == 0, output
    task = {"name": "image_classification", "options": {"model": "resnet18", "image_size": 16, "augment": "none"}}
    other = launch(write_spec(tmp_path, digits, task=task, train={"max_steps": 4}))
    output = other.communicate(timeout=300)[0]
    assert other.returncode == ExitCode.USER_ERROR, output
    assert "Traceback" not in output and "Missing key" not in output and "Unexpected key" not in output, output
    written = tmp_path / "checkpoints" / "step-00000002.pt"
    assert (
        f"lance_hpc.run: checkpoint {written} was written for model small_cnn (task image_classification), "
        "but this job trains model resnet18 (task image_classification)\n"
        "  fix: give this job another checkpoint.dir (--set checkpoint.dir=DIR), or set task.options.model: "
        "small_cnn to continue that run"
    ) in output


@pytest.mark.slow
def test_a_full_disk_while_saving_is_one_message(tmp_path: Path, digits) -> None:
    with small_tmpfs(tmp_path / "small", "512k") as directory:  # the lease fits, a checkpoint does not
        run = launch(write_spec(tmp_path, digits, checkpoint={"dir": str(directory)}, train={"max_steps": 12}))
        output = run.communicate(timeout=300)[0]
        assert run.returncode == ExitCode.USER_ERROR, output
        assert "Traceback" not in output and "enforce fail" not in output, output
        assert f"lance_hpc.run: cannot write {directory / 'step-00000010.pt'}: the file system is full (" in output
        assert "no earlier checkpoint exists, and nothing was left behind" in output
        assert sorted(path.name for path in directory.iterdir()) == []  # no partial file; the lease released
