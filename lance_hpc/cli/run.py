"""``lance-hpc run SPEC``: one rank of a job, as srun starts it; with ``--local``, the whole job here.

``python -m lance_hpc.run SPEC_FILE`` (:func:`rank_main`) is the command the batch script's srun
line starts in every task; ``lance_hpc/run.py`` holds SLURM's signals before it gets here.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.cli.arguments import add_overrides
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.cli.submit import SWEEP_HELP

EXIT_CODES = (
    "exit codes of a rank: 0 finished or requeued, 1 training failed (or the data store stayed down\n"
    "longer than data.io_timeout_s), 2 a problem in the spec or data that its message says how to fix,\n"
    "3 stopped by a signal with a checkpoint saved (run again to continue), 130 interrupted (Ctrl-C)\n"
    "before training began"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc run",
        description="Run a job spec. Without --local: this process is one rank of the job, as srun starts it in\n"
        "every task of the batch script (python -m lance_hpc.run SPEC_FILE); SLURM's (or torchrun's) variables\n"
        "say which rank. With --local: the whole job on this machine, N ranks (= lance-hpc submit SPEC --local).",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", help="job spec YAML file (for one rank: the resolved spec the batch script names)")
    parser.add_argument("--local", action="store_true", help="run every rank of the job on this machine, without SLURM")
    parser.add_argument("--nproc", type=int, metavar="N", help="with --local: processes [the spec's world size]")
    add_overrides(parser, condition="with --local: ")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help=f"with --local: {SWEEP_HELP}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.local:
        for given, option in ((args.nproc is not None, "--nproc"), (args.set, "--set"), (args.sweep, "--sweep")):
            if given:
                parser.error(f"{option} goes with --local (one rank runs the resolved spec as it is)")
        return run_one_rank(args.spec)
    return run_reporting_errors(lambda: run_locally(args.spec, args.set, args.sweep, args.nproc))


def run_locally(spec_file: str, overrides: list[str], sweeps: list[str], nproc: int | None) -> int:
    from lance_hpc.cli.submit import run_here
    from lance_hpc.spec import load_spec

    return run_here(load_spec(spec_file, overrides, sweeps=sweeps), nproc)


def rank_main(argv: Sequence[str] | None = None) -> int:
    """``python -m lance_hpc.run SPEC_FILE``: what srun starts in every task."""
    parser = argparse.ArgumentParser(
        prog="python -m lance_hpc.run",
        description="Run one rank of a job: the command the batch script's srun line starts in every task (and\n"
        "lance-hpc submit --local in every local process). SLURM's (or torchrun's) variables say which rank.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec_file", help="the resolved job spec (YAML) the batch script names")
    args = parser.parse_args(argv)
    return run_one_rank(args.spec_file)


def run_one_rank(spec_file: str) -> int:
    from lance_hpc.loading import worker_server

    worker_server.start_for_spec_file(spec_file)  # first: forked before the rank reads through Lance
    from lance_hpc.kinds.rank import run_rank

    return run_rank(spec_file)
