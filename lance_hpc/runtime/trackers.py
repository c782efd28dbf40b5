"""Experiment trackers beside TensorBoard (``logging.trackers``): Weights & Biases and MLflow get
the same scalars at the same steps, the flattened spec as hyperparameters, and the run's name;
a sweep's runs share ``logging.group`` (the sweep's name). Rank 0 only.

Credentials, servers and modes come from each tracker's own environment variables, never from the
spec: ``WANDB_API_KEY``, ``WANDB_MODE=offline`` (run files under ``WANDB_DIR``, synced later with
``wandb sync``), ``WANDB_PROJECT`` (default ``lance_hpc``), ``WANDB_ENTITY``;
``MLFLOW_TRACKING_URI`` (a server, or ``file:/path`` for a file store; default ``./mlruns``) and
``MLFLOW_EXPERIMENT_NAME`` (default: the group, else the job's name). A requeued or resumed job
continues the same tracker run: its id comes from the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lance_hpc.spec import JobSpec


def run_id(spec: JobSpec) -> str:
    """One id per training run: the same for every start of a job that resumes its checkpoints."""
    return hashlib.sha1(os.path.abspath(spec.checkpoint.dir).encode()).hexdigest()[:16]


class WandbLogger:
    def __init__(self, spec: JobSpec) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "lance_hpc"),
            name=spec.name,
            group=spec.logging.group,
            id=run_id(spec),
            resume="allow",
            dir=os.environ.get("WANDB_DIR") or spec.logging.tensorboard_dir,
            job_type=spec.job,
        )

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log(dict(scalars), step=step)

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None:
        self.run.config.update(dict(hparams), allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    def __init__(self, spec: JobSpec) -> None:
        import mlflow

        self.client = mlflow.tracking.MlflowClient()
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or spec.logging.group or spec.name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        key = run_id(spec)
        earlier = self.client.search_runs([experiment_id], filter_string=f"tags.`lance_hpc.run_id` = '{key}'", max_results=1)
        if earlier:
            self.run_id = earlier[0].info.run_id
        else:
            tags = {"lance_hpc.run_id": key, **({"lance_hpc.group": spec.logging.group} if spec.logging.group else {})}
            self.run_id = self.client.create_run(experiment_id, run_name=spec.name, tags=tags).info.run_id

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(__import__("time").time() * 1000)
        metrics = [Metric(tag.replace("/", "."), float(value), now, step) for tag, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        params = [Param(key[:250], str(value)[:6000]) for key, value in hparams.items() if key[:250] not in existing]
        for first in range(0, len(params), 100):  # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=params[first : first + 100])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Loggers:
    """Several loggers as one."""

    def __init__(self, loggers: Sequence[Any]) -> None:
        self.loggers = list(loggers)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(scalars, step)

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None:
        for logger in self.loggers:
            logger.log_hparams(hparams, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
