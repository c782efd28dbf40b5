"""The inference section: a model over every photo, its outputs written back as new columns.

Three measurements on the main data set (a fresh copy each, timed whole from a fresh process):
- the data pipeline alone: the photos decoded and resized by the task's evaluation decoder in the
  job's DataLoader workers, every row once, in order, nothing else;
- lance_hpc's inference job (``job: infer`` on one local rank with the same workers): the same
  rows through a small CNN, ``embedding`` (float16) and ``predicted`` written as one new data file
  per fragment and one commit;
- a hand-written loop as a user writes one without lance_hpc: a torch DataLoader over the table's
  rows (``take`` and Pillow in each worker), the same model, and the table rewritten at the end
  with its new columns (``lance.write_dataset`` of the whole table).

Reported: images/s, and the bytes each wrote against the new columns' own size (rows x bytes per row).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml
from torch import nn

from benchmarks import report
from benchmarks.ingest import timed
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result

IMAGE_SIZE = 64
BATCH = 64
EMBEDDING = 128
LOADER = "lance_hpc data pipeline alone (1 process, its workers)"
MODEL = "the model alone, on synthetic batches in memory"
JOB = "lance_hpc job: infer (1 rank, same workers)"
HAND = "hand-written loop (DataLoader + take, table rewritten)"
JOB_TARGET = 0.9  # the job vs the pipeline alone
WRITTEN: dict[str, int] = {}  # bytes a measurement wrote, read back by its Result's label
LOOP_S: dict[str, float] = {}  # the job's loop over its fragments, without starting Python and torch


def small_model(num_classes: int = 10) -> nn.Sequential:
    """Three conv blocks and a linear head, seeded: the same weights in every process."""
    from lance_hpc.tasks.models import small_cnn

    torch.manual_seed(0)
    model = small_cnn(num_classes).eval()
    assert isinstance(model, nn.Sequential)
    return model


_MODEL: list[nn.Sequential] = []


def predict(model: nn.Module | None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``infer.function`` of the job: the small model's penultimate features and prediction."""
    if not _MODEL:
        _MODEL.append(small_model())
    head, body = _MODEL[0][-1], _MODEL[0][:-1]
    features = body(batch["image"])
    return {"embedding": features, "predicted": head(features).argmax(dim=1)}


def _copy(config: Measurement, out: Path) -> Path:
    target = out / "photos.lance"
    shutil.copytree(config.data["lance_uri"], target)
    return target


def _files(uri: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in (uri / "data").glob("*.lance")}


def _spec(uri: Path, out: Path, workers: int) -> Path:
    raw = {
        "name": "bench_infer",
        "job": "infer",
        "slurm": {"tasks_per_node": 1, "log_dir": str(out / "logs")},
        "data": {"uri": str(uri), "batch_size": BATCH, "num_workers": workers},
        "task": {"name": "image_classification", "options": {"model": "small_cnn", "image_size": IMAGE_SIZE, "augment": "none"}},
        "checkpoint": {"dir": str(out / "checkpoints")},
        "logging": {"tensorboard_dir": str(out / "runs"), "progress": False},
        "infer": {"function": "benchmarks.infer:predict", "outputs": {"embedding": "float16", "predicted": "int64"}},
    }
    path = out / "infer.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _run_loader(config: Measurement, out: Path) -> int:
    import lance

    from lance_hpc.loading.loader import RowsLoader, dataset_info
    from lance_hpc.spec import load_spec
    from lance_hpc.tasks import build_task

    uri = _copy(config, out)
    spec = load_spec(_spec(uri, out, config.num_workers)).spec
    task = build_task(spec.task.name, spec.task.options, dataset_info(spec.data, str(uri)), None)
    rows = np.arange(lance.dataset(str(uri)).count_rows())
    batches = [rows[start : start + BATCH] for start in range(0, len(rows), BATCH)]
    loader = RowsLoader(spec.data, task.decoder(train=False), 0, str(uri), None, batches)
    seen = sum(len(batch["row_id"]) for batch in loader)
    WRITTEN[config.label] = 0
    return seen


def _run_job(config: Measurement, out: Path) -> int:
    uri = _copy(config, out)
    before = _files(uri)
    spec = _spec(uri, out, config.num_workers)
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "submit", str(spec), "--local", "--nproc", "1"],
        env=environ,
        cwd=Path(__file__).parents[1],
    )
    if done.returncode != 0:
        raise RuntimeError("the inference job failed (its output is above)")
    after = _files(uri)
    if any(after.get(name) != size for name, size in before.items()):
        raise RuntimeError("the inference job changed an existing data file")
    WRITTEN[config.label] = sum(size for name, size in after.items() if name not in before)
    # the rank's own loop over its fragments (read, model, write), from its fragment records
    records = [json.loads(path.read_text()) for path in uri.parent.glob(f".{uri.name}.infer/*/fragment-*.json")]
    LOOP_S[config.label] = sum(record["seconds"] for record in records)
    return sum(record["rows"] for record in records)


class _Rows(torch.utils.data.Dataset):
    """What a user writes: rows by index, each decoded with Pillow and resized."""

    def __init__(self, uri: str) -> None:
        import lance

        self.uri = uri
        self.dataset: Any = None  # opened in each worker, after the fork

        self.length = lance.dataset(uri).count_rows()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        import lance
        from PIL import Image

        if self.dataset is None:
            self.dataset = lance.dataset(self.uri)
        assert self.dataset is not None
        data = self.dataset.take([index], columns=["image"]).column("image")[0].as_py()
        image = Image.open(io.BytesIO(data)).convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE))
        return torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float().div(255)


