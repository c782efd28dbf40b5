"""The choose section: what choosing the training rows costs, each figure against its peer measured
in the same run.

1. ``sampler: block`` over object storage: the block strategy (style map, runs of about
   ``data.block_kb`` of neighbouring rows, shuffled a window of ``data.block_window`` runs at a time)
   over the S3 benchmark server at 25 ms, against itself on local disk and against the default
   strategy on local disk; every strategy over S3 at 25 ms with the GET requests and bytes per image
   the server counted.
2. ``data.filter`` selecting half of the rows (``quality >= 0.5`` on a copy of the main set with a
   ``quality`` column), against the same rows written as a dataset of their own.
3. ``data.mix`` of three datasets (the main set's rows cut in three) weighted 0.5/0.3/0.2, drawing as
   many rows per epoch as the main set has, against the main set read alone.
4. Shuffle quality of every training strategy on data written in class order
   (:mod:`benchmarks.shuffle_quality`): batch statistics from the plan, and the validation accuracy
   of the quickstart model trained with the full permutation, with block and with sharded_fragment.
5. A request-rate model (:mod:`benchmarks.request_model`) from the GET requests and bytes per image
   of every strategy over S3.

The derived data sets are written once beside the benchmark's data sets, with the main set's schema
(its image column uncompressed, as lance_hpc's ingest writes it) and fragment size.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import report, request_model, shuffle_quality
from benchmarks.datasets import DataSet
from benchmarks.local import set_configs
from benchmarks.object_storage import dataset_name, s3_measurement
from benchmarks.report import Target
from benchmarks.sections import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Context,
    SectionReport,
    Summaries,
    common_fields,
    strategy_fields,
)
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import Summary
from lance_hpc.loading.sampling import FragmentTable
from lance_hpc.spec import DataSpec

BLOCK = ("lance_hpc map/block", "map", "block")
BLOCK_LABEL = BLOCK[0]
S3_LATENCY_MS = 25.0
FILTER = "quality >= 0.5"
FILTER_LABEL = f"lance_hpc map/distributed, data.filter '{FILTER}'"
OWN_LABEL = "lance_hpc map/distributed, the same rows as their own dataset"
MIX_WEIGHTS = (0.5, 0.3, 0.2)
MIX_LABEL = "lance_hpc map/distributed, data.mix of 3 sources 0.5/0.3/0.2"
# Bump when the derived data sets' layout changes, so old copies are rebuilt.
CHOSEN_FORMAT = 1
# The targets.
BLOCK_MAX_GETS_PER_IMAGE = 0.05
BLOCK_VS_OWN_LOCAL = 0.95
BLOCK_VS_DEFAULT_LOCAL = 0.9
FILTER_VS_OWN = 0.9
MIX_VS_SINGLE = 0.9
ACCURACY_POINTS = 1.0  # block within this many points of the full permutation
EPOCH_NOTE = (
    "GET/img and KB/img after 1st batch are the object-storage section's window; GET/img epoch and KB/img epoch "
    "count the whole epoch, the reads before its first batch included (block reads a window of runs whole, and the "
    "next one ahead, before its first batch), over the epoch's images. The block target and the request-rate model use "
    "the whole epoch."
)


def local_name(data: DataSet) -> str:
    """``Measurement.dataset`` of this section's local-disk rows beyond the shared baselines (kept
    apart, so that the local section's table does not list them)."""
    return f"{data.spec.name}-choose"


def work_dir(context: Context) -> Path:
    return context.out / "choose_work"


def records_path(context: Context) -> Path:
    return work_dir(context) / "train_records.jsonl"


# ---- the derived data sets ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChosenSets:
    quality_uri: str  # the main set with a ``quality`` column: row order, rows and bytes unchanged
    half_uri: str  # the rows FILTER selects, as their own dataset
    part_uris: tuple[str, ...]  # the main set's rows cut in three (row i goes to part i % 3)


