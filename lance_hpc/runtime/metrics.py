"""Training metrics: a tiny logger interface (TensorBoard on rank 0, a null logger elsewhere) and
the meters whose sums all ranks reduce together.

The tags are part of the interface (dashboards and docs/manage.md name them); :data:`TAGS` lists them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lance_hpc.spec import JobSpec

# Tags every job writes; each task adds its own (``Task.tags``: train/loss, val/accuracy, ...).
TAGS: dict[str, str] = {
    "train/lr": "learning rate of the logged step",
    "perf/samples_per_s": "training samples per second, all ranks together",
    "perf/samples_per_s_per_rank": "training samples per second of one rank (mean over ranks)",
    "perf/step_time_s": "mean wall time of one optimizer step, data wait included",
    "perf/data_wait_share": "share of the step time spent waiting for the next batch (mean over ranks)",
    "perf/epoch_time_s": "wall time of the epoch that just ended (logged at its last step)",
    "data/store_retries": "batch reads retried after the object store failed them, all ranks, since the previous log point",
}


class MetricLogger(Protocol):
    def log(self, scalars: Mapping[str, float], step: int) -> None: ...

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """What every rank but rank 0 logs with."""

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        pass

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """TensorBoard event files under ``log_dir``.

    ``purge_step`` (the step a resumed job starts from) tells TensorBoard to hide what an earlier
    attempt logged from that step on, so a requeued run draws one continuous curve.
    """

    def __init__(self, log_dir: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Sequence[str]) -> None:
        """``hparams`` beside the ``metrics`` tags in the HParams tab."""
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        plain = (int, float, str, bool)
        values = {key: value if isinstance(value, plain) else str(value) for key, value in hparams.items()}
        # into this run's own event file (SummaryWriter.add_hparams would start a separate run)
        events = self.writer.file_writer
        assert events is not None  # a SummaryWriter opens its file writer when created
        for summary in hparams_summaries(values, dict.fromkeys(metrics, 0.0)):
            events.add_summary(summary)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def build_logger(spec: JobSpec, is_main: bool, purge_step: int | None = None) -> MetricLogger:
    """Rank 0's loggers, as logging.trackers names them (TensorBoard, W&B, MLflow); a null logger elsewhere."""
    if not is_main:
        return NullLogger()
    from lance_hpc.runtime.trackers import Loggers, MlflowLogger, WandbLogger

    loggers: list[Any] = []
    for tracker in spec.logging.trackers:
        if tracker == "tensorboard":
            loggers.append(TensorBoardLogger(spec.logging.tensorboard_dir, purge_step))
        elif tracker == "wandb":
            loggers.append(WandbLogger(spec))
        elif tracker == "mlflow":
            loggers.append(MlflowLogger(spec))
    return loggers[0] if len(loggers) == 1 else Loggers(loggers)


class TrainWindow:
    """Sums over the steps since the last log point: the task's metric sums (kept on the device,
    so no host sync per step), when the loop adds them, and step timings. :meth:`reduce` is one
    all-reduce, which every rank calls at the same step."""

    def __init__(self, device: torch.device, metric_names: Sequence[str]):
        self.device = device
        self.metric_names = tuple(metric_names)
        self.store_retries_seen = 0
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(len(self.metric_names), dtype=torch.float64, device=self.device)
        self.has_sums = False  # the loop added metric sums in this window
        self.samples = 0
        self.steps = 0
        self.step_time = 0.0
        self.data_wait = 0.0
        self.store_retries = 0

    def add_sums(self, sums: torch.Tensor) -> None:
        """One batch's metric sums, in the order of ``metric_names``."""
        if sums.numel() != len(self.metric_names):
            raise ValueError(
                f"{sums.numel()} metric sums given; expected one for each of {', '.join(self.metric_names)}, in that order"
            )
        self.sums += sums.detach().double().reshape(self.sums.shape)
        self.has_sums = True

    def add_samples(self, samples: int) -> None:
        self.samples += samples

    def add_step(self, step_time: float, data_wait: float) -> None:
        self.steps += 1
        self.step_time += step_time
        self.data_wait += data_wait

    def count_store_retries(self, total: int) -> None:
        """``total``: the reads this rank's loader has retried so far; the window counts the new ones."""
        self.store_retries += max(total - self.store_retries_seen, 0)
        self.store_retries_seen = total

    def reduce(self) -> tuple[dict[str, float], float, dict[str, float]]:
        """(the task's summed metrics, wall seconds of the window, perf/* and data/* values), over all ranks."""
        timing = torch.tensor(
            [self.samples, self.step_time, self.data_wait, self.store_retries], dtype=torch.float64, device=self.device
        )
        totals = torch.cat([self.sums, timing])
        dist.all_reduce(totals)
        values = totals.tolist()
        sums = dict(zip(self.metric_names, values))
        samples, step_time, data_wait, store_retries = values[len(self.metric_names) :]
        world_size = dist.get_world_size()
        seconds = step_time / world_size  # the ranks step together: mean wall time of the window
        steps = max(self.steps, 1)
        self.reset()
        return (
            sums,
            seconds,
            {
                "perf/samples_per_s": samples / max(seconds, 1e-9),
                "perf/samples_per_s_per_rank": samples / world_size / max(seconds, 1e-9),
                "perf/step_time_s": seconds / steps,
                "perf/data_wait_share": data_wait / max(step_time, 1e-9),
                "data/store_retries": store_retries,
            },
        )


class Stopwatch:
    """Time since construction or the last :meth:`lap`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed
