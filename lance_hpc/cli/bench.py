"""``lance-hpc bench job.yaml`` (and ``python -m lance_hpc.bench``).

With a job spec (an ``image_classification`` job): measures that job's own data pipeline on this
machine without training, or tunes it with ``--tune`` (:mod:`lance_hpc.bench.job`).

Without one, in a checkout of the repository: the comparison with the peer loaders, which lives
outside the package (``python -m benchmarks``, run in its own process with the same arguments).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import lance_hpc
from lance_hpc.cli.arguments import add_overrides, int_list
from lance_hpc.cli.reporting import run_reporting_errors

DEFAULT_OUT = "bench_out"
# Options of the comparison benchmark only: given one, the arguments go to it.
COMPARISON_OPTIONS = ("--sections", "--tiny")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc bench",
        description="Measure a job spec's data pipeline on this machine, without training: one rank's loader "
        "(the job's strategy, workers, batch size, image size and augmentation) next to the decode limit of the "
        "same images, so data.num_workers and data.batch_size can be tuned before the job is submitted.",
        epilog="Without a job spec, from a checkout of the repository: the comparison of lance_hpc's loaders with "
        "the peers (python -m benchmarks --help).",
    )
    parser.add_argument("job", nargs="?", help="job spec YAML (an image_classification job)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT}/)")
    parser.add_argument("--runs", type=int, help="runs per configuration (default 3)")
    parser.add_argument("--seconds", type=float, help="measuring window per run after the first batch (default 5)")
    parser.add_argument("--workers", type=int_list, help="data.num_workers values to sweep, e.g. 2,4,8")
    parser.add_argument("--batch-size", type=int_list, help="data.batch_size values to sweep, e.g. 64,128")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="search data.num_workers, data.prefetch_factor and data.io_depth for this job's data here, within "
        "--budget-s; prints the choice and the runner-up",
    )
    parser.add_argument("--budget-s", type=float, default=180.0, help="--tune: time for all its measurements (default 180)")
    parser.add_argument("--write", action="store_true", help="--tune: write the choice into the job spec, keeping its comments")
    add_overrides(parser, example="data.num_workers=8", dest="overrides")
    return parser


def checkout_root() -> Path | None:
    """The repository this lance_hpc runs from, when it holds the comparison benchmarks beside the
    package (an editable install or a checkout on PYTHONPATH); None for an installed wheel. Only
    that directory's ``benchmarks/`` is ever run: never one found in the working directory."""
    root = Path(lance_hpc.__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "__main__.py").is_file() else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare = any(arg.split("=", 1)[0] in COMPARISON_OPTIONS for arg in argv)  # before parsing: --help is theirs then
    args, rest = build_parser().parse_known_args(argv) if not compare else (None, [])
    if compare or (args is not None and args.job is None and "-h" not in argv and "--help" not in argv):
        return run_comparison(argv)
    if rest or args is None:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    return run_reporting_errors(lambda: bench_job(args))


def bench_job(args: argparse.Namespace) -> int:
    from lance_hpc.bench import job

    if args.tune:
        return job.tune(args.job, args.overrides, Path(args.out), args.seconds, args.budget_s, args.write)
    return job.run_job_benchmark(args.job, args.overrides, Path(args.out), args.runs, args.seconds, args.workers, args.batch_size)


def run_comparison(argv: list[str]) -> int:
    """The peer comparison of the checkout this lance_hpc runs from, with the same arguments."""
    root = checkout_root()
    if root is None:
        build_parser().error(
            "give a job spec to measure its data pipeline; the comparison with the peer loaders runs from a "
            "checkout of the repository: python -m benchmarks"
        )
    # runpy with the checkout first on sys.path and the working directory nowhere (-P): "python -m"
    # would put it first, and a benchmarks/ or runpy.py there (anyone's) would run instead
    start = f"import runpy, sys; sys.path.insert(0, {str(root)!r}); runpy.run_module('benchmarks', run_name='__main__')"
    return subprocess.run([sys.executable, "-P", "-c", start, *argv]).returncode
