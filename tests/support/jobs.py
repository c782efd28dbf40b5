"""Helpers shared by the trainer tests: the digits dataset, tiny job specs, and reading back what a
run left behind (final weights, TensorBoard scalars, the rows each rank trained on) beside the rows
an epoch is planned to read."""

from __future__ import annotations

import collections
import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.ingest import ensure_dataset
from lance_hpc.loading import build_train_loader, load_task
from lance_hpc.loading.sampling import epoch_batches, fragment_table
from lance_hpc.runtime import trainer
from lance_hpc.runtime.context import Summary
from lance_hpc.runtime.entry import run_entry
from lance_hpc.runtime.environment import detect, process_group
from lance_hpc.runtime.preemption import Preemption
from lance_hpc.spec import DataSpec, IngestSpec, JobSpec, load_spec
from lance_hpc.storage.datasets import open_dataset

REPO_ROOT = Path(__file__).resolve().parents[2]
FINAL_ACCURACY = re.compile(r"final validation accuracy: ([0-9.]+)")
# Converges to >= 90% validation accuracy on the digits in a few epochs, deterministically, on CPU.
BASE_SPEC: dict[str, Any] = {
    "data": {"batch_size": 16, "num_workers": 0, "shuffle": True, "seed": 0},
    "task": {"name": "image_classification", "options": {"model": "small_cnn", "image_size": 16, "augment": "none"}},
    "train": {
        "epochs": 4,
        "optimizer": "adamw",
        "lr": 0.003,
        "lr_scaling": "none",
        "warmup_epochs": 0.5,
        "weight_decay": 0.0001,
        "precision": "fp32",
        "deterministic": True,
        "seed": 0,
        "collective_timeout_s": 60,
    },
    "checkpoint": {"every_steps": 10, "keep": 2},
    "logging": {"log_every_steps": 5, "progress": False},
}


@dataclass(frozen=True)
class Digits:
    train: str
    val: str


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Digits:
    """scikit-learn's digits in Lance (1,438 train / 359 validation rows), ingested once per session."""
    root = tmp_path_factory.mktemp("digits")
    dataset = Digits(str(root / "train.lance"), str(root / "val.lance"))
    ingest = IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=256, seed=0)
    ensure_dataset(DataSpec(uri=dataset.train, val_uri=dataset.val, ingest=ingest))
    return dataset


@pytest.fixture(scope="session")
def stdlib_tokens(tmp_path_factory: pytest.TempPathFactory) -> Digits:
    """A slice of the standard library's sources as 33-token sequences (train and validation)."""
    root = tmp_path_factory.mktemp("stdlib")
    dataset = Digits(str(root / "train.lance"), str(root / "val.lance"))
    ingest = IngestSpec(source="python-stdlib:max_mb=0.2", val_fraction=0.1, rows_per_fragment=500, seed=0, sequence_length=32)
    ensure_dataset(DataSpec(uri=dataset.train, val_uri=dataset.val, ingest=ingest))
    return dataset


def write_spec(directory: Path, dataset: Digits, name: str = "digits", **sections: Any) -> Path:
    """A job spec for ``dataset`` with outputs under ``directory``; ``sections`` override BASE_SPEC."""
    raw = copy.deepcopy(BASE_SPEC)
    raw["name"] = name
    raw["data"].update(uri=dataset.train, val_uri=dataset.val)
    raw["checkpoint"]["dir"] = str(directory / "checkpoints")
    raw["logging"]["tensorboard_dir"] = str(directory / "runs")
    # no standby ranks (started ahead of a restart) unless a test asks: on a machine of 2 cores their
    # imports would slow every other job of the suite; the restart tests ask for them
    raw["slurm"] = {"log_dir": str(directory / "logs"), "restart_standby": False}
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:  # a top-level value, e.g. entry
            raw[section] = values
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.spec.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def final_state(directory: Path) -> dict[str, Any]:
    """The newest checkpoint a run wrote under ``directory``."""
    found = resuming.load_latest(open_store(directory / "checkpoints"))
    assert found is not None, f"no checkpoint under {directory}"
    return found.state


def same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ (empty when the two models are bit-for-bit equal)."""
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``log_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def hparams_logged(log_dir: Path) -> dict[str, Any]:
    """The hyperparameters the hparams dashboard shows for ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind")) for name, value in start.hparams.items()}


def logged_rows(row_log: Path, world_size: int) -> list[list[list[int]]]:
    """Per rank, the row ids of every training batch, in order."""
    return [
        [[int(row) for row in line.split()] for line in (row_log / f"rank-{rank}.txt").read_text().splitlines()]
        for rank in range(world_size)
    ]


def planned_rows(spec: JobSpec, world_size: int, epoch: int) -> collections.Counter:
    """Every row an epoch is planned to read over ``world_size`` ranks, with its count."""
    table = fragment_table(open_dataset(spec.data.uri, None, {}))
    data = spec.data
    return collections.Counter(
        row
        for rank in range(world_size)
        for batch in epoch_batches(
            table,
            data.sampler,
            rank,
            world_size,
            data.batch_size,
            epoch=epoch,
            uneven=data.uneven,
            shuffle=data.shuffle,
            seed=data.seed,
        )
        for row in batch.tolist()
    )


def assert_epoch_resumes_in_place(spec: JobSpec, ranks: list[dict[str, Any]]) -> None:
    """Each rank's loader, restored from its position in a mid-epoch checkpoint (``ranks``), yields
    exactly what an uninterrupted pass of that epoch yields after that position: no batch twice,
    none skipped."""
    world_size = len(ranks)
    decoder = load_task(spec).decoder(train=True)
    for rank, saved in enumerate(ranks):
        position = saved["loaders"]["loader"]
        full = build_train_loader(spec.data, decoder, rank, world_size)
        full.set_epoch(position["epoch"])
        expected = list(full)[position["batches_consumed"] :]
        restored = build_train_loader(spec.data, decoder, rank, world_size)
        restored.load_state_dict(position)
        restored.set_epoch(position["epoch"])
        rest = list(restored)
        assert len(rest) == len(expected) == full.steps_per_epoch - position["batches_consumed"] > 0
        for batch, expected_batch in zip(rest, expected):
            assert batch.keys() == expected_batch.keys()
            assert all(torch.equal(batch[name], expected_batch[name]) for name in batch)


def train_here(spec_file: Path) -> Summary:
    """The built-in trainer in this process, as rank 0 of 1."""
    spec = load_spec(spec_file).spec
    with Preemption() as preemption, process_group(detect({}), spec.train.collective_timeout_s) as device:
        return run_entry(trainer.train, spec, detect({}), device, preemption, load_task(spec))


def check_trace(path: Path) -> None:
    """A profiler trace file: Chrome trace JSON with step spans, torch's operators and DDP's all-reduce."""
    trace = json.loads(path.read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("ProfilerStep#") for name in names), sorted(names)[:20]
    assert any(name.startswith("aten::") for name in names)  # the model's operators
    assert any("DistributedDataParallel" in name or "allreduce" in name.lower() for name in names)
