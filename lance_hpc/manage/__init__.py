"""Day-two commands for submitted jobs: ``lance-hpc status | logs | cancel``, by job spec or job id.

``lance_hpc.slurm`` asks SLURM (scontrol, squeue, sacct where there is accounting) and maps a spec
to its jobs and back, ``progress`` reads what a job leaves behind (checkpoint, TensorBoard, log),
and ``status``, ``logs`` and ``cancel`` are the subcommands.

Looking at a job never runs its code: any user's job id can be named, so these commands read only
spec files the caller owns, and validate them without importing the task or entry they name
(:func:`~lance_hpc.slurm.records.load_own_spec`).
"""

from __future__ import annotations

import argparse

TARGET_HELP = "a job spec (the YAML you submitted) or a SLURM job id"


def target_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """The arguments every day-two command shares: the spec or job id, --set, --job."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", metavar="SPEC_OR_JOB_ID", help=TARGET_HELP)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the overrides the job was submitted with, if they changed its name or log_dir",
    )
    parser.add_argument("--job", metavar="ID", help="with a spec: which of its jobs [the latest]")
    return parser
