"""``lance-hpc status SPEC_OR_JOB_ID``: where a job is, how far it got and how long it has left."""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.cli.arguments import target_parser
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.manage.status import PROG, show_status


def build_parser() -> argparse.ArgumentParser:
    parser = target_parser(
        PROG,
        "Show a job's SLURM state, restarts, checkpoint, last loss and throughput, and the time it has left.",
        (
            "The state comes from scontrol/squeue (and sacct where SLURM keeps accounting); once SLURM has\n"
            "forgotten a job, from what lance_hpc recorded in <slurm.log_dir>/jobs.jsonl and the job's log.\n\n"
            "examples:\n"
            "  lance-hpc status jobs/map_gpu.yaml          # the latest job of this spec\n"
            "  lance-hpc status jobs/map_gpu.yaml --all    # every job of this spec\n"
            "  lance-hpc status 1234"
        ),
    )
    parser.add_argument("--all", action="store_true", help="with a spec: every job it has had, oldest first")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    return run_reporting_errors(lambda: show_status(args.target, args.set, args.job, every=args.all), PROG)
