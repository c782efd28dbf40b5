"""``lance-hpc render job.yaml [-o FILE] [--set ...]``: the sbatch script for your own ``sbatch``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from lance_hpc.cli.arguments import add_overrides, add_spec
from lance_hpc.cli.reporting import run_reporting_errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc render",
        description="Write the sbatch script and the resolved spec it runs; submit nothing (the same files as "
        "lance-hpc submit --render-only). Submit the script with sbatch.",
    )
    add_spec(parser)
    parser.add_argument("-o", "--output", type=Path, metavar="FILE", help="script path [<log_dir>/<name>.sbatch]")
    add_overrides(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: render(args.spec, args.set, args.output))


def render(spec_file: str, overrides: list[str], output: Path | None) -> int:
    from lance_hpc.launch.render import write_job_files
    from lance_hpc.spec import load_spec

    written_spec, script_path = write_job_files(load_spec(spec_file, overrides).spec, output)
    print(f"wrote {script_path}\n  (its tasks read {written_spec})\nsubmit it with: sbatch {script_path}")
    return 0
