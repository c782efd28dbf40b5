"""Script mode: the example's own loop runs in two local ranks under lance_hpc's runtime; SIGUSR2
mid-epoch saves and stops every rank at one step, and a rerun resumes to the weights of an
uninterrupted run, bit for bit; the context's checks on what it is given, and on a checkpoint
written for another model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch

from lance_hpc.checkpoint.resuming import Checkpoint, load_latest
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.loading import load_task
from lance_hpc.manage.lineage import lineage_lines
from lance_hpc.runtime.context import Context
from lance_hpc.runtime.entry import final_line
from lance_hpc.runtime.environment import detect
from lance_hpc.runtime.metrics import NullLogger
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.spec import JobSpec, load_spec, load_spec_text
from lance_hpc.tasks import Task
from lance_hpc.tasks.columns import ColumnsDecoder
from tests.support.jobs import REPO_ROOT, check_trace, final_state, same_weights, write_spec
from tests.support.ranks import launch, read_until

EXAMPLE = f"{REPO_ROOT}/examples/script_mode/train.py:main"


def script_spec(directory: Path, dataset, **train) -> Path:
    return write_spec(
        directory,
        dataset,
        entry=EXAMPLE,
        train={"epochs": 3, "lr": 0.01, **train},
        logging={"log_every_steps": 1, "progress": False},
    )


def test_the_example_job_validates_and_names_its_entry() -> None:
    spec = load_spec(REPO_ROOT / "examples/script_mode/job.yaml", base_dir=REPO_ROOT).spec
    assert spec.entry == EXAMPLE and spec.task.name == "image_classification"


def a_context(spec: JobSpec, resumed: Checkpoint | None) -> Context:
    """A rank-0-of-1 context that never trains: enough to register objects with (its task only names
    no metrics)."""
    task = SimpleNamespace(metrics=())
    return Context(spec, detect({}), torch.device("cpu"), task, NullLogger(), Preemption(), resumed)  # type: ignore[arg-type]


def test_register_refuses_what_it_cannot_checkpoint() -> None:
    context = a_context(load_spec_text("name: job\ndata: {uri: /d}\n").spec, None)
    with pytest.raises(UserError, match=r"ctx.register\(step=...\): a int has no state_dict"):
        context.register(step=3)


def test_running_starts_the_watchdog_and_closes_the_run_however_the_entry_ends(tmp_path: Path) -> None:
    """What lance_hpc runs the entry inside: the watchdog thread running; after an entry that raised,
    the thread stopped with the rank's status published as done, and the logger closed."""
    spec = load_spec_text(f"name: job\ndata: {{uri: /d}}\nslurm: {{log_dir: '{tmp_path}'}}\n").spec
    closed: list[bool] = []
    logger = NullLogger()
    logger.close = lambda: closed.append(True)  # type: ignore[method-assign]
    task = SimpleNamespace(metrics=())
    context = Context(spec, detect({}), torch.device("cpu"), task, logger, Preemption(), None)  # type: ignore[arg-type]
    usr1 = signal.getsignal(signal.SIGUSR1)  # the profiler listens for it inside
    try:
        with pytest.raises(RuntimeError, match="the entry failed"), context.running():
            assert any(thread.name == "lance_hpc-watchdog" for thread in threading.enumerate())
            raise RuntimeError("the entry failed")
    finally:
        signal.signal(signal.SIGUSR1, usr1)
    assert not any(thread.name == "lance_hpc-watchdog" for thread in threading.enumerate())
    assert json.loads((tmp_path / "job.watch" / "local" / "rank-0.json").read_text())["phase"] == "done"
    assert closed == [True]


def test_register_refuses_a_checkpoint_of_another_model_naming_a_few_keys(tmp_path: Path, digits) -> None:
    spec = load_spec(script_spec(tmp_path, digits)).spec
    written = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    context = a_context(
        spec,
        Checkpoint(
            tmp_path / "step-00000009.pt",
            {"objects": {"model": written.state_dict()}, "step": 9, "epoch": 0, "spec": spec.redacted_dict()},
            open_store(tmp_path),
        ),
    )
    with pytest.raises(UserError) as refused:
        context.register(model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), torch.nn.Linear(2, 2)))
    assert str(refused.value).startswith(
        f"checkpoint {tmp_path}/step-00000009.pt: its 'model' does not match this job's model (2 key(s) missing from "
        "the checkpoint: 2.weight, 2.bias)\n  fix: give this job another checkpoint.dir"
    )
    assert "Missing key" not in str(refused.value)


