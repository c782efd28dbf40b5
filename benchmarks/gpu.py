"""The GPU section: a real model trained on every batch, fed by the default strategy from local disk
and over the S3 server at 25 ms, against synthetic batches that already sit on the GPU.

ResNet-50 (torchvision, no pretrained weights; built, moved and normalized as the image task does
for the trainer), bf16 autocast, channels-last, cuDNN autotuning, SGD with momentum, one GPU: each
measurement trains one step per batch and waits for the GPU at the end of each step, so the time
between steps splits into waiting for the next batch (the data-wait share) and the step itself.
The model is built and warmed on a synthetic batch before the loader starts, and the steps that
drain the batches the workers queued meanwhile are not timed: the window sees the loader keep up,
or not, in its steady state. The synthetic row reads no data at all: its rate is the model's, and
a loader that keeps up reads at its rate (the target: at least 0.95x of it).

Without a CUDA device the section measures nothing and says so; the same code trains on the CPU in
the tests (``Measurement.device``), with a small model and small images.
"""

from __future__ import annotations

from typing import Any, Iterator

from benchmarks import report
from benchmarks.sections import (
    DEFAULT_STRATEGY,
    Context,
    SectionReport,
    Summaries,
    common_fields,
    strategy_fields,
)
from lance_hpc.bench.configs import Measurement

MODEL = "resnet50"
LATENCY_MS = 25.0
WINDOW_S = 10.0  # the synthetic row's window (it has no epoch): steady GPU clocks, hundreds of steps
SYNTHETIC = "synthetic batches on the GPU"
LOCAL = f"{DEFAULT_STRATEGY}, local disk"
OVER_S3 = f"{DEFAULT_STRATEGY}, S3 {LATENCY_MS:g} ms"
TARGET = 0.95
CLASSES = 1000  # ImageNet's head; the photos' labels are folded into it


def has_cuda() -> bool:
    """Whether this machine has a CUDA device. The GPU's name comes from the measuring process
    (``Result.device_name``): this one, which runs the whole benchmark, never opens the device."""
    import torch

    return torch.cuda.is_available()


def skipped(context: Context) -> str | None:
    """Why the section measures nothing here, or None."""
    if context.tiny:
        return "--tiny: the GPU section measured nothing"
    if not has_cuda():
        return "no CUDA device on this machine, so the GPU section measured nothing"
    return None


def configs(context: Context) -> list[Measurement]:
    if skipped(context):
        return []
    data = context.sets[0]
    common = {
        **common_fields(data, context),
        "dataset": f"{data.spec.name}-gpu",
        "train_model": MODEL,
        "seconds": max(context.seconds, WINDOW_S),
    }
    server = context.server(LATENCY_MS)
    over_s3 = strategy_fields(
        data, "map", "distributed", context.workers, context.s3_uri(server, data.lance_uri), server.storage_options()
    )
    return [  # the loader-fed rows read a whole epoch; the synthetic one, which has none, a window
        Measurement(SYNTHETIC, "synthetic", **common),
        Measurement(
            LOCAL, "lance_hpc", data=strategy_fields(data, "map", "distributed", context.workers), full_epoch=True, **common
        ),
        Measurement(OVER_S3, "lance_hpc", data=over_s3, store_counters=True, full_epoch=True, **common),
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    reason = skipped(context)
    if reason:
        return SectionReport(["", f"gpu: {reason}"], ["", "## GPU", "", reason[0].upper() + reason[1:] + "."])
    name = f"{context.sets[0].spec.name}-gpu"
    rows = {label: summaries[(name, label)] for label in (SYNTHETIC, LOCAL, OVER_S3)}
    synthetic = rows[SYNTHETIC].images_per_s
    device = next((run[0].device_name for summary in rows.values() for run in summary.ok_runs), "a CUDA GPU")
    header = ["input", "images/s (min-max)", "x synthetic", "data-wait share", "worker CPU ms/img"]
    cells = [
        [
            label,
            report.rate_text(summary),
            report.ratio_text(summary.images_per_s, synthetic),
            f"{summary.data_wait_share:.1%}" if summary.ok_runs else "-",
            f"{summary.worker_cpu_ms_per_image:.2f}" if summary.ok_runs and label != SYNTHETIC else "-",
        ]
        for label, summary in rows.items()
    ]
    verdicts = [
        report.Target(
            f"{label} vs synthetic batches",
            synthetic > 0 and rows[label].images_per_s >= TARGET * synthetic,
            f"{rows[label].images_per_s / synthetic if synthetic else 0.0:.2f}x "
            f"({rows[label].images_per_s:,.0f} vs {synthetic:,.0f} img/s; wanted >= {TARGET}x)",
        )
        for label in (LOCAL, OVER_S3)
    ]
    title = (
        f"GPU: {MODEL} training (bf16, channels-last, batch {context.sets[0].spec.batch_size}) on {device}, "
        f"{context.workers} DataLoader workers"
    )
    text = ["", title, report.format_text(header, cells), "", "Targets (GPU):", *("  " + verdict.line() for verdict in verdicts)]
    markdown = [
        "",
        f"## {title}",
        "",
        report.format_markdown(header, cells),
        "",
        "## Targets (GPU)",
        "",
        *(f"- {verdict.line()}" for verdict in verdicts),
    ]
    return SectionReport(text, markdown, verdicts)


def synthetic_batches(config: Measurement) -> Iterator[dict[str, Any]]:
    """One batch of random pixels and labels made on the training device, handed out again and
    again: training at this rate reads nothing."""
    import torch

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(
        0, 256, (config.batch_size, 3, config.image_size, config.image_size), dtype=torch.uint8, generator=generator
    )
    batch = {
        "image": images.to(config.device).contiguous(memory_format=torch.channels_last),
        "label": torch.randint(0, CLASSES, (config.batch_size,), generator=generator).to(config.device),
    }
    while True:
        yield batch


class TrainStep:
    """One optimizer step of ``config.train_model`` per batch, on ``config.device``, the way the
    image task takes one for the trainer: the model from :func:`lance_hpc.tasks.models.build_model`, the
    pixels moved without blocking (from pinned memory) and normalized on the device by
    :func:`lance_hpc.tasks.image_decode.normalize`, channels-last and bf16 autocast on CUDA (fp32 and the
    default layout on the CPU). Each call waits for the device, so the caller's clock splits into
    waiting for data and training."""

    def __init__(self, config: Measurement) -> None:
        import torch

        from lance_hpc.tasks.models import build_model

        self.torch = torch
        self.device = torch.device(config.device)
        cuda = self.device.type == "cuda"
        torch.backends.cudnn.benchmark = cuda  # as runtime/environment.py sets it for a job that is not deterministic
        self.memory_format = torch.channels_last if cuda else torch.contiguous_format
        self.model = build_model(config.train_model, CLASSES).to(self.device).to(memory_format=self.memory_format).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda)
        self.device_name = torch.cuda.get_device_name(self.device) if cuda else "CPU"

    def __call__(self, batch: Any) -> None:
        from lance_hpc.tasks.image_decode import normalize

        torch = self.torch
        images, labels = (batch["image"], batch["label"]) if isinstance(batch, dict) else (batch[0], batch[1])
        inputs = normalize(images.to(self.device, non_blocking=True)).contiguous(memory_format=self.memory_format)
        targets = labels.to(self.device, non_blocking=True).long() % CLASSES
        with self.autocast:
            loss = torch.nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
