"""Pluggable tasks: a task defined in a test module trains through its import path on two local
ranks (its decoder running in DataLoader workers); every built-in task with every training
strategy gives every rank the same steps and reads every planned row exactly once, by row id;
a task checks its options against the data before any step runs, and every numeric option is
finite and bounded at validation."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lance_hpc.checkpoint.weights import load_weights
from lance_hpc.errors import UserError
from lance_hpc.loading import build_train_loader, dataset_info, load_task
from lance_hpc.spec import DataSpec, SpecError, load_spec, validate_spec
from lance_hpc.spec.choices import STYLES
from lance_hpc.tasks import ROW_ID, TaskError, build_task
from lance_hpc.tasks.language import LanguageModel
from tests.support.jobs import Digits, final_state, hparams_logged, same_weights, scalars, train_here, write_spec
from tests.support.ranks import launch

TRAIN_SAMPLERS = [(style, sampler) for style, samplers in STYLES.items() for sampler in samplers if sampler != "full_scan"]


def builtin_task(name: str, dataset: Digits):
    options = {
        "image_classification": {"model": "small_cnn", "image_size": 16, "augment": "crop_flip"},
        "language_model": {"layers": 1, "width": 32, "heads": 2},
    }[name]
    data = DataSpec(uri=dataset.train, val_uri=dataset.val)
    return build_task(name, options, dataset_info(data, dataset.train), dataset_info(data, dataset.val))


@pytest.mark.parametrize("task_name", ["image_classification", "language_model"])
@pytest.mark.parametrize("style,sampler", TRAIN_SAMPLERS)
@pytest.mark.parametrize("uneven", ["drop", "pad"])
def test_every_builtin_task_with_every_strategy_reads_rows_exactly_once(
    task_name, style, sampler, uneven, digits, stdlib_tokens
) -> None:
    dataset = digits if task_name == "image_classification" else stdlib_tokens
    task = builtin_task(task_name, dataset)
    world_size = 3
    data = DataSpec(uri=dataset.train, style=style, sampler=sampler, uneven=uneven, batch_size=40, num_workers=0, seed=1)
    loaders = [build_train_loader(data, task.decoder(train=True), rank, world_size) for rank in range(world_size)]
    rows = loaders[0].source.plan.rows
    for epoch in (0, 1):
        seen, steps = [], []
        for loader in loaders:
            loader.set_epoch(epoch)
            batches = list(loader)
            steps.append(len(batches))
            for batch in batches:
                assert set(batch) == {*task.decoder(train=True).fields(), ROW_ID}
                seen += batch[ROW_ID].tolist()
        assert steps == [loaders[0].steps_per_epoch] * world_size  # equal steps on every rank
        counts = np.bincount(seen, minlength=rows)
        if uneven == "drop":
            assert counts.max() == 1 and len(seen) == rows - rows % world_size
        else:  # pad repeats rows from the start of the order, never skips one
            assert counts.min() == 1 and len(seen) == math.ceil(rows / (world_size * 40)) * world_size * 40


def test_language_model_batches_carry_the_ingested_sequences(stdlib_tokens) -> None:
    """Through a DataLoader worker and shared memory: each row's tokens as Lance stores them."""
    import lance

    task = builtin_task("language_model", stdlib_tokens)
    loader = build_train_loader(DataSpec(uri=stdlib_tokens.train, batch_size=16, num_workers=1), task.decoder(train=True), 0, 1)
    batch = next(iter(loader))
    stored = lance.dataset(stdlib_tokens.train).take(batch[ROW_ID].numpy(), columns=["tokens"]).column("tokens")
    assert batch["tokens"].shape == (16, 33) and batch["tokens"].tolist() == stored.to_pylist()
    assert task.vocab_size == 257 and task.sequence_length == 32


def test_a_task_checks_its_columns_and_classes_against_the_data(digits, stdlib_tokens) -> None:
    data = DataSpec(uri=digits.train, val_uri=digits.val)
    info = dataset_info(data, digits.train)
    with pytest.raises(TaskError) as caught:
        build_task("image_classification", {"label_column": "class", "image_column": "label"}, info, None)
    message = str(caught.value)
    assert (
        "task.options.label_column: column 'class' is not in" in message
        and "its columns:\n        image (binary), label (int64)\n" in message
    )
    assert "task.options.image_column: column 'label' of" in message and "is int64, expected binary" in message
    with pytest.raises(TaskError, match=r"(?s)num_classes is 5, but .* has 10 classes .*at least 10"):
        build_task("image_classification", {"num_classes": 5}, info, None)
    with pytest.raises(TaskError, match="column 'tokens' is not in"):
        build_task("language_model", {}, info, None)
    with pytest.raises(UserError, match=r"width \(30\) is not a multiple of task.options.heads \(4\)"):
        builtin_task("language_model", stdlib_tokens).__class__(
            builtin_task("language_model", stdlib_tokens).Options(width=30, heads=4), dataset_info(data, stdlib_tokens.train)
        )