@pytest.mark.slow
def test_script_mode_preempted_mid_epoch_resumes_to_the_same_weights(tmp_path: Path, digits) -> None:
    # The reference run also profiles two steps of the script's own loop (ctx.steps()).
    reference = launch(script_spec(tmp_path / "reference", digits, profile={"start_step": 3, "steps": 2}))
    output = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0 and "final validation accuracy" in output, output
    traces = sorted((tmp_path / "reference" / "runs" / "profile").glob("*.pt.trace.json"))
    assert [path.name for path in traces] == ["rank0.step3.pt.trace.json", "rank1.step3.pt.trace.json"], output
    for path in traces:
        check_trace(path)
    expected = final_state(tmp_path / "reference")
    steps_per_epoch = expected["step"] // 3

    spec_file = script_spec(tmp_path / "interrupted", digits)
    interrupted = launch(spec_file)
    read_until(interrupted, f"step {steps_per_epoch + 5}/")  # early in epoch 2 of 3
    interrupted.send_signal(signal.SIGUSR2)
    output = interrupted.communicate(timeout=120)[0]
    assert interrupted.returncode == ExitCode.STOPPED, output
    assert "by SIGUSR2; checkpoint" in output and "run the same command again to resume" in output
    stopped = load_latest(open_store(tmp_path / "interrupted" / "checkpoints"))
    assert stopped.state["mid_epoch"] and steps_per_epoch < stopped.step < 2 * steps_per_epoch
    assert all(rank["loaders"]["loader"]["batches_consumed"] == stopped.step - steps_per_epoch for rank in stopped.state["ranks"])

    resumed = launch(spec_file)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output
    assert f"resuming from {stopped.path} at step {stopped.step}" in output
    final = final_state(tmp_path / "interrupted")
    assert final["step"] == expected["step"]
    assert same_weights(final["objects"]["model"], expected["objects"]["model"]) == []
    assert same_weights(final["objects"]["optimizer"]["state"][0], expected["objects"]["optimizer"]["state"][0]) == []


def run_script(directory: Path, dataset, code: str, nproc: int, **sections) -> tuple[int, str]:
    """The exit code and output of a local job whose entry is ``main`` in a file holding ``code``."""
    (directory / "entry.py").write_text(code)
    ranks = launch(write_spec(directory, dataset, entry=f"{directory}/entry.py:main", **sections), nproc=nproc)
    output = ranks.communicate(timeout=300)[0]
    return ranks.returncode, output


RESULT_OF_ANY_KEYS = """
def main(ctx) -> dict:
    return {"val/loss": 1.25, "step": ctx.step + 7, "note": "x" * 500, "sizes": [1, 2, 3]}
"""


def test_a_result_with_keys_without_a_prefix_finishes_and_prints_each_key(tmp_path: Path, digits) -> None:
    code, output = run_script(tmp_path, digits, RESULT_OF_ANY_KEYS, nproc=2)
    assert code == 0, output
    final = next(line for line in output.splitlines() if line.startswith("final validation"))
    assert final.startswith("final validation loss: 1.2500 (step 7) after 0 steps; note 'xxx"), final
    assert final.endswith("xxx..., sizes [1, 2, 3]"), final
    assert len(final) < 250, final  # a long value is cut short
    assert "restart" not in output, output


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_the_final_line_prints_every_value_the_entry_returned() -> None:
    task = SimpleNamespace(headline_metric="accuracy", headline=Task.headline)
    task.headline = lambda metrics: Task.headline(task, metrics)  # type: ignore[arg-type]
    line = final_line(task, {"epoch": 2, "done": True, "odd": Unprintable(), "loss": torch.tensor(0.5)}, 9)  # type: ignore[arg-type]
    assert line == "training finished after 9 steps: epoch 2, done True, odd <Unprintable>, loss 0.5"
    assert final_line(task, {"val/loss": 0.25, "step": 3}, 9) == "final validation loss: 0.2500 (step 3) after 9 steps"  # type: ignore[arg-type]


IMPORTS_WHEN_CALLED = """
def main(ctx) -> dict:
    import nonexistent_module
    return {}
"""


def test_a_script_whose_import_fails_stops_at_once_with_its_own_frames(tmp_path: Path, digits) -> None:
    code, output = run_script(tmp_path, digits, IMPORTS_WHEN_CALLED, nproc=1, slurm={"max_restarts": 2})
    assert code == ExitCode.USER_ERROR, output
    assert output.count("lance_hpc.launch.local: the job failed: rank 0") == 1, output  # one attempt
    assert "restart 1" not in output and "Traceback" not in output, output
    assert (
        "lance_hpc.run: the job's code failed in a way no restart changes:\n"
        f'  File "{tmp_path}/entry.py", line 3, in main\n'
        "    import nonexistent_module\n"
        "ModuleNotFoundError: No module named 'nonexistent_module'\n"
        "  fix: "
    ) in output, output
    assert "lance_hpc/" not in output.split("lance_hpc.run: ", 1)[1], output  # none of lance_hpc's frames


