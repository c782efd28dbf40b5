"""The Loader section: :class:`lance_hpc.Loader` in a plain loop of your own, against the built-in
trainer's loader and against Lance's own ``lance.torch`` dataset, on the same rows.

The data is a token set generated here (fixed-size lists of int32, as ``lance-hpc ingest --tokenize``
writes them), so each loader hands the loop the same ``[batch, tokens]`` tensor and nothing but the
loader differs: no decode, no model. Four measurements, each in a fresh process, interleaved:

- the built-in trainer's loader (``build_train_loader`` with the language model's decoder), the
  default strategy (map-style, ``distributed``, shuffled), ``--workers`` worker processes;
- ``lance_hpc.Loader`` with the same strategy, batch and workers, dict batches of the column;
- ``lance_hpc.Loader`` with the ``sharded_batch`` strategy (iterable style): contiguous runs of a
  batch, their order shuffled each epoch, which is ``ShardedBatchSampler(randomize=True)``'s read
  pattern, with the same workers;
- ``lance.torch.data.LanceDataset`` with ``ShardedBatchSampler`` (randomised: batches spread over
  ranks as a ``DistributedSampler`` does, here rank 0 of 1), read in the loop's process by its
  read-ahead threads: it shards by rank, not by DataLoader worker, so workers would read every row
  once each.

Each reads one whole epoch; the rate is batches from the first to the last, over that time (its
start-up, the worker processes forking, is not counted). Each ratio is against the trainer's
loader, and against ``lance.torch``, in the same round; a verdict is the median of the rounds'
ratios, printed with the ratio of the median rates.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import torch

from benchmarks import report
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.bench.resources import ResourceSampler
from lance_hpc.bench.runner import Summary

TOKENS = 128  # a row: TOKENS + 1 token ids, the language model's inputs and targets
VOCAB = 50_257
BATCH = 64
ROWS, TINY_ROWS = 200_000, 2_048
ROWS_PER_FILE = 16_384  # fragments, for the strategies to spread reads over
TRAINER = "built-in trainer's loader (map/distributed)"
LOADER = "lance_hpc.Loader (map/distributed)"
LOADER_SHARDED = "lance_hpc.Loader (iterable/sharded_batch)"
LANCE_TORCH = "lance.torch LanceDataset + ShardedBatchSampler (in process)"
TARGET = 0.95  # the Loader's batches/s against the trainer's loader, at least


def token_set(context: Context) -> str:
    """The token dataset of this size under the data directory, written on first use."""
    import lance

    rows = TINY_ROWS if context.tiny else ROWS
    path = context.data_dir / f"loader_tokens_{rows}.lance"
    if not path.exists():
        ids = np.random.default_rng(0).integers(0, VOCAB, size=rows * (TOKENS + 1), dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(ids), TOKENS + 1)
        lance.write_dataset(pa.table({"tokens": column}), str(path), max_rows_per_file=ROWS_PER_FILE)
    return str(path)


def _trainer_batches(config: Measurement) -> Iterable[Any]:
    from lance_hpc.loading import build_train_loader
    from lance_hpc.spec import DataSpec
    from lance_hpc.tasks.language import TokenDecoder

    data = DataSpec(**config.data)
    return build_train_loader(data, TokenDecoder("tokens", TOKENS + 1), 0, 1)


def _loader_batches(config: Measurement) -> Iterable[Any]:
    from lance_hpc import Loader

    fields = dict(config.data)
    return Loader(fields.pop("uri"), columns=["tokens"], rank=0, world_size=1, **fields)


def _lance_torch_batches(config: Measurement) -> Iterable[Any]:
    from lance.sampler import ShardedBatchSampler
    from lance.torch.data import LanceDataset

    sampler = ShardedBatchSampler(rank=0, world_size=1, randomize=True, seed=0)
    return LanceDataset(config.data["uri"], config.batch_size, columns=["tokens"], sampler=sampler)


LOOPS: dict[str, Callable[[Measurement], Iterable[Any]]] = {
    "library_trainer": _trainer_batches,
    "library_loader": _loader_batches,
    "library_lance_torch": _lance_torch_batches,
}


def measure(config: Measurement) -> Result:
    """One epoch of the loop: rows and batches from the first batch to the last, over that time."""
    started = time.perf_counter()
    batches = LOOPS[config.kind](config)
    rows = count = 0
    checksum = 0
    with ResourceSampler() as resources:
        first = None
        for batch in batches:
            tokens = batch if isinstance(batch, torch.Tensor) else batch["tokens"]  # lance.torch: one column, bare
            checksum += int(tokens[:, 0].sum())  # the loop touches each batch, as a training step would
            if first is None:
                first, first_at = resources.mark(), time.perf_counter()
                continue
            rows += len(tokens)
            count += 1
        last = resources.mark()
    if first is None or count == 0:
        raise RuntimeError(f"{config.label}: the epoch had fewer than 2 batches")
    elapsed = time.perf_counter() - first_at
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=rows / elapsed,
        first_batch_s=first_at - started,
        images=rows,
        batches=count,
        seconds=elapsed,
        epoch_done=True,
        **resources.summary(first, last, rows),
    )


def configs(context: Context) -> list[Measurement]:
    uri = token_set(context)
    data = dict(uri=uri, style="map", sampler="distributed", batch_size=BATCH, num_workers=context.workers, shuffle=True, seed=0)
    sharded = {**data, "style": "iterable", "sampler": "sharded_batch"}
    common: dict[str, Any] = dict(dataset="tokens", batch_size=BATCH, num_workers=context.workers)
    return [
        Measurement(TRAINER, "library_trainer", data=data, **common),
        Measurement(LOADER, "library_loader", data=data, **common),
        Measurement(LOADER_SHARDED, "library_loader", data=sharded, **common),
        Measurement(LANCE_TORCH, "library_lance_torch", data={"uri": uri}, **{**common, "num_workers": 0}),
    ]


def _round_ratios(summary: Summary, baseline: Summary) -> list[float]:
    """Batches/s against the baseline's, round by round (both ran without error)."""
    return [
        mine[0].images_per_s / theirs[0].images_per_s
        for mine, theirs in zip(summary.runs, baseline.runs)
        if not any(result.error for result in mine + theirs) and theirs[0].images_per_s > 0
    ]