def test_a_long_list_of_columns_is_listed_whole_on_lines_that_fit(tmp_path: Path) -> None:
    """A terminal wraps a long line wherever it ends, cutting a column's name in two: the error puts
    the columns on lines of their own, broken only between columns."""
    import lance
    import pyarrow as pa

    names = [f"annotation_{index:02d}_bounding_box" for index in range(30)]
    uri = str(tmp_path / "wide.lance")
    lance.write_dataset(pa.table({"image": [b""], "label": [0], **{name: [[1.0, 2.0]] for name in names}}), uri)
    with pytest.raises(TaskError) as caught:
        build_task("image_classification", {"label_column": "class"}, dataset_info(DataSpec(uri=uri), uri), None)
    lines = str(caught.value).splitlines()
    listing = lines[lines.index(next(line for line in lines if line.endswith("its columns:"))) + 1 : -1]
    assert listing and all(len(line) <= 100 and line.startswith("        ") for line in listing), "\n".join(lines)
    listed = [part for line in listing for part in line.strip().rstrip(",").split(", ")]
    assert listed == ["image (binary)", "label (int64)", *(f"{name} (list<item: double>)" for name in names)], lines


@pytest.mark.slow
def test_a_task_from_a_test_module_trains_on_two_local_ranks(tmp_path: Path, digits) -> None:
    """Named by import path; its decoder runs in a DataLoader worker of each rank."""
    spec_file = write_spec(
        tmp_path,
        digits,
        task={"name": "tests.custom_task:PixelMLP", "options": {"hidden": 32}},
        data={"num_workers": 1},
        train={"epochs": 3, "lr": 0.01},
    )
    spec = load_spec(spec_file).spec
    assert type(load_task(spec)).__name__ == "PixelMLP"
    process = launch(spec_file)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output
    accuracy = float(re.search(r"final validation accuracy: ([0-9.]+)", output).group(1))
    assert accuracy >= 0.8, output
    state = final_state(tmp_path)
    assert set(state["objects"]["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"} and state["objects"]["model"][
        "0.weight"
    ].shape == (32, 64)


@pytest.mark.slow
def test_language_model_trains_on_two_local_ranks_and_logs_its_tags(tmp_path: Path, stdlib_tokens) -> None:
    spec_file = write_spec(
        tmp_path,
        stdlib_tokens,
        task={"name": "language_model", "options": {"layers": 1, "width": 64, "heads": 2}},
        data={"num_workers": 1, "batch_size": 16},
        train={"epochs": 1, "max_steps": 60, "lr": 0.003, "warmup_epochs": 0.05},
    )
    process = launch(spec_file)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output
    bits = float(re.search(r"final validation bits per byte: ([0-9.]+) \(loss [0-9.]+, perplexity [0-9.]+\)", output).group(1))
    assert bits < 5.0, output  # a uniform guess over 257 tokens costs 8 bits
    logged = scalars(tmp_path / "runs")
    assert set(LanguageModel.tags) <= set(logged) and "train/accuracy" not in logged
    assert logged["train/bits_per_byte"][-1][1] < logged["train/bits_per_byte"][0][1]
    assert all(value > 0 for _, value in logged["train/tokens_per_s"])
    assert hparams_logged(tmp_path / "runs")["task.name"] == "language_model"


# ---- every built-in task option bounded --------------------------------------------------------


def builtin_numeric_options() -> list[tuple[str, str, type]]:
    """(task name, option, int or float) of every numeric option of every registered task."""
    from lance_hpc.tasks import TASKS, task_class

    found = []
    for name in TASKS:
        for option, field in task_class(name).Options.model_fields.items():
            candidates = typing.get_args(field.annotation) or (field.annotation,)
            if int in candidates or float in candidates:
                found.append((name, option, float if float in candidates else int))
    return found


BUILTIN_NUMERIC_OPTIONS = builtin_numeric_options()


def option_problems(task_name: str, option: str, value: Any) -> str:
    with pytest.raises(SpecError) as caught:
        validate_spec({"name": "bounds", "data": {"uri": "/d"}, "task": {"name": task_name, "options": {option: value}}})
    return str(caught.value)


def test_the_table_below_sees_every_numeric_task_option() -> None:
    assert {
        ("image_classification", "image_size", int),
        ("language_model", "dropout", float),
        ("language_model", "vocab_size", int),
    } <= set(BUILTIN_NUMERIC_OPTIONS)


@pytest.mark.parametrize(
    ("task_name", "option", "kind"),
    BUILTIN_NUMERIC_OPTIONS,
    ids=[f"{name}.{option}" for name, option, _ in BUILTIN_NUMERIC_OPTIONS],
)
def test_every_numeric_task_option_refuses_nan_infinity_negatives_and_huge_values(
    task_name: str, option: str, kind: type
) -> None:
    path = f"task.options.{option}"
    for value in (math.nan, math.inf, -math.inf):
        assert f"{path}: must be a finite number, got {value!r}" in option_problems(task_name, option, value)
    assert f"{path}: must be >" in option_problems(task_name, option, -1)
    assert f"{path}: must be <" in option_problems(task_name, option, 2**64 if kind is int else 1e300)


def test_task_option_bounds_are_inclusive_and_named_in_the_fix() -> None:
    assert "task.options.image_size: must be <= 4096, got 100000\n      fix: set a value <= 4096" in option_problems(
        "image_classification", "image_size", 100000
    )
    options = validate_spec(
        {
            "name": "bounds",
            "data": {"uri": "/d"},
            "task": {"name": "language_model", "options": {"layers": 1024, "vocab_size": 2**24}},
        }
    ).spec.task.options
    assert options["layers"] == 1024 and options["vocab_size"] == 2**24


def test_a_grey_level_task_trains_from_weights_in_a_local_file(tmp_path: Path, digits) -> None:
    """channels: 1 decodes grey levels ([B, 1, S, S] uint8, BT.601 luma), normalises with its own
    mean and std, builds small_cnn for one channel, and starts from task.options.weights."""
    grey = {"model": "small_cnn", "image_size": 16, "augment": "none", "channels": 1, "mean": [0.25], "std": [0.5]}
    first = load_spec(write_spec(tmp_path / "first", digits, task={"options": grey})).spec
    task = load_task(first)
    batch = next(iter(build_train_loader(first.data, task.decoder(train=True), 0, 1)))
    assert batch["image"].shape == (first.data.batch_size, 1, 16, 16) and batch["image"].dtype == torch.uint8
    on_device = task.to_device(batch, torch.device("cpu"))["image"]
    assert torch.allclose(on_device, (batch["image"].float() / 255 - 0.25) / 0.5, atol=1e-5)
    model = task.build_model()
    assert next(model.parameters()).shape[1] == 1  # the first convolution takes one channel
    weights = tmp_path / "grey.pt"
    torch.save(model.state_dict(), weights)

    spec_file = write_spec(
        tmp_path / "second",
        digits,
        task={"options": {**grey, "weights": str(weights)}},
        train={"max_steps": 2},
        logging={"progress": False},
    )
    started = load_task(load_spec(spec_file).spec)
    fresh = started.build_model()
    assert started.weights_file() == str(weights)
    load_weights(fresh, str(weights))
    assert same_weights(fresh.state_dict(), model.state_dict()) == []
    summary = train_here(spec_file)
    assert summary.status == "completed" and "val/accuracy" in summary.metrics


def test_image_options_that_do_not_fit_are_refused_with_their_path(tmp_path: Path, digits) -> None:
    def problems(options: dict) -> str:
        with pytest.raises(SpecError) as refused:
            load_spec(write_spec(tmp_path, digits, task={"options": options}))
        return str(refused.value)

    assert "task.options.channels" in problems({"channels": 2})
    assert "mean has 3 value(s) for 1 channel(s)" in problems({"model": "small_cnn", "channels": 1, "mean": [0.5, 0.5, 0.5]})
    assert "model resnet18 (torchvision) takes 3 channels, not 1" in problems({"model": "resnet18", "channels": 1})
    assert "std values must be greater than 0" in problems({"std": [0.2, 0.0, 0.2]})
    spec = load_spec(
        write_spec(tmp_path, digits, task={"options": {"model": "small_cnn", "weights": str(tmp_path / "none.pt")}})
    ).spec
    with pytest.raises(UserError, match=r"task.options.weights: .*none.pt does not exist"):
        load_weights(load_task(spec).build_model(), load_task(spec).weights_file())
    other = tmp_path / "other.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), other)
    spec = load_spec(write_spec(tmp_path, digits, task={"options": {"model": "small_cnn", "weights": str(other)}})).spec
    with pytest.raises(UserError, match=r"other.pt does not fit this model"):
        load_weights(load_task(spec).build_model(), load_task(spec).weights_file())


def test_a_task_that_still_defines_load_weights_is_told_weights_file_replaced_it(tmp_path: Path, digits) -> None:
    """The hook is no longer called: a task keeping it would silently train from random weights."""
    (tmp_path / "old_weights.py").write_text(
        "from lance_hpc.tasks.image import ImageClassification\n\n\n"
        "class OldWeights(ImageClassification):\n"
        "    def load_weights(self, model):\n"
        "        model.load_state_dict({})\n"
    )
    info = dataset_info(DataSpec(uri=digits.train), digits.train)
    with pytest.raises(UserError, match=r"(?s)defines load_weights\(model\), which lance_hpc no longer calls.*fix: return"):
        build_task(f"{tmp_path / 'old_weights.py'}:OldWeights", {}, info, None)