RAISES_BEFORE_ITS_LOOP = """
def main(ctx) -> dict:
    raise ValueError("no such layer: head")
"""


def test_a_script_that_raises_the_same_error_again_stops_after_one_restart_from_the_start(tmp_path: Path, digits) -> None:
    code, output = run_script(tmp_path, digits, RAISES_BEFORE_ITS_LOOP, nproc=1, slurm={"max_restarts": 3})
    assert code == ExitCode.FAILED, output
    assert "restart 1 of at most 3, from the start (no checkpoint saved yet), after: " in output, output
    assert "latest checkpoint" not in output and "restart 2" not in output, output
    assert output.rstrip().endswith(
        "the job failed after 2 attempts: the same error at step 0 in attempts 1 and 2, so a restart would fail again: "
        f"rank 0 on {socket.gethostname()} at step 0: ValueError: no such layer: head"
    ), output


READS_TWO_COLUMNS = """
import torch

def main(ctx) -> dict:
    model = ctx.wrap(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ctx.train_loader()
    ctx.register(model=model, optimizer=optimizer, loader=loader)
    for step, batch in ctx.steps(loader, max_steps=4):
        assert sorted(batch) == ["image", "label", "row_id"], sorted(batch)
        assert isinstance(batch["image"], list) and isinstance(batch["image"][0], bytes)
        batch = ctx.to_device(batch)
        loss = model(batch["label"].float()[:, None]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"rows": len(batch["image"]), "label": str(batch["label"].dtype)}
"""


def test_an_entry_reads_named_columns_without_a_task_and_its_checkpoints_name_the_entry(tmp_path: Path, digits) -> None:
    code, output = run_script(
        tmp_path,
        digits,
        READS_TWO_COLUMNS,
        nproc=2,
        task={"name": "columns", "options": {"columns": ["image", "label"]}},
        checkpoint={"every_steps": 2},
    )
    assert code == 0, output
    assert "training finished after 4 steps: rows 16, label 'torch.int64'" in output, output
    lines = lineage_lines(str(tmp_path / "checkpoints"), {})
    assert lines[0].startswith("checkpoints in ") and lines[0].endswith(": 2"), lines
    assert lines[-1].startswith(f"    job digits, entry {tmp_path}/entry.py:main, task columns, spec "), lines


def test_the_columns_task_needs_an_entry_and_names_existing_columns(tmp_path: Path, digits) -> None:
    with pytest.raises(UserError, match="task columns only decodes rows: it has no model") as refused:
        load_spec(write_spec(tmp_path, digits, task={"name": "columns", "options": {"columns": ["label"]}}))
    assert "set entry: path/to/train.py:main" in str(refused.value)
    spec = load_spec(
        write_spec(tmp_path, digits, entry=EXAMPLE, task={"name": "columns", "options": {"columns": ["label", "lable"]}})
    ).spec
    with pytest.raises(UserError, match=r"task.options.columns: column 'lable' is not in .*train.lance; its columns:"):
        load_task(spec)


def test_an_empty_batch_of_columns_keeps_each_columns_type_for_the_ranks_that_pad() -> None:
    schema = pa.schema([("tokens", pa.list_(pa.int32(), 4)), ("text", pa.string()), ("score", pa.float32())])
    empty = ColumnsDecoder(["tokens", "text", "score"], None, schema).empty_batch()
    assert empty["tokens"].shape == (0, 4) and empty["tokens"].dtype == torch.int32
    assert empty["text"] == [] and empty["score"].shape == (0,) and empty["row_id"].dtype == torch.int64


REPORTS_ITS_PYTHON = """
import sys
from pathlib import Path

def main(ctx) -> dict:
    Path(__file__).with_name("python.txt").write_text(sys.executable)
    return {}
"""


def test_local_ranks_run_the_python_that_ran_submit(tmp_path: Path, digits) -> None:
    # a venv's python is a link to another interpreter: the ranks run the link, so its packages
    python = tmp_path / "venv-python"
    python.symlink_to(sys.executable)
    (tmp_path / "entry.py").write_text(REPORTS_ITS_PYTHON)
    spec_file = write_spec(tmp_path, digits, entry=f"{tmp_path}/entry.py:main")
    done = subprocess.run(
        [str(python), "-m", "lance_hpc", "submit", str(spec_file), "--local", "--nproc", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "python.txt").read_text() == str(python), done.stdout
