"""``lance-hpc submit JOB.yaml`` (also ``python -m lance_hpc.submit``): submit a job spec to SLURM
through submitit (default), write the script for your own sbatch (--render-only), show what would
happen (--dry-run), or run it on this machine (--local).

Every path writes the resolved spec as ``<log_dir>/<name>.spec.yaml`` and the script as
``<log_dir>/<name>.sbatch`` (:class:`lance_hpc.launch.paths.JobPaths`); the job's tasks read that
spec, so they run exactly what was shown. A sweep also writes one spec per run and submits one job
array; ``--local`` runs its runs one after another.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from lance_hpc.cli.arguments import add_overrides, add_spec
from lance_hpc.cli.reporting import run_reporting_errors

if TYPE_CHECKING:
    from lance_hpc.spec import LoadedSpec

SWEEP_HELP = (
    "sweep a spec field over values, e.g. --sweep train.lr=0.1,0.05 (repeatable: every combination is one run of "
    "one job array; adds to the spec's sweep section)"
)


def build_parser(prog: str = "lance-hpc submit") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Validate a job spec, render its sbatch script and submit it to SLURM through submitit;\n"
        "or only render it, dry-run it, or run it on this machine.",
        epilog="examples:\n"
        "  %(prog)s jobs/quickstart.yaml --local            # train here, 2 processes\n"
        "  %(prog)s jobs/map_gpu.yaml --dry-run             # show spec, script and data plan\n"
        "  %(prog)s jobs/map_gpu.yaml --set slurm.nodes=4   # submit with an override\n"
        "  %(prog)s jobs/map_gpu.yaml --sweep train.lr=0.1,0.05 --sweep data.batch_size=64,128\n"
        "                                                   # 4 runs as one job array\n"
        "  %(prog)s jobs/map_gpu.yaml --render-only -o job.sbatch && sbatch job.sbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_spec(parser)
    add_overrides(parser)
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help=SWEEP_HELP)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--render-only", action="store_true", help="write the sbatch script and the resolved spec; submit nothing")
    mode.add_argument(
        "--dry-run", action="store_true", help="print the resolved spec, the script and the data plan; write and submit nothing"
    )
    mode.add_argument(
        "--local",
        action="store_true",
        help="run the job on this machine without SLURM, each rank with the Python that runs this command (a sweep's runs "
        "one after another; a failed run does not stop the rest)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="with --render-only: script path [<log_dir>/<name>.sbatch]"
    )
    parser.add_argument("--nproc", type=int, metavar="N", help="with --local: processes [the spec's world size]")
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="submit without first checking that the dataset (and bucket, credentials) can be opened",
    )
    parser.add_argument(
        "--wait", action="store_true", help="after submitting, wait for the job and report how it ended (exit 1 if it failed)"
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "lance-hpc submit") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.output and not args.render_only:
        parser.error("-o/--output goes with --render-only")
    if args.nproc is not None and not args.local:
        parser.error("--nproc goes with --local")
    return run_reporting_errors(lambda: submit(args))


def submit(args: argparse.Namespace) -> int:
    """What the parsed command line asks for: a dry run, the files, a local run, or a submission."""
    from lance_hpc.launch.dry_run import dry_run
    from lance_hpc.launch.paths import JobPaths
    from lance_hpc.launch.render import write_job_files
    from lance_hpc.spec import load_spec

    loaded = load_spec(args.spec, args.set, sweeps=args.sweep)
    if args.dry_run:
        dry_run(loaded)
        return 0
    if args.render_only:
        _, script_path = write_job_files(loaded.spec, args.output)
        reads = JobPaths.of(loaded.spec).task_spec(bool(loaded.spec.sweep))
        print(f"wrote {script_path}\n  (its tasks read {reads})\nsubmit it with: sbatch {script_path}")
        return 0
    if args.local:
        return run_here(loaded, args.nproc)
    from lance_hpc.launch.submit import submit as submit_job

    return submit_job(loaded.spec, wait=args.wait, check=not args.no_preflight)


def run_here(loaded: LoadedSpec, nproc: int | None) -> int:
    """Run a loaded spec on this machine: ``nproc`` ranks (default its world size), or a sweep's
    runs one after another."""
    from lance_hpc.launch import local
    from lance_hpc.launch.render import write_job_files

    if loaded.spec.sweep:
        return local.run_sweep_locally(loaded.spec, nproc)
    spec_file, _ = write_job_files(loaded.spec)
    return local.run_local(spec_file, nproc or loaded.spec.slurm.world_size)
