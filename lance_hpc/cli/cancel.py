"""``lance-hpc cancel SPEC_OR_JOB_ID``: stop a job after it saves a checkpoint, or at once with ``--now``."""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.cli.arguments import target_parser
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.manage.cancel import PROG, cancel_jobs


def build_parser() -> argparse.ArgumentParser:
    parser = target_parser(
        PROG,
        "Stop a job after it saves a checkpoint; --now stops it at once.",
        (
            "Without --now the job's ranks get SIGTERM (submitit jobs: USR2), agree at the next step, save a\n"
            "checkpoint and exit; this command waits for that, printing progress, up to --timeout seconds.\n"
            "Submitting the same spec again continues from that checkpoint.\n\n"
            "examples:\n"
            "  lance-hpc cancel jobs/map_gpu.yaml          # the latest job of this spec\n"
            "  lance-hpc cancel 1234 --timeout 900\n"
            "  lance-hpc cancel 1234 --now                 # at once: no checkpoint"
        ),
    )
    parser.add_argument("--now", action="store_true", help="cancel at once, the tasks killed before they can save")
    parser.add_argument(
        "--timeout", type=float, default=300.0, metavar="SECONDS", help="how long to wait for the checkpoint and the stop [300]"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")

    return run_reporting_errors(lambda: cancel_jobs(args.target, args.set, args.job, args.now, args.timeout), PROG)