def prepare_chosen(data: DataSet, data_dir: Path, log: Any = print) -> ChosenSets:
    """The derived data sets of ``data`` under ``data_dir``, written unless already there."""
    import lance
    import pyarrow as pa

    directory = data_dir / f"chosen-{data.spec.name}-{data.spec.count}"
    sets = ChosenSets(
        str(directory / "quality.lance"),
        str(directory / "quality_half.lance"),
        tuple(str(directory / f"part{index}.lance") for index in range(len(MIX_WEIGHTS))),
    )
    wanted = {"format": CHOSEN_FORMAT, "spec": asdict(data.spec)}
    manifest = directory / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()) == wanted:
        return sets
    log(f"writing the choose section's data sets in {directory} ...")
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    table = lance.dataset(data.lance_uri).to_table()
    rows = table.num_rows
    # Ranks in a seeded random order over the rows: exactly half are >= 0.5, spread over every fragment.
    quality = np.random.default_rng(data.spec.seed).permutation(rows) / rows
    with_quality = table.append_column("quality", pa.array(quality, pa.float64()))
    written = {
        "quality.lance": with_quality,
        "quality_half.lance": with_quality.filter(pa.array(quality >= 0.5)),
        **{f"part{index}.lance": table.take(np.arange(index, rows, len(MIX_WEIGHTS))) for index in range(len(MIX_WEIGHTS))},
    }
    for name, part in written.items():
        lance.write_dataset(part, str(staging / name), max_rows_per_file=data.spec.rows_per_fragment)
    (staging / "manifest.json").write_text(json.dumps(wanted))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return sets


# ---- the configurations ------------------------------------------------------------------------


def configs(context: Context) -> list[Measurement]:
    data = context.sets[0]
    chosen = prepare_chosen(data, context.data_dir)
    workers = context.workers
    here = {**common_fields(data, context), "dataset": local_name(data)}
    labels = {label for label, _, _ in STRATEGIES}
    found = [config for config in set_configs(data, context, with_ddp=False) if config.label in labels]
    found.append(
        Measurement(BLOCK_LABEL, "lance_hpc", data=strategy_fields(data, "map", "block", workers), full_epoch=True, **here)
    )
    for label, style, sampler in (*STRATEGIES, BLOCK):
        found.append(s3_measurement(context, data, S3_LATENCY_MS, label, style, sampler))
    filtered = {**strategy_fields(data, "map", "distributed", workers, chosen.quality_uri), "filter": FILTER}
    own = strategy_fields(data, "map", "distributed", workers, chosen.half_uri)
    mix = strategy_fields(data, "map", "distributed", workers)
    del mix["uri"]  # a mix's data.uri is its first source's
    mix.update(
        mix=[{"uri": uri, "weight": weight} for uri, weight in zip(chosen.part_uris, MIX_WEIGHTS)],
        mix_epoch_rows=data.spec.count,  # as many rows per epoch as the main set read alone
    )
    for label, fields in ((FILTER_LABEL, filtered), (OWN_LABEL, own), (MIX_LABEL, mix)):
        found.append(Measurement(label, "lance_hpc", data=fields, full_epoch=True, **here))
    records = records_path(context)
    records.parent.mkdir(parents=True, exist_ok=True)
    records.unlink(missing_ok=True)  # this run's trainings only
    digits = shuffle_quality.prepare_ordered_digits(context.data_dir)
    return found + shuffle_quality.training_configs(digits, records, context.tiny)


# ---- the report --------------------------------------------------------------------------------


def round_ratios(first: Summary, second: Summary) -> list[float]:
    """``first``'s rate over ``second``'s in each round where both ran without error (the rounds
    are interleaved, so each pair ran minutes apart, under the same load)."""
    ratios = []
    for one, other in zip(first.runs, second.runs):
        if not any(result.error for result in one + other):
            base = Summary(second.label, second.dataset, [other]).images_per_s
            ratios.append(Summary(first.label, first.dataset, [one]).images_per_s / base if base else 0.0)
    return ratios


def _ratio_target(name: str, summary: Summary, peer: Summary, wanted: float) -> Target:
    """``summary``'s median rate against ``peer``'s, with the ratio in each round."""
    rate, base = summary.images_per_s, peer.images_per_s
    ratio = rate / base if base else 0.0
    rounds = round_ratios(summary, peer)
    each = f"; by round {', '.join(f'{value:.2f}x' for value in rounds)}" if len(rounds) > 1 else ""
    return Target(name, ratio >= wanted, f"{ratio:.2f}x ({rate:,.0f} vs {base:,.0f} img/s{each}; wanted >= {wanted}x)")


def epoch_per_image(summary: Summary, counter: str, epoch_images: int) -> float:
    """Median over runs of an S3 server counter over the whole epoch (``epoch_<counter>``, the reads
    before the first batch included) per image of the epoch; 0 without counters."""
    values = [run[0].store.get(f"epoch_{counter}", 0.0) / epoch_images for run in summary.ok_runs if run[0].store]
    return float(np.median(values)) if values else 0.0


