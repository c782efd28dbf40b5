"""One runtime for every job: the built-in trainer is an entry on the public Context like a
script's; one checkpoint layout, which the earlier trainer's checkpoints still resume from; a loop
that bypasses ctx.steps() is warned and, stopped by a signal, says that nothing was saved."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lance_hpc.checkpoint import resuming, saving
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.imports import load_callable
from lance_hpc.loading import load_task
from lance_hpc.runtime.entry import run_entry
from lance_hpc.runtime.environment import TrainingFailed, detect, process_group
from lance_hpc.runtime.failures import error_that_repeats
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.spec import SpecError, load_spec
from tests.support.jobs import final_state, same_weights, scalars, train_here, write_spec
from tests.support.ranks import launch, read_until


def to_earlier_layout(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as the built-in trainer wrote it before the one layout: model and optimizer at
    the top, one ``loader`` per rank."""
    earlier = {key: value for key, value in state.items() if key not in ("objects", "format")}
    earlier.update(model=state["objects"]["model"], optimizer=state["objects"]["optimizer"])
    earlier["ranks"] = [{"rng": rank["rng"], "loader": rank["loaders"].get("loader")} for rank in state["ranks"]]
    return earlier


def test_the_checkpoint_names_what_was_registered_and_reads_the_earlier_layout(tmp_path: Path) -> None:
    env = detect({})
    current = Checkpoint(
        tmp_path / "step-00000004.pt",
        {
            "objects": {"model": {"w": 1}, "optimizer": {"o": 2}, "scheduler": {"s": 3}},
            "ranks": [{"rng": {}, "loaders": {"loader": {"batches_consumed": 4}}}],
        },
        open_store(tmp_path),
    )
    assert set(current.objects) == {"model", "optimizer", "scheduler"}
    assert current.loader_position("loader", env) == {"batches_consumed": 4}
    assert current.loader_position("other", env) is None
    earlier = Checkpoint(
        tmp_path / "step-00000004.pt",
        {"model": {"w": 1}, "optimizer": {"o": 2}, "ranks": [{"rng": {}, "loader": {"batches_consumed": 4}}]},
        open_store(tmp_path),
    )
    assert earlier.objects == {"model": {"w": 1}, "optimizer": {"o": 2}}
    assert earlier.loader_position("loader", env) == {"batches_consumed": 4}
    at_epoch_end = Checkpoint(
        tmp_path / "step-00000008.pt", {"model": {}, "ranks": [{"rng": {}, "loader": None}]}, open_store(tmp_path)
    )
    assert at_epoch_end.loader_position("loader", env) is None


@pytest.mark.slow
def test_a_checkpoint_of_the_earlier_layout_resumes_as_the_same_checkpoint_does(tmp_path: Path, digits) -> None:
    """Stopped mid-epoch by max_steps; the same checkpoint, once as written and once rewritten in the
    earlier trainer's layout, resumes to the same weights, bit for bit."""
    first = write_spec(tmp_path / "first", digits, train={"epochs": 2, "max_steps": 9}, logging={"progress": False})
    assert train_here(first).step == 9
    stopped = resuming.load_latest(open_store(tmp_path / "first" / "checkpoints"))
    assert stopped is not None and stopped.state["mid_epoch"] and stopped.state["format"] == saving.FORMAT
    finals = []
    for name, state in (("current", stopped.state), ("earlier", to_earlier_layout(stopped.state))):
        directory = tmp_path / name / "checkpoints"
        directory.mkdir(parents=True)
        torch.save(state, directory / "step-00000009.pt")
        summary = train_here(write_spec(tmp_path / name, digits, train={"epochs": 2}, logging={"progress": False}))
        assert summary.status == "completed" and summary.step > 9
        finals.append(final_state(tmp_path / name))
    assert same_weights(finals[0]["objects"]["model"], finals[1]["objects"]["model"]) == []
    assert finals[0]["step"] == finals[1]["step"]


