"""The peer-loader section: the best loaders a user would otherwise pick, on the main data set's very
JPEG bytes, next to lance_hpc's default strategy in the same run, on local disk and over the S3
protocol from the benchmark server at 25 ms first-byte latency: LanceDB's StreamingDataset and
Permutation, MosaicML streaming (MDS shards) and LitData (optimized chunks).

Every peer has two rows: out of the box (its documented decode: PIL and torchvision transforms, or
LitData's own torchvision decode_jpeg) and fed lance_hpc's decode and resize, so the table tells the
loading machinery apart from the JPEG library. Every row has the same two DataLoader workers (the
LanceDB StreamingDataset one transform thread per worker), batch size and output size.

MDS and LitData read s3:// through their own boto3 clients into a local cache; each measurement
empties that cache first, so every row over S3 is a cold read (a second epoch would read their cache
from local disk). A peer whose package is not installed is left out with a note.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from benchmarks import report
from benchmarks.object_storage import dataset_name
from benchmarks.peers import PeerData, peer_paths, prepare_peers
from benchmarks.pipelines import PEER_PACKAGES
from benchmarks.report import Target
from benchmarks.sections import (
    DEFAULT_STRATEGY,
    Context,
    SectionReport,
    Summaries,
    common_fields,
    strategy_fields,
)
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import Summary

LATENCY_MS = 25.0
# (row label, pipeline kind); each gets a row per decode.
PEERS = (
    ("LanceDB StreamingDataset", "lancedb_streaming"),
    ("LanceDB Permutation", "lancedb_permutation"),
    ("MosaicML streaming (MDS)", "mosaic_streaming"),
    ("LitData", "litdata"),
)
DECODES = {"peer": "its decode", "lance_hpc": "lance_hpc decode"}
OUT_OF_BOX_FACTOR = 2.0  # the default strategy against each peer out of the box
SAME_DECODE_FACTOR = 1.1  # against the best peer fed lance_hpc's decode
NOTE = (
    "Out of the box: LanceDB and MosaicML streaming decode with PIL and resize with torchvision, as their "
    "documentation shows (MDS through its `jpeg` column type); LitData's `jpeg` serializer decodes with "
    "torchvision's `decode_jpeg` and a torchvision `Resize` follows. *lance_hpc decode*: the same bytes through "
    "lance_hpc's image decode and resize (libjpeg-turbo via simplejpeg, torch's antialiased uint8 resize). "
    "MDS and LitData read `s3://` into a local cache through their own clients; every measurement starts "
    "with that cache empty (a cold read). GETs and MB per image are the server's counts over the window."
)


def missing_packages() -> dict[str, str]:
    """Peer kinds whose package is not installed, with the pip name that brings it."""
    return {kind: pip for kind, (pip, module) in PEER_PACKAGES.items() if importlib.util.find_spec(module) is None}


def label(peer: str, decode: str) -> str:
    return f"{peer}, {DECODES[decode]}"


def _uri(paths: PeerData, kind: str, decode: str) -> str:
    """Local location of the copy a peer row reads (MDS: the ``bytes`` copy for lance_hpc's decode)."""
    if kind.startswith("lancedb"):
        return f"{paths.lancedb_dir}/train"
    if kind == "mosaic_streaming":
        return paths.mds_bytes if decode == "lance_hpc" else paths.mds_jpeg
    return paths.litdata


def configs(context: Context) -> list[Measurement]:
    """lance_hpc's default strategy and every installed peer, locally and at 25 ms over S3."""
    data = context.sets[0]
    missing = missing_packages()
    paths = prepare_peers(data) if not missing else peer_paths(data)
    common = common_fields(data, context)
    found = [
        Measurement(
            DEFAULT_STRATEGY,
            "lance_hpc",
            full_epoch=True,
            **common,
            data=strategy_fields(data, "map", "distributed", context.workers),
        )
    ]
    server = context.server(LATENCY_MS)
    s3 = {**common, "dataset": dataset_name(data.spec.name, LATENCY_MS)}
    found.append(
        Measurement(
            DEFAULT_STRATEGY,
            "lance_hpc",
            store_counters=True,
            full_epoch=True,
            **s3,
            data=strategy_fields(
                data, "map", "distributed", context.workers, context.s3_uri(server, data.lance_uri), server.storage_options()
            ),
        )
    )
    for peer, kind in PEERS:
        if kind in missing:
            continue
        for decode in DECODES:
            local_uri = _uri(paths, kind, decode)
            cache = str(context.out / "work" / "peer_cache" / f"{kind}-{decode}")
            found.append(
                Measurement(label(peer, decode), kind, **common, data={"uri": local_uri, "decode": decode, "cache_dir": cache})
            )
            found.append(
                Measurement(
                    label(peer, decode),
                    kind,
                    store_counters=True,
                    **s3,
                    data={
                        "uri": context.s3_uri(server, local_uri),
                        "decode": decode,
                        "cache_dir": cache,
                        "storage_options": server.storage_options(),
                    },
                )
            )
    return found


def _rate(summary: Summary | None) -> str:
    if summary is None or not summary.ok_runs:
        return "failed"
    rates = summary.rates()
    spread = f" ({min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else ""
    return f"{summary.images_per_s:,.0f}{spread}"


def _store(summary: Summary, key: str) -> float:
    """A store counter per image over the measured windows (median over runs)."""
    import statistics

    values = [sum(r.store.get(key, 0.0) for r in run) / max(1, sum(r.images for r in run)) for run in summary.ok_runs]
    return statistics.median(values) if values else 0.0


def rows(default: Summary, peers: list[Summary], over_s3: bool) -> tuple[list[str], list[list[str]]]:
    header = ["configuration", "images/s (min-max)", "default strategy / this", "CPU ms/img", "first batch s"]
    if over_s3:
        header += ["GETs/img", "MB/img"]
    found = []
    for summary in [default, *peers]:
        ok = bool(summary.ok_runs)
        ratio = default.images_per_s / summary.images_per_s if ok and summary.images_per_s else 0.0
        row = [
            summary.label,
            _rate(summary),
            f"{ratio:.2f}x" if ratio else "-",
            f"{summary.cpu_ms_per_image:.2f}" if ok else "-",
            f"{summary.first_batch_s:.2f}" if ok else "-",
        ]
        if over_s3:
            row += [f"{_store(summary, 'gets'):.3f}" if ok else "-", f"{_store(summary, 'get_bytes') / 1e6:.3f}" if ok else "-"]
        found.append(row)
    return header, found


def targets(default: Summary, peers: list[Summary], where: str) -> list[Target]:
    """Default strategy >= 2x each peer out of the box and >= 1.1x the best peer with lance_hpc's decode."""
    rate = default.images_per_s
    found = []
    for summary in peers:
        if summary.label.endswith(DECODES["peer"]):
            base = summary.images_per_s
            ratio = rate / base if base else 0.0
            found.append(
                Target(
                    f"{where}: default strategy vs {summary.label.rsplit(',', 1)[0]} out of the box",
                    ratio >= OUT_OF_BOX_FACTOR,
                    f"{ratio:.2f}x ({rate:,.0f} vs {base:,.0f} img/s; wanted >= {OUT_OF_BOX_FACTOR}x)"
                    if base
                    else "the peer's runs failed (see Failed runs)",
                )
            )
    same = [summary for summary in peers if summary.label.endswith(DECODES["lance_hpc"]) and summary.ok_runs]
    if same:
        best = max(same, key=lambda summary: summary.images_per_s)
        ratio = rate / best.images_per_s if best.images_per_s else 0.0
        found.append(
            Target(
                f"{where}: default strategy vs the best peer with lance_hpc's decode",
                ratio >= SAME_DECODE_FACTOR,
                f"{ratio:.2f}x ({rate:,.0f} vs {best.label.rsplit(',', 1)[0]} {best.images_per_s:,.0f} img/s; "
                f"wanted >= {SAME_DECODE_FACTOR}x)",
            )
        )
    return found


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    data = context.sets[0]
    name = data.spec.name
    text: list[str] = []
    markdown: list[str] = []
    verdicts: list[Target] = []
    tables: dict[str, Any] = {}
    for where, dataset, over_s3 in (
        ("local disk", name, False),
        (f"S3 at {LATENCY_MS:g} ms", dataset_name(name, LATENCY_MS), True),
    ):
        default = summaries[(dataset, DEFAULT_STRATEGY)]
        peers = [
            summaries[key]
            for key in summaries
            if key[0] == dataset and key[1] != DEFAULT_STRATEGY and any(key[1].startswith(peer + ",") for peer, _ in PEERS)
        ]
        header, cells = rows(default, peers, over_s3)
        title = (
            f"peer loaders, {where}: {name}, {context.workers} workers, batch {data.spec.batch_size}, "
            f"resized to {data.spec.image_size}"
        )
        text += ["", title, report.format_text(header, cells)]
        markdown += ["", f"## Peer loaders, {where}", "", report.format_markdown(header, cells)]
        verdicts += targets(default, peers, where)
        tables[where] = {"header": header, "rows": cells}
    missing = missing_packages()
    if missing:
        line = "left out, package not installed: " + ", ".join(f"{kind} (pip install {pip})" for kind, pip in missing.items())
        text += ["", line]
        markdown += ["", line + "."]
    text += ["", "Targets (peer loaders):", *("  " + verdict.line() for verdict in verdicts)]
    markdown += ["", NOTE, "", "## Targets (peer loaders)", "", *(f"- {verdict.line()}" for verdict in verdicts)]
    return SectionReport(text, markdown, verdicts, json={"peer_loaders": tables})
