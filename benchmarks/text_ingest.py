"""The text ingest section: tokens per second, and each worker's peak memory against the corpus size.

A JSON Lines corpus is built from this interpreter's standard library sources (every ``.py`` file a
document with an id), repeated under new ids until it reaches a size, at two sizes ten times apart.
``lance-hpc ingest jsonl:... --tokenize`` tokenises it with 1 and 2 workers (UTF-8 bytes, and a BPE
trained here by ``lance-hpc tokenizer train``) and packs 1,024-token sequences. Memory is bounded
when the largest worker's peak RSS stays the same at ten times the corpus: the corpus, not the
worker, grows.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable

from benchmarks import report
from benchmarks.ingest import timed
from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.bench.runner import Summary

SEQUENCE_LENGTH = 1024
SIZES_MB = (320, 3200)  # --tiny: a sixty-fourth of each
FILE_MB = 16  # the corpus's JSON Lines files (each a shard)
BPE_VOCAB = 4096
RSS_LIMIT_MIB = 1024  # the largest worker's peak, whatever the corpus size
FLAT_RATIO = 1.25  # the larger corpus's worker peak over the smaller's
DATASET = "stdlib-text"


def label(size_mb: int, workers: int, tokenizer: str) -> str:
    return f"lance_hpc jsonl: {size_mb} MB, {tokenizer}, {workers} worker{'s' if workers > 1 else ''}"


def prepare_corpus(root: Path, size_mb: int) -> Path:
    """``size_mb`` MB of JSON Lines (``{"id", "text"}``), the standard library's sources repeated, made once."""
    from lance_hpc.ingest.formats.stdlib import PythonStdlib

    folder = root / f"stdlib-corpus-{size_mb}mb"
    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = PythonStdlib()
    paths = [path for shard in stdlib.shards("max_mb=1000") for path in stdlib.parts[shard].files]
    texts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in paths]
    written, in_file, copy, lines = 0, 0, 0, []
    while written < size_mb * 1_000_000:
        for path, text in zip(paths, texts):
            line = json.dumps({"id": f"{copy}/{path}", "text": text}) + "\n"
            lines.append(line)
            written += len(line)
            in_file += len(line)
            if in_file >= FILE_MB * 1_000_000 or written >= size_mb * 1_000_000:
                (folder / f"{len(list(folder.glob('*.jsonl'))):04d}.jsonl").write_text("".join(lines))
                lines, in_file = [], 0
            if written >= size_mb * 1_000_000:
                break
        copy += 1
    (folder / "done").write_text(str(written))
    return folder


def prepare_tokenizer(root: Path) -> Path:
    from lance_hpc.ingest.tokenizer import train

    out = root / f"stdlib-bpe-{BPE_VOCAB}.json"
    if not out.exists():
        train("python-stdlib:max_mb=4", out, vocab_size=BPE_VOCAB)
    return out


def _run_text(config: Measurement, out: Path) -> int:
    """Tokens written: rows x sequence length."""
    import lance

    from lance_hpc.cli.ingest import main

    arguments = [config.data["source"], str(out / "train.lance"), "--nproc", str(config.num_workers), "--tokenize"]
    arguments += ["--sequence-length", str(SEQUENCE_LENGTH), "--tokenizer", config.data["tokenizer"]]
    if main([*arguments, "--rows-per-fragment", "1024"]) != 0:
        raise RuntimeError("lance-hpc ingest failed (its error is above)")
    return lance.dataset(str(out / "train.lance")).count_rows() * SEQUENCE_LENGTH


RUNNERS: dict[str, Callable[[Measurement, Path], int]] = {"ingest_text": _run_text}


def measure(config: Measurement) -> Result:
    return timed(config, RUNNERS[config.kind])


