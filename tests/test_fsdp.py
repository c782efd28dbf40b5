"""Sharded training (train.parallelism: fsdp) on 2 and 3 local gloo ranks: a model built on the meta
device and initialised on its shards, sharded checkpoints written in the background, resumed bit for
bit, on another world size, and across ddp and fsdp."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lance_hpc.checkpoint.resuming import load_latest
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode
from lance_hpc.parallel.materialise import BLOCK_ELEMENTS, _replay_rows, build_on_meta, materialise, to_empty
from lance_hpc.spec import load_spec
from lance_hpc.tasks.gpt import GPT
from tests.support.jobs import FINAL_ACCURACY, REPO_ROOT, same_weights, scalars, write_spec
from tests.support.ranks import launch, rank_pid, read_until

FSDP = {"parallelism": "fsdp"}


def run(spec_file: Path, nproc: int = 2) -> str:
    process = launch(spec_file, nproc)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output
    return output


def sharded_model(directory: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model of the newest checkpoint under ``directory``, whole, read from its shards (or its file)."""
    found = load_latest(open_store(directory / "checkpoints"))
    assert found is not None, f"no checkpoint under {directory}"
    if found.shards is None:
        return found.objects["model"]
    whole = tmp_path / f"{directory.name}-whole.pt"
    dcp_to_torch_save(found.store.location(found.shards), whole)
    return torch.load(whole, weights_only=False)["model"]


def test_replayed_rows_do_not_depend_on_how_a_tensor_is_split() -> None:
    """Rows drawn for a shard equal the same rows of the whole tensor, across block boundaries."""
    meta = build_on_meta(lambda: GPT(vocab_size=3000, sequence_length=32, layers=1, width=512, heads=4))
    assert meta.problem() is None
    history = meta.histories["token_embedding.weight"]
    whole = torch.empty(3000, 512)
    _replay_rows(history, whole, 0, seed=7)
    assert BLOCK_ELEMENTS // 512 < 3000  # the tensor spans several blocks
    for first, last in ((0, 1000), (1000, 2000), (1500, 3000), (2047, 2049)):
        part = torch.empty(last - first, 512)
        _replay_rows(history, part, first, seed=7)
        assert torch.equal(part, whole[first:last]), (first, last)
    assert 0.015 < float(whole.std()) < 0.025  # GPT's normal(0, 0.02)


def test_a_model_built_on_meta_keeps_its_ties_and_initialisation() -> None:
    def build() -> GPT:
        return GPT(vocab_size=100, sequence_length=16, layers=2, width=32, heads=2)

    first, second = build_on_meta(build), build_on_meta(build)
    models = []
    for meta in (first, second):
        model = to_empty(meta.model, torch.device("cpu"))
        materialise(meta, torch.device("cpu"), seed=3)
        models.append(model)
    assert models[0].head.weight is models[0].token_embedding.weight
    assert same_weights(models[0].state_dict(), models[1].state_dict()) == []
    norm = models[0].blocks[0].attention_norm
    assert torch.equal(norm.weight, torch.ones(32)) and torch.equal(norm.bias, torch.zeros(32))


def test_a_constructor_that_cannot_be_replayed_is_named() -> None:
    class Copied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 4))
            with torch.no_grad():
                self.weight.copy_(torch.eye(4))

    assert "weight" in (build_on_meta(Copied).problem() or "")


