"""lance_hpc.Loader under the frameworks people train with: Lightning's Trainer, Hugging Face
Accelerate and DeepSpeed, each example submitted as a ``command:`` job on local gloo ranks
(``lance-hpc submit --local --nproc N``, torchrun's variables given by lance_hpc), stopped
mid-epoch, resumed from the framework's own checkpoint, and every row of each epoch trained on once."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.fabric.utilities.data import _set_sampler_epoch

from lance_hpc import Loader
from tests.support.jobs import REPO_ROOT
from tests.test_loader_library import write_rows


def test_lightnings_fit_loop_reaches_the_loaders_epoch(tmp_path: Path) -> None:
    uri = write_rows(str(tmp_path / "rows.lance"), [30, 30])
    loader = Loader(uri, batch_size=8, columns=["x"], num_workers=0)
    first = [int(row) for batch in loader for row in batch["x"]]
    _set_sampler_epoch(loader, 1)  # what Lightning's fit loop calls on each train dataloader, every epoch
    assert loader.epoch == 1
    second = [int(row) for batch in loader for row in batch["x"]]
    assert sorted(first) == sorted(second) == list(range(60)) and first != second  # a new order


def epoch_rows(logs: Path) -> dict[int, collections.Counter]:
    """How often each row was trained on, by epoch, from the examples' row logs of every rank."""
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in logs.iterdir():
        for line in path.read_text().splitlines():
            epoch, *rows = line.split()
            counts[int(epoch)].update(int(row) for row in rows)
    return counts


def run_example(example: str, nproc: int, *arguments: str) -> str:
    """The example as a command job on ``nproc`` local ranks (one loader worker a rank); its output,
    for a failing assertion to show."""
    workdir = Path(arguments[arguments.index("--rows-log") + 1]).parent
    argv = [sys.executable, str(REPO_ROOT / "examples" / example), "--workers", "1", *arguments]
    (workdir / "job.yaml").write_text(json.dumps({"name": example.removesuffix(".py"), "command": argv}))
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", "job.yaml", "--local", "--nproc", str(nproc)],
        cwd=workdir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = f"--- {example} on {nproc} ranks {' '.join(arguments)}\n{done.stdout}{done.stderr}"
    assert done.returncode == 0, output
    return output


def example_arguments(tmp_path: Path) -> tuple[list[str], Path]:
    """The examples' arguments over a dataset of 103 rows (51 a rank of 2: 7 steps of 8, and one row
    dropped), saving every 2 steps, and the directory their row logs go to."""
    uri = write_rows(str(tmp_path / "rows.lance"), [30, 30, 30, 13])
    logs = tmp_path / "rows"
    logs.mkdir()
    return ["--data", uri, "--checkpoints", str(tmp_path / "ckpt"), "--rows-log", str(logs), "--save-every", "2"], logs


def steps_logged(logs: Path) -> dict[str, int]:
    return {path.name: len(path.read_text().splitlines()) for path in logs.iterdir()}


@pytest.mark.slow
def test_lightning_resumes_mid_epoch_from_its_own_checkpoint(tmp_path: Path) -> None:
    common, logs = example_arguments(tmp_path)
    output = run_example("lightning_train.py", 2, *common, "--epochs", "2", "--stop-after", "4")
    assert (tmp_path / "ckpt" / "last.ckpt").exists(), output
    assert steps_logged(logs) == {"rows-2-0.txt": 4, "rows-2-1.txt": 4}, output
    output += run_example("lightning_train.py", 2, *common, "--epochs", "2")
    assert "Restored all states from the checkpoint" in output, output
    counts = epoch_rows(logs)
    assert sorted(counts) == [0, 1], output
    for epoch, count in counts.items():
        assert sorted(count.values()) == [1] * 102, f"epoch {epoch}: not every row once\n{output}"
    first_rank = (logs / "rows-2-0.txt").read_text().splitlines()
    assert [line.split()[1:] for line in first_rank[:7]] != [line.split()[1:] for line in first_rank[7:]], output


@pytest.mark.slow
def test_accelerate_resumes_on_3_ranks_what_2_ranks_began(tmp_path: Path) -> None:
    common, logs = example_arguments(tmp_path)
    output = run_example("accelerate_train.py", 2, *common, "--stop-after", "3")
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-3", output
    assert steps_logged(logs) == {"rows-2-0.txt": 3, "rows-2-1.txt": 3}, output
    output += run_example("accelerate_train.py", 3, *common)
    assert steps_logged(logs) == {f"rows-{world}-{rank}.txt": 3 for world in (2, 3) for rank in range(world)}, output
    assert sorted(epoch_rows(logs)[0].values()) == [1] * 102, f"not every row of the epoch once\n{output}"
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == ["latest", "step-6"], output


@pytest.mark.slow
def test_deepspeed_resumes_mid_epoch_from_its_client_state(tmp_path: Path) -> None:
    common, logs = example_arguments(tmp_path)
    output = run_example("deepspeed_train.py", 2, *common, "--stop-after", "3")
    assert steps_logged(logs) == {"rows-2-0.txt": 3, "rows-2-1.txt": 3}, output
    output += run_example("deepspeed_train.py", 2, *common)
    assert steps_logged(logs) == {"rows-2-0.txt": 7, "rows-2-1.txt": 7}, output
    assert sorted(epoch_rows(logs)[0].values()) == [1] * 102, f"not every row of the epoch once\n{output}"
