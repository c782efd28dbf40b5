"""The GPU section: a real model trained on every batch, fed by the default strategy from local disk
and over the S3 server at 25 ms, against synthetic batches that already sit on the GPU.

ResNet-50 (torchvision, no pretrained weights), bf16 autocast, channels-last, SGD with momentum,
one GPU: each measurement trains one step per batch and waits for the GPU at the end of each step,
so the time between steps splits into waiting for the next batch (the data-wait share) and the
step itself. The synthetic row reads no data at all: its rate is the model's, and a loader that
keeps up reads at its rate (the target: at least 0.95x of it).

Without a CUDA device the section measures nothing and says so; the same code trains on the CPU in
the tests (``Measurement.device``), with a small model and small images.
"""

from __future__ import annotations

from typing import Any, Iterator

from lance_hpc.bench import report
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.sections import DEFAULT_STRATEGY, Context, SectionReport, Summaries, common_fields, strategy_fields

MODEL = "resnet50"
LATENCY_MS = 25.0
WINDOW_S = 10.0  # per run after the first step: steady GPU clocks, several hundred steps
SYNTHETIC = "synthetic batches on the GPU"
LOCAL = f"{DEFAULT_STRATEGY}, local disk"
OVER_S3 = f"{DEFAULT_STRATEGY}, S3 {LATENCY_MS:g} ms"
TARGET = 0.95


def cuda_device() -> str | None:
    """The first CUDA device's name, or None where there is none (this section then measures nothing)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def configs(context: Context) -> list[Measurement]:
    if context.tiny or cuda_device() is None:
        return []
    data = context.sets[0]
    common = {**common_fields(data, context), "dataset": f"{data.spec.name}-gpu", "train_model": MODEL,
              "seconds": max(context.seconds, WINDOW_S)}
    server = context.server(LATENCY_MS)
    over_s3 = strategy_fields(data, "map", "distributed", context.workers, context.s3_uri(server, data.lance_uri),
                              server.storage_options())
    return [
        Measurement(SYNTHETIC, "synthetic", **common),
        Measurement(LOCAL, "lance_hpc", data=strategy_fields(data, "map", "distributed", context.workers), **common),
        Measurement(OVER_S3, "lance_hpc", data=over_s3, store_counters=True, **common),
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    device = cuda_device()
    if context.tiny or device is None:
        line = "gpu: no CUDA device on this machine, so the GPU section measured nothing"
        return SectionReport(["", line], ["", "## GPU", "", line + "."])
    name = f"{context.sets[0].spec.name}-gpu"
    rows = {label: summaries[(name, label)] for label in (SYNTHETIC, LOCAL, OVER_S3)}
    synthetic = rows[SYNTHETIC].images_per_s
    header = ["input", "images/s (min-max)", "x synthetic", "data-wait share", "loader CPU ms/img"]
    cells = [[label, report.rate_text(summary), report.ratio_text(summary.images_per_s, synthetic),
              f"{summary.data_wait_share:.1%}" if summary.ok_runs else "-",
              f"{summary.cpu_ms_per_image:.2f}" if summary.ok_runs and label != SYNTHETIC else "-"]
             for label, summary in rows.items()]
    verdicts = [
        report.Target(f"{label} vs synthetic batches", synthetic > 0 and rows[label].images_per_s >= TARGET * synthetic,
                      f"{rows[label].images_per_s / synthetic if synthetic else 0.0:.2f}x "
                      f"({rows[label].images_per_s:,.0f} vs {synthetic:,.0f} img/s; wanted >= {TARGET}x)")
        for label in (LOCAL, OVER_S3)
    ]
    title = (f"GPU: {MODEL} training (bf16, channels-last, batch {context.sets[0].spec.batch_size}) on {device}, "
             f"{context.workers} DataLoader workers")
    text = ["", title, report.format_text(header, cells), "", "Targets (GPU):",
            *("  " + verdict.line() for verdict in verdicts)]
    markdown = ["", f"## {title}", "", report.format_markdown(header, cells), "", "## Targets (GPU)", "",
                *(f"- {verdict.line()}" for verdict in verdicts)]
    return SectionReport(text, markdown, verdicts)


def synthetic_batches(config: Measurement) -> Iterator[dict[str, Any]]:
    """One batch of random pixels and labels made on the training device, handed out again and
    again: training at this rate reads nothing."""
    import torch

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (config.batch_size, 3, config.image_size, config.image_size), dtype=torch.uint8,
                           generator=generator)
    batch = {"image": images.to(config.device).contiguous(memory_format=torch.channels_last),
             "label": torch.randint(0, 1000, (config.batch_size,), generator=generator).to(config.device)}
    while True:
        yield batch


class TrainStep:
    """One optimizer step of ``config.train_model`` per batch, on ``config.device``: pixels moved
    from pinned memory without blocking, scaled to [0, 1] on the device, channels-last, bf16
    autocast on CUDA (fp32 elsewhere). Each call waits for the device, so the caller's clock
    splits into waiting for data and training."""

    def __init__(self, config: Measurement) -> None:
        import torch
        import torchvision

        self.torch = torch
        self.device = torch.device(config.device)
        self.model = torchvision.models.get_model(config.train_model, weights=None, num_classes=1000)
        self.model = self.model.to(self.device, memory_format=torch.channels_last).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def __call__(self, batch: Any) -> None:
        torch = self.torch
        images, labels = (batch["image"], batch["label"]) if isinstance(batch, dict) else (batch[0], batch[1])
        images = images.to(self.device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        inputs = images.float().div_(255) if images.dtype == torch.uint8 else images.float()
        targets = labels.to(self.device, non_blocking=True).long() % 1000
        with self.autocast:
            loss = torch.nn.functional.cross_entropy(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
