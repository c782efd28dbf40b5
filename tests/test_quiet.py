"""Commands print no warning of a dependency that a user cannot act on: exporting a sharded
checkpoint (torch's distributed checkpoint, read in one process on purpose) and the status of a
job whose TensorBoard events a resumed run purged from its restart step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from lance_hpc.checkpoint import saving
from lance_hpc.checkpoint.shards.saver import ShardedSaver, tensor_state
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.runtime.metrics import TensorBoardLogger
from tests.support.checkpoints import state
from tests.support.jobs import REPO_ROOT


def lance_hpc(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lance-hpc ARGS`` as a user runs it: its own process, its own warning filters."""
    return subprocess.run(
        [sys.executable, "-m", "lance_hpc", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=300,
    )


def test_exporting_a_sharded_checkpoint_prints_no_warning_of_torch(tmp_path: Path, single_rank: torch.device) -> None:
    saver = ShardedSaver(None)
    model = torch.nn.Linear(4, 3)
    saving.save(
        open_store(tmp_path / "checkpoints"), 1, state(1), {}, keep=2, sharded=(saver, tensor_state({"model": model}), False)
    )
    saver.wait()
    done = lance_hpc("checkpoint", "export", tmp_path / "checkpoints", tmp_path / "model.pt", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 tensors" in done.stdout and torch.load(tmp_path / "model.pt")["weight"].shape == (3, 4), done.stdout
    assert done.stderr == "", done.stderr


def test_status_of_a_resumed_jobs_tensorboard_events_prints_no_warning_of_tensorboard(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for purge_step in (None, 2):  # the first run, then a run resumed at step 2 that hides what came after
        logger = TensorBoardLogger(str(runs), purge_step)
        for step in range(purge_step or 0, (purge_step or 0) + 4):
            logger.log({"train/loss": 1.0 / (step + 1)}, step)
        logger.close()
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: resumed\ndata: {{uri: {tmp_path}/train.lance}}\ntask: {{name: image_classification}}\n"
        f"checkpoint: {{dir: {tmp_path}/checkpoints}}\nlogging: {{tensorboard_dir: {runs}}}\n"
        f"slurm: {{log_dir: {tmp_path}/logs}}\n"
    )
    done = lance_hpc("status", spec, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "last log    step 5: loss 0.1667" in done.stdout, done.stdout
    assert done.stderr == "", done.stderr
