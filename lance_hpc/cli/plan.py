"""``lance-hpc plan job.yaml [--world-size N] [--set KEY=VALUE ...] [--check]``: the data plan."""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.cli.arguments import add_overrides, add_spec
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc plan",
        description="Show the data plan of a job spec: how its training rows split over the ranks, the steps of an "
        "epoch and the validation batches, from the dataset's metadata only (no data file is read); for an ingest, "
        "inference, evaluation or map job, what its ranks would read or write, as a dry run shows it.",
    )
    add_spec(parser)
    parser.add_argument(
        "--world-size", type=int, metavar="N", help="ranks to plan for (default: the spec's nodes x tasks per node)"
    )
    add_overrides(parser)
    parser.add_argument(
        "--check", action="store_true", help="also run the preflight check on the data (what submit runs before it submits)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: show_plan(args.spec, args.set, args.world_size, args.check))


def show_plan(spec_file: str, overrides: list[str], world_size: int | None, check: bool) -> int:
    from lance_hpc.kinds import registered_kind
    from lance_hpc.loading.plan import describe_eval, plan_data, preflight
    from lance_hpc.spec import load_spec

    spec = load_spec(spec_file, overrides).spec
    ranks = world_size or spec.slurm.world_size
    if ranks < 1:
        raise UserError("--world-size must be >= 1")
    if check:
        preflight(spec.data)
    kind = registered_kind(spec.job)
    if kind is not None and not kind.trains:  # ingest, infer, evaluate, map: the kind's own plan, as the dry run shows it
        print(f"{kind.name} plan of {spec.name}:\n{kind.plan(spec, spec_file)}")
        return 0
    plan = plan_data(spec.data, ranks)
    print(f"data plan of {spec.name}:")
    print(plan)
    print(describe_eval(spec.data, ranks))
    return 0