def _sizes(context: Context) -> tuple[int, ...]:
    return tuple(max(size // 64, 1) for size in SIZES_MB) if context.tiny else SIZES_MB


def configs(context: Context) -> list[Measurement]:
    work = str(context.out / "ingest_work")
    bpe = f"hf:{prepare_tokenizer(context.data_dir)}"
    small, large = _sizes(context)
    plan = [(small, 1, "bytes"), (small, 2, "bytes"), (large, 2, "bytes"), (small, 2, bpe)]
    found = []
    for size, workers, tokenizer in plan:
        corpus = prepare_corpus(context.data_dir, size)
        name = "bytes" if tokenizer == "bytes" else f"BPE {BPE_VOCAB}"
        found.append(
            Measurement(
                label(size, workers, name),
                "ingest_text",
                dataset=DATASET,
                image_size=0,
                num_workers=workers,
                data={"out": work, "source": f"jsonl:{corpus}/*.jsonl", "tokenizer": tokenizer, "mb": size},
            )
        )
    return found


def _row(summary: Summary, megabytes: float) -> list[str]:
    ok = bool(summary.ok_runs)
    seconds = statistics.median(r.seconds for run in summary.ok_runs for r in run) if ok else 0.0
    peak = summary.worker_rss_mib if summary.worker_rss_mib else summary.main_rss_mib
    return [
        summary.label,
        report.rate_text(summary),
        f"{megabytes / seconds:,.1f}" if ok and seconds else "-",
        f"{seconds:.1f}" if ok else "-",
        f"{summary.main_rss_mib:,.0f}" if ok else "-",
        f"{summary.worker_rss_mib:,.0f}" if ok and summary.worker_rss_mib else "-",
        f"{megabytes / peak:,.1f}x" if ok and peak else "-",
    ]


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == DATASET}
    configs_by_label = {config.label: config for config in configs(context)}
    header = ["configuration", "tokens/s (min-max)", "MB/s", "s", "main MiB", "worker MiB", "corpus / worker peak"]
    cells = [_row(summary, configs_by_label[name].data["mb"]) for name, summary in found.items()]
    small, large = _sizes(context)
    title = (
        f"text ingest: the standard library's sources as JSON Lines, {small} and {large} MB, tokenised and packed "
        f"into {SEQUENCE_LENGTH}-token rows"
    )
    verdicts = []
    two_small, two_large = found.get(label(small, 2, "bytes")), found.get(label(large, 2, "bytes"))
    if two_small and two_large and two_small.ok_runs and two_large.ok_runs:
        ratio = two_large.worker_rss_mib / max(two_small.worker_rss_mib, 1e-9)
        verdicts.append(
            Target(
                f"largest worker's peak RSS, {large} MB corpus",
                two_large.worker_rss_mib < RSS_LIMIT_MIB,
                f"{two_large.worker_rss_mib:,.0f} MiB (target < {RSS_LIMIT_MIB} MiB)",
            )
        )
        verdicts.append(
            Target(
                f"peak RSS flat from {small} to {large} MB",
                ratio <= FLAT_RATIO,
                f"{ratio:.2f}x the smaller corpus's (target <= {FLAT_RATIO}x)",
            )
        )
    one = found.get(label(small, 1, "bytes"))
    scaling: dict[str, Any] = {}
    if one and two_small and one.images_per_s > 0:
        scaling = {"workers_2_vs_1": two_small.images_per_s / one.images_per_s}
    text = ["", title, report.format_text(header, cells), "", "Targets (text ingest):", *("  " + v.line() for v in verdicts)]
    if scaling:
        text.insert(3, f"2 workers: {scaling['workers_2_vs_1']:.2f}x one worker's tokens/s")
    markdown = [
        "",
        "## Text ingest",
        "",
        title,
        "",
        report.format_markdown(header, cells),
        "",
        *(f"- {v.line()}" for v in verdicts),
    ]
    return SectionReport(text, markdown, verdicts, [], {"text_ingest": {**scaling, "cpus": os.cpu_count()}})
