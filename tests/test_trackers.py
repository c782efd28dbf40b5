"""Experiment trackers on a real 2-rank job, offline: W&B's offline run files and MLflow's file
store are read back with the same scalars, hyperparameters and run name as TensorBoard's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lance_hpc.spec import SpecError, load_spec
from tests.support.jobs import write_spec
from tests.support.ranks import launch
from tests.support.wandb_files import read_run

pytestmark = pytest.mark.slow


def test_wandb_and_mlflow_offline_get_what_tensorboard_gets(tmp_path: Path, digits, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    (tmp_path / "wandb").mkdir()
    logging = {"progress": False, "log_every_steps": 10, "trackers": ["tensorboard", "wandb", "mlflow"], "group": "lr-sweep"}
    spec = write_spec(tmp_path, digits, name="tracked", train={"epochs": 1}, logging=logging)
    launcher = launch(spec)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    experiment = client.get_experiment_by_name("lr-sweep")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train.loss")
    assert [metric.step for metric in losses] == [10, 20, 30, 40, 45]
    assert run.data.params["train.lr"] == "0.003" and run.data.params["world_size"] == "2"
    assert "val.accuracy" in run.data.metrics

    (offline,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads later
    run = read_run(records)
    assert run["run"][1:] == ("tracked", "lr-sweep")
    history = {row["_step"]: row for row in run["history"]}
    assert sorted(history) == [10, 20, 30, 40, 45]
    for metric in losses:  # the very values MLflow got
        assert history[metric.step]["train/loss"] == pytest.approx(metric.value)
    assert "val/accuracy" in history[45]
    assert run["config"]["train.lr"] == 0.003 and run["config"]["world_size"] == 2


def test_a_tracker_that_is_not_installed_is_a_clear_error(tmp_path: Path, digits, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else real(name, *args))
    spec = write_spec(tmp_path, digits, logging={"trackers": ["tensorboard", "wandb"]})
    with pytest.raises(SpecError, match=r"(?s)logging.trackers.*wandb package, which is not installed here.*pip install wandb"):
        load_spec(spec)