def test_grad_clip_bounds_every_step(tmp_path: Path, digits) -> None:
    """SGD without momentum moves the parameters by lr times the clipped gradient: with a global norm of
    1e-6, steps 2 and 3 move them by at most 2 * lr * 1e-6 together; unclipped, by far more."""
    sgd = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "lr": 0.5, "lr_scaling": "none", "warmup_epochs": 0.0}

    def parameters_after(name: str, steps: int, clip: float | None) -> dict[str, torch.Tensor]:
        spec_file = write_spec(
            tmp_path / name, digits, logging={"progress": False}, train={**sgd, "max_steps": steps, "grad_clip": clip}
        )
        assert train_here(spec_file).step == steps
        names = {key for key, _ in load_task(load_spec(spec_file).spec).build_model().named_parameters()}
        return {key: value.double() for key, value in final_state(tmp_path / name)["objects"]["model"].items() if key in names}

    def distance(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
        return float(torch.sqrt(sum(((first[key] - second[key]) ** 2).sum() for key in first)))

    clipped = distance(parameters_after("clip1", 1, 1e-6), parameters_after("clip3", 3, 1e-6))
    assert 0 < clipped <= 2 * 0.5 * 1e-6 * 1.001
    unclipped = distance(parameters_after("free1", 1, None), parameters_after("free3", 3, None))
    assert unclipped > 1000 * clipped
    logged = scalars(tmp_path / "clip3" / "runs")
    assert "perf/samples_per_s" in logged and "train/loss" in logged


BYPASSING_LOOP = """
import torch
from lance_hpc.runtime.context import Context

def main(ctx: Context) -> dict:
    loader = ctx.train_loader()
    model = ctx.wrap(torch.nn.Linear(1, 1))
    ctx.register(model=model, loader=loader)
    for epoch in range(50):
        loader.set_epoch(epoch)
        for batch in loader:
            if ctx.is_main:
                print("took a batch", flush=True)
    return {}
"""


@pytest.mark.slow
def test_a_loop_that_bypasses_steps_is_warned_and_a_stop_ends_it_saying_nothing_was_saved(tmp_path: Path, digits) -> None:
    (tmp_path / "bypass.py").write_text(BYPASSING_LOOP)
    spec_file = write_spec(tmp_path, digits, entry=f"{tmp_path}/bypass.py:main", logging={"progress": False})
    ranks = launch(spec_file)
    try:
        before = read_until(ranks, "took a batch")
        assert "iterates its loader directly, not through ctx.steps(loader)" in before
        ranks.send_signal(signal.SIGINT)
        output = before + ranks.communicate(timeout=120)[0]
    finally:
        ranks.kill()
    assert ranks.returncode not in (0, None), output
    assert "stopped by SIGINT, and nothing was saved: the loop reads its loader directly" in output
    assert not list((tmp_path / "checkpoints").glob("step-*.pt"))
    assert "checkpoint saved" not in output


ENTRY_WITH_OPTIONS = """
from pydantic import BaseModel, ConfigDict

class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hidden: int = 8
    dropout: float = 0.1

def main(ctx) -> dict:
    return {"hidden": float(ctx.options.hidden), "dropout": ctx.options.dropout}

main.Options = Options
"""


def test_an_entrys_options_are_validated_by_its_model_and_reach_it(tmp_path: Path, digits) -> None:
    (tmp_path / "entry.py").write_text(ENTRY_WITH_OPTIONS)
    entry = f"{tmp_path}/entry.py:main"
    with pytest.raises(SpecError) as refused:
        load_spec(write_spec(tmp_path, digits, entry=entry, entry_options={"hidden": "wide", "widht": 3}))
    paths = {problem.path for problem in refused.value.problems}
    assert paths == {"entry_options.hidden", "entry_options.widht"}, refused.value
    with pytest.raises(SpecError, match="entry_options: set, but there is no entry to take them"):
        load_spec(write_spec(tmp_path, digits, entry_options={"hidden": 3}))

    spec_file = write_spec(tmp_path, digits, entry=entry, entry_options={"hidden": 32}, train={"optimizer": "sgd"})
    assert load_spec(spec_file).spec.entry_options == {"hidden": 32, "dropout": 0.1}  # defaults filled in
    summary = train_here_with(spec_file)
    assert summary.status == "completed" and summary.metrics == {"hidden": 32.0, "dropout": 0.1}
    validated = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "validate", str(spec_file)], capture_output=True, text=True, check=True
    ).stdout
    note = next(line for line in validated.splitlines() if "runs instead of the built-in trainer" in line)
    assert "train.optimizer" in note and note.endswith(
        "take effect only if it reads them from ctx.spec (the trainer's own fields)"
    )