def _block_part(context: Context, summaries: Summaries) -> tuple[list[str], list[str], list[Target], dict[str, Any]]:
    """The table of every strategy on local disk and over S3 at 25 ms, the block targets, and the
    request-rate model from the S3 rows."""
    data = context.sets[0]
    name = data.spec.name
    s3 = dataset_name(name, S3_LATENCY_MS)
    local = {label: summaries[(name, label)] for label, _, _ in STRATEGIES}
    local[BLOCK_LABEL] = summaries[(local_name(data), BLOCK_LABEL)]
    grid = {label: {S3_LATENCY_MS: summaries[(s3, label)]} for label in local}
    header, rows = report.object_storage_rows(local, grid)
    default_rate = local[DEFAULT_STRATEGY].images_per_s
    epoch_images = data.spec.count  # whole batches: the first one and every later one
    per_image = {
        label: (
            epoch_per_image(by[S3_LATENCY_MS], "gets", epoch_images),
            epoch_per_image(by[S3_LATENCY_MS], "get_bytes", epoch_images) / 1000,
        )
        for label, by in grid.items()
    }
    drop, after = header.index("x 0 ms"), header.index("KB/img")  # one latency here, no 0 ms to compare with
    header[header.index("GET/img")], header[after] = "GET/img after 1st batch", "KB/img after 1st batch"
    header = [
        *header[:drop],
        "x default on local disk",
        *header[drop + 1 : after + 1],
        "GET/img epoch",
        "KB/img epoch",
        *header[after + 1 :],
    ]
    for row, label in zip(rows, [label for label in local for _ in range(2)]):
        on_s3 = row[1] != "local disk"
        summary = grid[label][S3_LATENCY_MS] if on_s3 else local[label]
        gets, kb = per_image[label]
        epoch_cells = [f"{gets:.3f}", f"{kb:,.1f}"] if on_s3 and summary.ok_runs else ["-", "-"]
        row[:] = [
            *row[:drop],
            report.ratio_text(summary.images_per_s, default_rate),
            *row[drop + 1 : after + 1],
            *epoch_cells,
            *row[after + 1 :],
        ]
    block, block_local = grid[BLOCK_LABEL][S3_LATENCY_MS], local[BLOCK_LABEL]
    gets, kb = per_image[BLOCK_LABEL]
    counted = any(run[0].store for run in block.ok_runs)
    verdicts = [
        Target(
            "block at 25 ms: GET requests per image (whole epoch)",
            counted and gets <= BLOCK_MAX_GETS_PER_IMAGE,
            f"{gets:.3f} (wanted <= {BLOCK_MAX_GETS_PER_IMAGE}; the default strategy {per_image[DEFAULT_STRATEGY][0]:.2f}; "
            f"{kb / max(gets, 1e-9) / 1000:.2f} MB per GET)"
            if counted
            else "no counters read (the run failed)",
        ),
        _ratio_target("block at 25 ms vs block on local disk", block, block_local, BLOCK_VS_OWN_LOCAL),
        _ratio_target(
            "block at 25 ms vs the default strategy on local disk", block, local[DEFAULT_STRATEGY], BLOCK_VS_DEFAULT_LOCAL
        ),
    ]
    rates = request_model.request_rates(
        {label: figures for label, figures in per_image.items() if grid[label][S3_LATENCY_MS].ok_runs}
    )
    model_header, model_rows = request_model.table_rows(rates)
    block_kb, window = DataSpec.model_fields["block_kb"].default, DataSpec.model_fields["block_window"].default
    title = (
        f"sampler: block over object storage: {name} on local disk and over the S3 server at {S3_LATENCY_MS:g} ms "
        f"({context.workers} workers, batch {data.spec.batch_size}; block at its defaults, block_kb {block_kb}, block_window {window})"
    )
    model_title = f"request-rate model at {request_model.IMAGES_PER_S_PER_GPU:,.0f} images/s per GPU"
    text = [
        "",
        title,
        report.format_text(header, rows),
        EPOCH_NOTE,
        "",
        model_title,
        report.format_text(model_header, model_rows),
        request_model.assumptions(),
    ]
    markdown = [
        "",
        f"## Choose: {title}",
        "",
        report.format_markdown(header, rows),
        "",
        report.OBJECT_STORAGE_NOTE,
        "",
        EPOCH_NOTE,
        "",
        f"## Choose: {model_title}",
        "",
        report.format_markdown(model_header, model_rows),
        "",
        request_model.assumptions(),
    ]
    return text, markdown, verdicts, {"request_model": [asdict(rate) for rate in rates]}


