"""The data plan (``lance-hpc plan job.yaml``, ``--dry-run``) and the preflight check.

Both read metadata only: the manifest's fragment list and row counts, never a data file. A
dataset that ``data.ingest`` has yet to create is planned from the source's size instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lance_hpc.data.ingest import resolve_source
from lance_hpc.data.reader import fragment_table
from lance_hpc.data.sampling import (
    DataPlan,
    FragmentTable,
    eval_batches,
    plan_from_table,
)
from lance_hpc.data.shard_ingest import estimate_rows, plan_for_data
from lance_hpc.data.shards import is_shard_source
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.spec import DataSpec, load_spec
from lance_hpc.storage.datasets import dataset_exists, open_dataset, preflight_uri
from lance_hpc.storage.integrity import check_data_files
from lance_hpc.storage.options import storage_options


def _table_before_ingest(data: DataSpec) -> FragmentTable:
    """The fragment layout ingest will write for the training split (for a sharded source, estimated
    from a sample of its first shard)."""
    spec = data.ingest
    assert spec is not None
    if is_shard_source(spec.source):
        rows = estimate_rows(plan_for_data(data))["train"]
    else:
        train, official_val = resolve_source(spec.source)
        rows = len(train)
        if official_val is None and data.val_uri:
            rows -= int(round(rows * spec.val_fraction))
    per_fragment = spec.rows_per_fragment
    sizes = [per_fragment] * (rows // per_fragment) + ([rows % per_fragment] if rows % per_fragment else [])
    return FragmentTable.from_rows(sizes)


def plan_data(data: DataSpec, world_size: int) -> DataPlan:
    """One epoch of the job's training data for ``world_size`` ranks, from metadata only."""
    options = storage_options(data.uri, data.storage_options)
    if not dataset_exists(data.uri, options) and data.ingest is not None:
        return plan_from_table(
            _table_before_ingest(data),
            world_size,
            data.batch_size,
            style=data.style,
            sampler=data.sampler,
            uneven=data.uneven,
            uri=f"{data.uri} (to be ingested from {data.ingest.source})",
        )
    dataset = open_dataset(data.uri, data.version, options)
    return plan_from_table(
        fragment_table(dataset),
        world_size,
        data.batch_size,
        style=data.style,
        sampler=data.sampler,
        uneven=data.uneven,
        uri=data.uri,
        version=int(dataset.version),
    )


def describe_eval(data: DataSpec, world_size: int) -> str:
    """One line on the validation split: rows and steps per rank."""
    if not data.val_uri:
        return "  validation  none (data.val_uri is not set)"
    options = storage_options(data.val_uri, data.storage_options)
    if not dataset_exists(data.val_uri, options):
        return f"  validation  {data.val_uri} (to be ingested)"
    rows = open_dataset(data.val_uri, None, options).count_rows()
    steps = [len(eval_batches(rows, rank, world_size, data.batch_size, data.val_sampler)) for rank in {0, world_size - 1}]
    return f"  validation  {rows:,} rows, {data.val_sampler}: {min(steps):,}..{max(steps):,} steps per rank"


def preflight(data: DataSpec) -> None:
    """Raise a UserError with a clear message if the job could not open or read its data:
    unreachable endpoint or bucket, rejected credentials, missing dataset or version, a data file
    missing or cut short. Never prints secrets."""
    may_create = data.ingest is not None
    for uri, version in ((data.uri, data.version), (data.val_uri, None)):
        if uri:
            options = storage_options(uri, data.storage_options)
            preflight_uri(uri, options, version, may_create)
            check_data_files(uri, options, version)


def main(argv: Sequence[str] | None = None) -> int:
    """``lance-hpc plan job.yaml [--world-size N] [--set KEY=VALUE ...] [--check]``."""
    parser = argparse.ArgumentParser(prog="lance-hpc plan", description="Show the data plan of a job spec.")
    parser.add_argument("spec", help="job spec YAML")
    parser.add_argument("--world-size", type=int, help="ranks to plan for (default: the spec's nodes x tasks per node)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    parser.add_argument("--check", action="store_true", help="also run the preflight check on the data")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec, args.set).spec
        world_size = args.world_size or spec.slurm.world_size
        if world_size < 1:
            raise UserError("--world-size must be >= 1")
        if args.check:
            preflight(spec.data)
        plan = plan_data(spec.data, world_size)
        print(f"data plan of {spec.name}:")
        print(plan)
        print(describe_eval(spec.data, world_size))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR
    return 0