def _per_round(summary: Summary, baseline: Summary | None) -> str:
    ratios = _round_ratios(summary, baseline) if baseline else []
    return ", ".join(f"{ratio:.2f}x" for ratio in ratios) or "-"


def _comparison(summary: Summary | None, baseline: Summary | None) -> tuple[float, str] | None:
    """The median of the rounds' ratios of ``summary`` to ``baseline``, and a line with it and the
    ratio of the median rates (a round's ratio cancels a load both felt; the rates' medians do not)."""
    ratios = _round_ratios(summary, baseline) if summary and baseline else []
    if not ratios or not summary or not baseline or baseline.images_per_s <= 0:
        return None
    ratio = statistics.median(ratios)
    rates = summary.images_per_s / baseline.images_per_s
    return ratio, f"{ratio:.2f}x by the median of {len(ratios)} rounds' ratios, {rates:.2f}x by the ratio of the median rates"


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == "tokens"}
    trainer, lance_torch = found.get(TRAINER), found.get(LANCE_TORCH)
    header = [
        "loop over",
        "batches/s (median)",
        "rows/s (min-max)",
        "first batch s",
        "x trainer's loader, per round",
        "x lance.torch, per round",
    ]
    cells = [
        [
            label,
            f"{summary.images_per_s / BATCH:,.1f}" if summary.ok_runs else "-",
            report.rate_text(summary),
            f"{summary.first_batch_s:.2f}" if summary.ok_runs else "-",
            _per_round(summary, trainer),
            _per_round(summary, lance_torch),
        ]
        for label, summary in found.items()
    ]
    rows = TINY_ROWS if context.tiny else ROWS
    title = (
        f"The Loader in your own loop: one epoch of {rows:,} rows of {TOKENS + 1} int32 tokens, {BATCH} rows a batch, "
        f"shuffled, {context.workers} worker(s) for lance_hpc's loaders, nothing done with a batch but one sum; "
        "batches/s from the first batch to the last"
    )
    verdicts = []
    against_trainer = _comparison(found.get(LOADER), trainer)
    if against_trainer:
        ratio, detail = against_trainer
        verdicts.append(Target("Loader vs the trainer's loader", ratio >= TARGET, f"{detail} (target >= {TARGET}x)"))
    notes = [
        "lance.torch's LanceDataset reads in the loop's process (its own read-ahead threads): it shards by rank, "
        "so DataLoader workers would each read every row."
    ]
    against_lance = _comparison(found.get(LOADER_SHARDED), lance_torch)
    if against_lance:
        notes.append(f"The same read pattern, Loader iterable/sharded_batch vs lance.torch: {against_lance[1]}.")
    text, markdown = report.section_lines("The Loader in your own loop", title, header, cells, notes, verdicts)
    return SectionReport(text, markdown, verdicts)