def _chosen_part(context: Context, summaries: Summaries) -> tuple[list[str], list[str], list[Target]]:
    """data.filter against the same rows as a dataset, data.mix against the main set alone."""
    data = context.sets[0]
    single = summaries[(data.spec.name, DEFAULT_STRATEGY)]
    filtered, own, mixed = (summaries[(local_name(data), label)] for label in (FILTER_LABEL, OWN_LABEL, MIX_LABEL))
    count = data.spec.count
    header = ["configuration", "rows per epoch", "images/s (min-max)", "x its peer", "loader CPU ms/img", "first batch s"]

    def row(label: str, summary: Summary, rows: int, peer: Summary | None) -> list[str]:
        ok = bool(summary.ok_runs)
        return [
            label,
            f"{rows:,}",
            report.rate_text(summary),
            report.ratio_text(summary.images_per_s, peer.images_per_s) if peer else "-",
            f"{summary.cpu_ms_per_image:.2f}" if ok else "-",
            f"{summary.first_batch_s:.2f}" if ok else "-",
        ]

    rows = [
        row(f"{DEFAULT_STRATEGY} (the main set alone)", single, count, None),
        row(MIX_LABEL, mixed, count, single),
        row(OWN_LABEL, own, count // 2, None),
        row(FILTER_LABEL, filtered, count // 2, own),
    ]
    verdicts = [
        _ratio_target("data.filter (half the rows) vs those rows as their own dataset", filtered, own, FILTER_VS_OWN),
        _ratio_target("data.mix of 3 sources vs the main set alone", mixed, single, MIX_VS_SINGLE),
    ]
    title = (
        f"chosen rows on local disk: {data.spec.name}, {context.workers} workers, batch {data.spec.batch_size}; the filter's "
        "first batch includes its scan of the quality column"
    )
    text = ["", title, report.format_text(header, rows)]
    markdown = ["", f"## Choose: {title}", "", report.format_markdown(header, rows)]
    return text, markdown, verdicts


def _order_rows(orders: list[shuffle_quality.BatchOrder]) -> tuple[list[str], list[list[str]]]:
    header = [
        "strategy",
        "batches planned",
        "distinct labels per batch",
        "random permutation",
        "x random",
        "position spread (std / rows)",
        "random",
        "x random",
    ]
    rows = [
        [
            order.sampler,
            f"{order.batches:,}",
            f"{order.distinct_labels:.2f}",
            f"{order.random_distinct_labels:.2f}",
            f"{order.distinct_ratio:.2f}x",
            f"{order.spread:.3f}",
            f"{order.random_spread:.3f}",
            f"{order.spread_ratio:.2f}x",
        ]
        for order in orders
    ]
    return header, rows


def _shuffle_part(context: Context, summaries: Summaries) -> tuple[list[str], list[str], list[Target], dict[str, Any]]:
    """Batch statistics of every strategy on class-ordered digits (the trainings' settings) and on the
    main set in class order (the benchmark's settings), and the trainings' validation accuracy."""
    import lance

    from lance_hpc.loading.sampling import fragment_table
    from lance_hpc.loading.selection import select

    data = context.sets[0]
    digits = shuffle_quality.prepare_ordered_digits(context.data_dir)
    digits_labels = shuffle_quality.ordered_labels(digits.train_uri)
    digits_table = fragment_table(lance.dataset(digits.train_uri))
    main = lance.dataset(data.lance_uri)
    main_table = FragmentTable.from_rows(fragment_table(main).rows)
    main_run_rows = select(main, data.lance_uri, None).run_rows(DataSpec.model_fields["block_kb"].default)
    window = DataSpec.model_fields["block_window"].default
    batch = shuffle_quality.digits_batch_size()
    plans = {
        "digits": [
            shuffle_quality.batch_order(
                digits_labels,
                digits_table,
                sampler,
                batch,
                num_workers=1,  # the quickstart's num_workers 0: one reader, as the loader plans it
                run_rows=digits.run_rows,
                window_runs=shuffle_quality.DIGITS_WINDOW_RUNS,
            )
            for sampler, _ in shuffle_quality.STRATEGIES
        ],
        data.spec.name: [
            shuffle_quality.batch_order(
                shuffle_quality.ordered_labels(data.lance_uri),
                main_table,
                sampler,
                data.spec.batch_size,
                num_workers=context.workers,
                run_rows=main_run_rows,
                window_runs=window,
            )
            for sampler, _ in shuffle_quality.STRATEGIES
        ],
    }
    titles = {
        "digits": (
            f"shuffle quality, planned: the digits' {digits.rows:,} training rows in class order "
            f"({len(digits_table.rows)} fragments), batch {batch}, 1 rank; block at block_kb {digits.block_kb} "
            f"({digits.run_rows} rows a run), block_window {shuffle_quality.DIGITS_WINDOW_RUNS}; "
            f"{shuffle_quality.PLANNED_EPOCHS} epochs"
        ),
        data.spec.name: (
            f"shuffle quality, planned: {data.spec.name} ({data.spec.count:,} rows) in class order, batch "
            f"{data.spec.batch_size}, 1 rank, {context.workers} workers; block at its defaults ({main_run_rows} rows a run, "
            f"block_window {window}); {shuffle_quality.PLANNED_EPOCHS} epochs"
        ),
    }
    text: list[str] = []
    markdown: list[str] = []
    for key, orders in plans.items():
        header, rows = _order_rows(orders)
        text += ["", titles[key], report.format_text(header, rows)]
        markdown += ["", f"## Choose: {titles[key]}", "", report.format_markdown(header, rows)]
    records = shuffle_quality.read_records(records_path(context))
    accuracy = {
        sampler: float(np.median([r["accuracy"] for r in records[shuffle_quality.train_label(sampler)]]))
        for sampler in shuffle_quality.TRAINED
        if records.get(shuffle_quality.train_label(sampler))
    }
    full = accuracy.get("distributed")
    header = ["strategy", "epochs", "steps", "validation accuracy", "points vs full permutation", "job s (whole command)"]
    rows = []
    for sampler in shuffle_quality.TRAINED:
        label = shuffle_quality.train_label(sampler)
        summary = summaries.get(("digits-by-label", label))
        found = records.get(label)
        if not found or summary is None or not summary.ok_runs:
            rows.append([sampler, "-", "-", "failed", "-", "-"])
            continue
        points = f"{100 * (accuracy[sampler] - full):+.2f}" if full is not None else "-"
        seconds = summary.ok_runs[0][0].seconds
        rows.append(
            [sampler, f"{found[0]['epochs']}", f"{found[0]['steps']}", f"{accuracy[sampler]:.4f}", points, f"{seconds:.0f}"]
        )
    title = (
        "shuffle quality, trained: the quickstart model (small_cnn, 16 px, adamw) on the digits in class order, "
        "one local rank, batch 16; validation on the untouched validation split"
    )
    text += ["", title, report.format_text(header, rows)]
    markdown += ["", f"## Choose: {title}", "", report.format_markdown(header, rows)]
    block = accuracy.get("block")
    if full is None or block is None:
        verdicts = [Target("block's validation accuracy within 1 point of the full permutation", False, "a training failed")]
    else:
        gap = 100 * (block - full)
        verdicts = [
            Target(
                "block's validation accuracy within 1 point of the full permutation",
                gap >= -ACCURACY_POINTS,
                f"{gap:+.2f} points ({block:.4f} vs {full:.4f}; wanted >= -{ACCURACY_POINTS:g})",
            )
        ]
    found_json = {
        "batch_order": {key: [asdict(order) for order in orders] for key, orders in plans.items()},
        "trainings": records,
    }
    return text, markdown, verdicts, found_json


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    text, markdown, verdicts, found = _block_part(context, summaries)
    chosen_text, chosen_markdown, chosen_verdicts = _chosen_part(context, summaries)
    shuffle_text, shuffle_markdown, shuffle_verdicts, shuffle_found = _shuffle_part(context, summaries)
    verdicts += chosen_verdicts + shuffle_verdicts
    text += chosen_text + shuffle_text + ["", "Targets (choose):", *("  " + verdict.line() for verdict in verdicts)]
    markdown += chosen_markdown + shuffle_markdown
    markdown += ["", "## Targets (choose)", "", *(f"- {verdict.line()}" for verdict in verdicts)]
    return SectionReport(text, markdown, verdicts, json={"choose": {**found, **shuffle_found}})
