"""``lance-hpc ingest`` of a sharded source on this machine, over :mod:`lance_hpc.ingest.plan`,
``write``, ``records`` and ``commit``.

This process plans the shards; with ``--nproc N`` it starts each worker as the same command line
with ``--worker RANK/WORLD``, shows their progress, and commits once they are all done (with one,
it writes the shards itself).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from typing import Any, Callable, Sequence

from lance_hpc.errors import UserError
from lance_hpc.imports import child_environment, python_command
from lance_hpc.ingest.commit import commit, committed_line, unfilled_lines
from lance_hpc.ingest.plan import Plan, make_plan, resume_lines, source_options, tokens_of
from lance_hpc.ingest.records import Records, ShardRecord
from lance_hpc.ingest.shard_batches import ColumnMap
from lance_hpc.ingest.status import estimate_line, shard_summary
from lance_hpc.ingest.target import COMMAND_LINE_NAMES, targets
from lance_hpc.ingest.write import run_worker
from lance_hpc.storage.options import storage_options

# Seconds between progress lines of a local run with several workers.
PROGRESS_S = 2.0


def column_map(pairs: Sequence[str]) -> ColumnMap:
    """``--column NAME=FIELD`` options as the plan's column mapping."""
    chosen: dict[str, str] = {}
    for pair in pairs:
        name, sep, source_field = pair.partition("=")
        if not sep or name not in ("image", "label", "text", "key"):
            raise UserError(f"--column {pair!r}: give NAME=FIELD with NAME one of image, label, text, key")
        chosen[name] = source_field
    return ColumnMap(**chosen)


def ingest_shards(args: argparse.Namespace, arguments: list[str]) -> int:
    """``lance-hpc ingest parquet:... URI [--nproc N]``: plan, the workers (this process for one,
    else N processes), then the commit, with a summary."""
    spec_options = dict(option.split("=", 1) for option in args.storage_option if "=" in option)
    train, val = targets(
        args.uri,
        args.val_uri,
        storage_options(args.uri, spec_options),
        storage_options(args.val_uri, spec_options) if args.val_uri else None,
        COMMAND_LINE_NAMES,
    )
    if args.append and args.overwrite:
        raise UserError("--append and --overwrite: give one (append adds rows; overwrite replaces them in a new version)")
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: give 1 or more workers")
    plan = make_plan(
        args.source,
        train,
        val,
        columns=column_map(args.column),
        val_fraction=args.val_fraction if val is not None else 0.0,
        rows_per_fragment=args.rows_per_fragment,
        mode="append" if args.append else "overwrite" if args.overwrite else "create",
        on_corrupt=args.on_corrupt,
        max_pixels=args.max_pixels,
        check_targets=not args.worker,
        source_options=source_options(args.source, spec_options),
        tokens=tokens_of(args.source, args.tokenize, args.tokenizer, args.sequence_length),
        files_per_shard=args.files_per_shard,
        max_record_mb=args.max_record_mb,
    )
    if args.worker:
        rank, _, world = args.worker.partition("/")
        run_worker(plan, int(rank), int(world))
        return 0
    if args.dry_run:
        print("\n".join(shard_summary(plan, args.nproc)))
        print(f"schema: {', '.join(f'{item.name} ({item.type})' for item in plan.schema)}")
        print("\n".join([estimate_line(plan), *unfilled_lines(plan)]))
        return 0
    for line in resume_lines(plan):
        print(line, flush=True)
    records = plan.shard_records()
    if not plan.complete:
        before = len(records.finished())
        if before:
            print(f"resuming: {before} of {len(plan.shards)} shards were written by an earlier run", flush=True)
        if args.nproc == 1:
            run_worker(plan, 0, 1, progress=shower(records, plan))
        else:
            quiet = {**os.environ, "LANCE_LOG": os.environ.get("LANCE_LOG", "error")}  # not one warning per new fragment
            workers = [
                subprocess.Popen(
                    python_command("-m", "lance_hpc", "ingest", *arguments, "--worker", f"{rank}/{args.nproc}"),
                    env=child_environment(quiet),  # without the working directory on sys.path
                )
                for rank in range(args.nproc)
            ]
            wait_for(workers, records, plan)
    done = commit(plan)
    print(committed_line(plan, done))
    return 0


def shower(records: Records, plan: Plan) -> Callable[[ShardRecord], None]:
    """A progress line per shard written: shards done (of all), rows so far, rate."""
    finished, rows, started = len(records.finished()), [0], time.monotonic()

    def show(record: ShardRecord) -> None:
        nonlocal finished
        finished += 1
        rows[0] += sum(record.rows.values())
        rate = rows[0] / max(time.monotonic() - started, 1e-9)
        print(f"shard {finished}/{len(plan.shards)}: {record.shard} ({rows[0]:,} rows, {rate:,.0f} rows/s)", flush=True)

    return show


def wait_for(workers: list[Any], records: Records, plan: Plan) -> None:
    """Wait for the worker processes, showing shards and rows written, the rate and the time left;
    a failed worker fails the ingest (what the others recorded stays for the rerun)."""
    known = records.finished()
    earlier, started, shown, printed_at = set(known), time.monotonic(), -1, 0.0
    total_bytes = sum(shard.bytes for shard in plan.shards)
    while True:
        codes = [worker.poll() for worker in workers]
        known = records.finished(known)
        # a line when shards were written, at most every PROGRESS_S (and the last one)
        if len(known) != shown and (time.monotonic() - printed_at >= PROGRESS_S or len(known) == len(plan.shards)):
            shown, printed_at = len(known), time.monotonic()
            rows = sum(sum(record.rows.values()) for record in known.values())
            line = f"{shown}/{len(plan.shards)} shards written, {rows:,} rows"
            written_now = sum(record.bytes for index, record in known.items() if index not in earlier)
            if written_now:
                rate = written_now / max(time.monotonic() - started, 1e-9)
                left = total_bytes - sum(record.bytes for record in known.values())
                line += f", {rate / 2**20:,.1f} MiB/s, about {left / rate:,.0f} s left"
            print(line, flush=True)
        if all(code is not None for code in codes):
            break
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            for worker in workers:
                if worker.poll() is None:
                    worker.terminate()
            for worker in workers:
                worker.wait()
            break
        time.sleep(0.1)
    failed = [rank for rank, worker in enumerate(workers) if worker.returncode != 0]
    if failed:
        raise UserError(
            f"worker {failed[0]} failed (its error is above); the shards written so far are kept\n"
            "  fix: mend the cause and run the same command again: it writes only the missing shards"
        )