def train_here_with(spec_file: Path) -> Any:
    """The spec's own entry in this process, as rank 0 of 1."""
    spec = load_spec(spec_file).spec
    entry = load_callable(spec.entry or "", "entry")
    with Preemption() as preemption, process_group(detect({}), spec.train.collective_timeout_s) as device:
        return run_entry(entry, spec, detect({}), device, preemption, load_task(spec))


def test_channels_last_pixels_straight_from_the_loader_do_not_break_ddp_gradient_layout(single_rank: torch.device) -> None:
    """A loop that skips ctx.to_device feeds the loader's channels-last pixels to a contiguous model:
    some convolutions then give channels-last weight gradients, which no longer match DDP's buckets
    (PyTorch warns "Grad strides do not match bucket view strides" and copies each step). wrap_model
    lays the input out as the model's weights are: every gradient has its weight's strides, and the
    gradients are those of a contiguous input."""
    import torchvision

    from lance_hpc.parallel.ddp import wrap_model

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=2)

    pixels = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # as decoded: NHWC memory
    inputs = pixels.float() / 255
    assert inputs.is_contiguous(memory_format=torch.channels_last) and not inputs.is_contiguous()

    plain = model()
    plain(inputs.contiguous()).sum().backward()
    wrapped = wrap_model(model(), single_rank, deterministic=False)
    wrapped(inputs).sum().backward()
    weights = [parameter for parameter in wrapped.module.parameters() if parameter.dim() == 4]
    assert weights and all(weight.grad.stride() == weight.stride() for weight in weights)
    for ours, theirs in zip(wrapped.module.parameters(), plain.parameters()):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)


def raised(action: Any) -> BaseException:
    try:
        action()
    except Exception as error:
        return error
    raise AssertionError("nothing raised")


def test_an_import_or_syntax_error_of_the_jobs_own_code_is_one_that_repeats(tmp_path: Path) -> None:
    (tmp_path / "broken_helper.py").write_text("def f(:\n    pass\n")
    (tmp_path / "user_code.py").write_text("def load():\n    import broken_helper\n")
    sys.path.append(str(tmp_path))
    try:
        entry = load_callable(f"{tmp_path}/user_code.py:load", "entry")
        error = raised(entry)
    finally:
        sys.path.remove(str(tmp_path))
    wrapped = TrainingFailed("rank 0/1: training failed")
    wrapped.__cause__ = error
    repeats = error_that_repeats(wrapped)
    assert isinstance(repeats, UserError), error
    text = str(repeats)
    assert f'File "{tmp_path}/user_code.py", line 2, in load\n    import broken_helper\n' in text, text
    assert f'File "{tmp_path}/broken_helper.py", line 1\n' in text and "SyntaxError: " in text, text
    assert "importlib" not in text and "lance_hpc" not in text, text
    # an import error raised through none of the job's files (lance_hpc's own, say), and any other
    # error of the job's code, may still be a fault
    assert error_that_repeats(ModuleNotFoundError("No module named 'lance_hpc.no_such_module'")) is None
    assert error_that_repeats(raised(lambda: load_callable(f"{tmp_path}/user_code.py:nothing", "entry"))) is None
    assert error_that_repeats(ValueError("bad batch")) is None
