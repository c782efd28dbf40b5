"""``lance-hpc logs SPEC_OR_JOB_ID``: a job's output across requeues, one rank's, or followed."""

from __future__ import annotations

import argparse
from typing import Literal, Sequence

from lance_hpc.cli.arguments import target_parser
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.manage.logs import PROG, print_logs


def build_parser() -> argparse.ArgumentParser:
    parser = target_parser(
        PROG,
        "Print a job's output: every run of the same job id, in one file pair.",
        (
            "examples:\n"
            "  lance-hpc logs jobs/map_gpu.yaml            # the latest job of this spec\n"
            "  lance-hpc logs jobs/map_gpu.yaml -f         # and follow it until it ends\n"
            "  lance-hpc logs 1234 --rank 3                # one rank's lines of job 1234\n"
            "  lance-hpc logs jobs/map_gpu.yaml --stderr   # only stderr (tracebacks, srun's messages)"
        ),
    )
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new output until the job ends")
    parser.add_argument("--rank", type=int, metavar="N", help="only rank N's lines (its task's files for submitit)")
    streams = parser.add_mutually_exclusive_group()
    streams.add_argument("--stdout", action="store_true", help="only the job's stdout")
    streams.add_argument("--stderr", action="store_true", help="only the job's stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rank is not None and args.rank < 0:
        parser.error("--rank must be 0 or more")
    stream: Literal["stdout", "stderr"] | None = "stdout" if args.stdout else "stderr" if args.stderr else None
    return run_reporting_errors(lambda: print_logs(args.target, args.set, args.job, args.rank, stream, args.follow), PROG)
