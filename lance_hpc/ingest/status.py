"""What an ingest says about itself without writing: the plan in a few lines (shards, each worker's
share, the rows estimated from the first shard), and how far the latest ingest into a dataset got,
from its records alone (``lance-hpc status``: no SLURM, no plan).
"""

from __future__ import annotations

import pyarrow.fs as pafs

from lance_hpc.errors import UserError
from lance_hpc.ingest.commit import describe_skips, totals
from lance_hpc.ingest.formats import FILES_PER_SHARD, is_builtin_source
from lance_hpc.ingest.plan import Plan, estimate_rows, source_options
from lance_hpc.ingest.records import Records, records_root
from lance_hpc.ingest.shards import list_shards, parse_source
from lance_hpc.ingest.target import Target, filesystem


def estimate_line(plan: Plan) -> str:
    rows = estimate_rows(plan)
    return "rows, estimated from the first shard: " + ", ".join(f"{split} about {count:,}" for split, count in rows.items())


def shard_summary(plan: Plan, world_size: int) -> list[str]:
    """The dry run's view: shards, bytes, and each worker's share."""
    lines = [f"{len(plan.shards)} shards of {plan.source_text}, {sum(s.bytes for s in plan.shards) / 2**20:,.1f} MiB"]
    for rank, indices in enumerate(plan.assignment(world_size)):
        size = sum(plan.shards[index].bytes for index in indices) / 2**20
        lines.append(f"  worker {rank}: {len(indices)} shards, {size:,.1f} MiB")
    return lines


def progress_lines(source_text: str, train: Target, world_size: int, files_per_shard: int = FILES_PER_SHARD) -> list[str]:
    """How far the latest ingest into ``train`` got, from its shard records (no SLURM, no plan)."""
    store, root = filesystem(records_root(train.uri), train.options)
    try:
        runs = [
            info
            for info in store.get_file_info(pafs.FileSelector(root, allow_not_found=True))
            if info.type == pafs.FileType.Directory
        ]
    except OSError as error:
        return [f"cannot read the shard records under {records_root(train.uri)}: {error}"]
    if not runs:
        return ["no shard written yet"]
    latest = max(runs, key=lambda info: info.mtime_ns or 0)
    records = Records(f"{records_root(train.uri)}/{latest.base_name}", train.options)
    found = list(records.finished().values())
    committed = records.committed()
    shards = []
    if is_builtin_source(source_text):  # status never imports the user's code: a format of one's own goes uncounted
        try:
            shards = list_shards(parse_source(source_text, source_options(source_text, None), files_per_shard=files_per_shard))
        except UserError:
            pass
    total = len(shards) or None
    rows, skipped = totals(found, ("train", "val"))
    written = f"{len(found)} of {total} shards" if total else f"{len(found)} shards"
    rows_text = ", ".join(f"{split} {count:,}" for split, count in rows.items() if count or split == "train")
    lines = [f"{written} written ({rows_text} rows; skipped {describe_skips(skipped)})"]
    if committed is not None:
        lines.append("committed: " + ", ".join(f"{split} version {version}" for split, version in committed.items()))
    elif total and len(found) < total:
        seconds = sum(record.seconds for record in found)
        done_bytes = sum(record.bytes for record in found)
        if seconds > 0 and done_bytes > 0:
            per_rank = done_bytes / seconds
            names = {record.shard for record in found}
            left = sum(shard.bytes for shard in shards if shard.id not in names)
            eta = left / (per_rank * max(world_size, 1))
            lines.append(
                f"about {eta / 60:.0f} min left: {left / 2**20:,.0f} MiB to go at {per_rank / 2**20:,.1f} MiB/s per rank "
                f"over {world_size} rank(s)"
            )
    return lines