@pytest.fixture(scope="module")
def fsdp_reference(digits, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks train the digits under fsdp for 4 epochs, uninterrupted, saving synchronously."""
    directory = tmp_path_factory.mktemp("fsdp-reference")
    output = run(write_spec(directory, digits, train=FSDP))
    assert float(FINAL_ACCURACY.search(output).group(1)) >= 0.90, output
    assert "Warning" not in output, output
    # the small CNN declares no blocks: the job says what it wraps and how to choose
    assert "declares no blocks to shard; fsdp wraps" in output and "blocks(self, model)" in output, output
    return directory


@pytest.mark.slow
def test_fsdp_trains_to_the_bar_and_writes_sharded_checkpoints(fsdp_reference: Path) -> None:
    names = sorted(path.name for path in (fsdp_reference / "checkpoints").iterdir())
    steps = sorted({name.split(".")[0] for name in names})
    assert len(steps) == 2  # checkpoint.keep
    for step in steps:
        assert {f"{step}.pt", f"{step}.json", f"{step}.dcp"} <= set(names), names
        shards = sorted(path.name for path in (fsdp_reference / "checkpoints" / f"{step}.dcp").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards  # each rank wrote its own


@pytest.mark.slow
def test_a_background_save_survives_usr2_and_resumes_bit_for_bit(fsdp_reference: Path, tmp_path: Path, digits) -> None:
    """async_save: USR2 mid-epoch stops the ranks after the background write is complete; the
    resumed run ends bit for bit where the uninterrupted (synchronously saved) run ends."""
    spec_file = write_spec(tmp_path, digits, train=FSDP, checkpoint={"async_save": True})
    interrupted = launch(spec_file)
    read_until(interrupted, "step 50/")  # early in epoch 2 of 4 (45 steps each)
    interrupted.send_signal(signal.SIGUSR2)
    output = interrupted.communicate(timeout=120)[0]
    assert interrupted.returncode == ExitCode.STOPPED, output
    stopped = load_latest(open_store(tmp_path / "checkpoints"))
    assert stopped is not None and stopped.shards is not None and stopped.state["mid_epoch"], output
    assert (tmp_path / "checkpoints" / stopped.shards / ".metadata").is_file()

    output = run(spec_file)
    assert f"resuming from {stopped.path} at step {stopped.step}" in output
    assert same_weights(sharded_model(tmp_path, tmp_path), sharded_model(fsdp_reference, tmp_path)) == []


@pytest.mark.slow
def test_resumes_on_three_ranks_and_across_ddp_and_fsdp(tmp_path: Path, digits) -> None:
    """fsdp on 2 ranks -> fsdp on 3 (DCP reshards) -> ddp on 2 (a sharded checkpoint into a whole
    model) -> fsdp on 2 (a whole checkpoint into shards); each run continues where the last stopped.
    A save cut short (shards without their step file) is never resumed from and is pruned."""
    max_steps = {"max_steps": 20}
    run(write_spec(tmp_path, digits, train={**FSDP, **max_steps}))
    first = load_latest(open_store(tmp_path / "checkpoints"))
    assert first is not None and first.step == 20 and first.shards is not None
    cut_short = tmp_path / "checkpoints" / "step-00000099.dcp"
    shutil.copytree(tmp_path / "checkpoints" / first.shards, cut_short)
    (cut_short / "__1_0.distcp").write_bytes(b"")

    output = run(write_spec(tmp_path, digits, train={**FSDP, "max_steps": 40}), nproc=3)
    assert f"resuming from {first.path} at step 20" in output and "continued by 3" in output, output
    assert not cut_short.exists()
    output = run(write_spec(tmp_path, digits, train={"max_steps": 60}))
    assert "at step 40" in output, output
    ddp = load_latest(open_store(tmp_path / "checkpoints"))
    assert ddp is not None and ddp.shards is None and ddp.step == 60
    output = run(write_spec(tmp_path, digits, train={**FSDP, "epochs": 4}))
    assert "at step 60" in output, output
    assert float(FINAL_ACCURACY.search(output).group(1)) >= 0.90, output


def test_sharding_settings_under_ddp_are_refused(tmp_path: Path, digits) -> None:
    from lance_hpc.errors import UserError

    spec_file = write_spec(tmp_path, digits, train={"activation_checkpointing": True}, checkpoint={"async_save": True})
    with pytest.raises(UserError) as refused:
        load_spec(spec_file)
    message = str(refused.value)
    assert "train.activation_checkpointing" in message and "checkpoint.async_save" in message
    assert "train.parallelism: fsdp" in message


@pytest.mark.slow
def test_export_round_trips_into_the_tasks_model_and_evaluation_reads_the_shards(
    fsdp_reference: Path, tmp_path: Path, digits
) -> None:
    """lance-hpc checkpoint export writes the sharded model as one state dict (.pt and .safetensors)
    that loads into the task's own model; an evaluation job reads the shards directly and reports
    the accuracy the training run reported."""
    from safetensors.torch import load_file

    from lance_hpc.tasks.models import build_model
    from tests.test_infer import infer_spec, run_local

    expected = sharded_model(fsdp_reference, tmp_path)
    for name in ("model.pt", "model.safetensors"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "lance_hpc",
                "checkpoint",
                "export",
                str(fsdp_reference / "checkpoints"),
                str(tmp_path / name),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        assert done.returncode == 0, done.stdout + done.stderr
        exported = torch.load(tmp_path / name) if name.endswith(".pt") else load_file(tmp_path / name)
        assert same_weights(exported, expected) == []
        model = build_model("small_cnn", 10, 3)
        model.load_state_dict(exported)  # strict: every key of the task's model, nothing else

    spec = infer_spec(
        tmp_path / "eval", digits.val, fsdp_reference / "checkpoints", job="evaluate", metrics_file=str(tmp_path / "m.json")
    )
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((tmp_path / "m.json").read_text())["metrics"]["eval/accuracy"] >= 0.90


def test_export_refuses_an_unknown_format_and_an_empty_directory(tmp_path: Path) -> None:
    from lance_hpc.cli.checkpoint import main

    assert main(["export", str(tmp_path), str(tmp_path / "model.bin")]) == ExitCode.USER_ERROR
    assert main(["export", str(tmp_path), str(tmp_path / "model.pt")]) == ExitCode.USER_ERROR


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [{}, {"activation_checkpointing": True, "cpu_offload": True}, {"compile": True}, {"grad_accum": 2, "grad_clip": 0.5}],
    ids=["fsdp", "recompute-and-offload", "compile", "accumulate-and-clip"],
)
def test_the_language_model_trains_to_the_ddp_bar_under_fsdp(tmp_path: Path, stdlib_tokens, settings: dict) -> None:
    """The GPT sharded per transformer block reaches the bar its DDP test sets (tests/test_tasks.py),
    also with activations recomputed and the shards offloaded to host memory."""
    spec_file = write_spec(
        tmp_path,
        stdlib_tokens,
        task={"name": "language_model", "options": {"layers": 1, "width": 64, "heads": 2}},
        data={"num_workers": 1, "batch_size": 16},
        train={"epochs": 1, "max_steps": 60, "lr": 0.003, "warmup_epochs": 0.05, **FSDP, **settings},
    )
    output = run(spec_file)
    bits = float(re.search(r"final validation bits per byte: ([0-9.]+)", output).group(1))
    assert bits < 5.0, output
    assert "declares no blocks" not in output and "built whole on the CPU" not in output, output


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_out_of_memory_says_what_the_state_needs_per_rank_and_what_to_change(tmp_path: Path, digits, parallelism: str) -> None:
    spec_file = write_spec(tmp_path, digits, entry="tests.support.oom:main", train={"parallelism": parallelism})
    process = launch(spec_file)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == ExitCode.USER_ERROR, output
    assert "Traceback" not in output, output
    assert f"under train.parallelism {parallelism} on 2 rank(s) each rank holds weights" in output, output
    assert "adamw state" in output and "GiB before activations" in output, output
    fix = "train.parallelism: fsdp" if parallelism == "ddp" else "train.activation_checkpointing: true"
    assert fix in output and "data.batch_size" in output and "PyTorch said: CUDA out of memory" in output, output


@pytest.mark.slow
def test_stopped_on_two_ranks_the_first_loss_on_three_is_within_one_percent(tmp_path: Path, digits) -> None:
    """Stopped on 2 ranks one step before the epoch's end, resumed on 3: that last step reads the
    same 48 rows as the uninterrupted run's (2 x 24 = 3 x 16), through weights that came through
    DCP's resharding, and its loss is within 1% of the uninterrupted run's. The learning rate is
    still warming up, so stopping early (max_steps) does not change its schedule."""
    logging = {"log_every_steps": 1, "progress": False}
    train = {**FSDP, "epochs": 1, "warmup_epochs": 2.0}
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run(write_spec(reference, digits, data={"batch_size": 24}, train=train, logging=logging))
    expected = dict(scalars(reference / "runs")["train/loss"])
    last = max(expected)
    run(write_spec(resumed, digits, data={"batch_size": 24}, train={**train, "max_steps": last - 1}, logging=logging))
    output = run(write_spec(resumed, digits, data={"batch_size": 16}, train=train, logging=logging), nproc=3)
    assert f"at step {last - 1}" in output and "continued by 3" in output, output
    after = dict(scalars(resumed / "runs")["train/loss"])
    assert after[last] == pytest.approx(expected[last], rel=0.01), (last, after[last], expected[last])


@pytest.mark.slow
def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path: Path, stdlib_tokens) -> None:
    """A GPT big enough that its shards take a while to write: rank 1 is stopped the moment its shard
    file of step 20 appears (rank 0 cannot complete the save without it), then both ranks are killed.
    Step 10 stays the latest checkpoint and the job resumes from it."""
    spec_file = write_spec(
        tmp_path,
        stdlib_tokens,
        task={"name": "language_model", "options": {"layers": 4, "width": 384, "heads": 4}},
        data={"batch_size": 4},
        train={**FSDP, "epochs": 1, "max_steps": 25, "lr": 0.001},
        logging={"log_every_steps": 1, "progress": False},
        slurm={"max_restarts": 0},  # the killed run stays dead: its checkpoints are what is looked at
    )
    directory = tmp_path / "checkpoints"
    job = launch(spec_file)
    read_until(job, "step 19/", timeout_s=300)
    rank_1 = rank_pid(job, 1)
    shard = directory / "step-00000020.dcp" / "__1_0.distcp"
    deadline = time.monotonic() + 120
    while not shard.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(rank_1, signal.SIGSTOP)
    assert shard.exists(), "rank 1 never began to write its shard of step 20"
    for rank in (0, 1):
        os.kill(rank_pid(job, rank), signal.SIGKILL)
    output = job.communicate(timeout=120)[0]
    assert job.returncode != 0, output
    assert not (directory / "step-00000020.pt").exists(), "the save completed before the ranks were killed"
    saved = load_latest(open_store(directory))
    assert saved is not None and saved.step == 10

    output = run(spec_file)
    assert f"resuming from {saved.path} at step 10" in output, output
    # the step is saved again beside the killed save's shards, which go once it is published
    shards = torch.load(directory / "step-00000020.pt", weights_only=True)["shards"]
    assert (directory / shards / ".metadata").exists(), sorted(path.name for path in directory.iterdir())
    assert not (shards != "step-00000020.dcp" and (directory / "step-00000020.dcp").exists()), (
        "the killed save's shards were left"
    )


@pytest.mark.slow
def test_the_script_mode_example_trains_alike_under_ddp_and_fsdp(tmp_path: Path) -> None:
    """examples/script_mode (its own loop, ctx.wrap, ctx.unwrap for its evaluation): the same initial
    weights and the same rows give the same validation accuracy under both."""
    accuracies = []
    for parallelism in ("ddp", "fsdp"):
        overrides = {
            "train.parallelism": parallelism,
            "checkpoint.dir": str(tmp_path / parallelism / "checkpoints"),
            "logging.tensorboard_dir": str(tmp_path / parallelism / "runs"),
            "logging.progress": "false",
        }
        command = [sys.executable, "-m", "lance_hpc.submit", "examples/script_mode/job.yaml", "--local"]
        for key, value in overrides.items():
            command += ["--set", f"{key}={value}"]
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        )
        assert done.returncode == 0, done.stdout + done.stderr
        accuracies.append(float(re.search(r"final validation accuracy: ([0-9.]+)", done.stdout).group(1)))
    assert accuracies[0] == accuracies[1] > 0.5, accuracies