def _run_hand(config: Measurement, out: Path) -> int:
    import lance
    import pyarrow as pa

    uri = _copy(config, out)
    before = sum(_files(uri).values())
    model = small_model()
    head, body = model[-1], model[:-1]
    loader = torch.utils.data.DataLoader(
        _Rows(str(uri)), batch_size=BATCH, num_workers=config.num_workers, multiprocessing_context="spawn"
    )
    embeddings, predicted = [], []
    with torch.inference_mode():
        for images in loader:
            features = body(images)
            embeddings.append(features.half().numpy())
            predicted.append(head(features).argmax(dim=1).numpy())
    table = lance.dataset(str(uri)).to_table()
    vectors = np.concatenate(embeddings)
    table = table.append_column("embedding", pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), EMBEDDING))
    table = table.append_column("predicted", pa.array(np.concatenate(predicted)))
    lance.write_dataset(table, str(uri), mode="overwrite")
    WRITTEN[config.label] = sum(_files(uri).values()) - before
    return table.num_rows


def _run_model(config: Measurement, out: Path) -> int:
    """What bounds the job on a CPU: the same model over as many rows, no data read at all."""
    import lance

    rows = lance.dataset(config.data["lance_uri"]).count_rows()
    images = torch.rand(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.inference_mode():
        for _ in range(0, rows, BATCH):
            outputs = predict(None, {"image": images})
            outputs["embedding"].half().numpy()
    WRITTEN[config.label] = 0
    return rows


RUNNERS: dict[str, Callable[[Measurement, Path], int]] = {
    "infer_loader": _run_loader,
    "infer_model": _run_model,
    "infer_job": _run_job,
    "infer_hand": _run_hand,
}


def measure(config: Measurement) -> Result:
    result = timed(config, RUNNERS[config.kind])
    result.bytes_written = WRITTEN.get(config.label, 0)
    if LOOP_S.get(config.label):  # images/s of the rank's loop; seconds stays the whole command's
        result.images_per_s = result.images / LOOP_S[config.label]
    return result


def configs(context: Context) -> list[Measurement]:
    data = context.sets[0]
    common: dict[str, Any] = dict(dataset=f"{data.spec.name}-infer", image_size=IMAGE_SIZE, num_workers=context.workers)
    work = str(context.out / "infer_work")
    return [
        Measurement(label, kind, data={"out": work, "lance_uri": data.lance_uri}, **common)
        for label, kind in ((LOADER, "infer_loader"), (MODEL, "infer_model"), (JOB, "infer_job"), (HAND, "infer_hand"))
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    data = context.sets[0]
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == f"{data.spec.name}-infer"}
    rows = next((s.ok_runs[0][0].images for s in found.values() if s.ok_runs), 0)
    column_bytes = rows * (EMBEDDING * 2 + 8)
    loader = found.get(LOADER)
    header = ["configuration", "images/s (min-max)", "x pipeline alone", "s", "MB written", "x the columns' size"]
    cells = []
    for label, summary in found.items():
        ok = bool(summary.ok_runs)
        written = max(run[0].bytes_written for run in summary.ok_runs) if ok else 0
        seconds = min(run[0].seconds for run in summary.ok_runs) if ok else 0.0
        cells.append(
            [
                label,
                report.rate_text(summary),
                report.ratio_text(summary.images_per_s, loader.images_per_s if loader else 0.0),
                f"{seconds:.1f}" if ok else "-",
                f"{written / 1e6:,.1f}" if ok and label in (JOB, HAND) else "-",
                f"{written / column_bytes:.2f}x" if ok and label in (JOB, HAND) and column_bytes else "-",
            ]
        )
    title = (
        f"inference: {rows:,} photos at {IMAGE_SIZE} px through a small CNN, embedding (float16 x {EMBEDDING}) and "
        f"predicted written back ({column_bytes / 1e6:.1f} MB of new columns); {context.workers} DataLoader workers; the job's "
        "images/s are its rank's loop over the fragments (read, model, write), its s the whole command with Python's start"
    )
    verdicts = []
    job, hand = found.get(JOB), found.get(HAND)
    if job and loader and loader.images_per_s > 0 and job.ok_runs:
        ratio = job.images_per_s / loader.images_per_s
        verdicts.append(
            Target("job: infer vs the data pipeline alone", ratio >= JOB_TARGET, f"{ratio:.2f}x (target >= {JOB_TARGET}x)")
        )
    model = found.get(MODEL)
    notes = []
    if job and model and model.images_per_s > 0 and job.ok_runs:
        bound = min(model.images_per_s, loader.images_per_s if loader else model.images_per_s)
        notes.append(f"the job runs at {job.images_per_s / bound:.2f}x the slower of the model alone and the pipeline alone")
    if job and hand and hand.images_per_s > 0 and job.ok_runs:
        ratio = job.images_per_s / hand.images_per_s
        verdicts.append(Target("job: infer vs the hand-written loop", ratio > 1.0, f"{ratio:.2f}x (target > 1x)"))
    text = [
        "",
        title,
        report.format_text(header, cells),
        *notes,
        "",
        "Targets (inference):",
        *("  " + v.line() for v in verdicts),
    ]
    markdown = [
        "",
        "## Inference",
        "",
        title,
        "",
        report.format_markdown(header, cells),
        *notes,
        "",
        *(f"- {v.line()}" for v in verdicts),
    ]
    return SectionReport(text, markdown, verdicts)
