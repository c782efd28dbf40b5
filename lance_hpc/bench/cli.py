"""``lance-hpc bench job.yaml`` (and ``python -m lance_hpc.bench``).

With a job spec (an ``image_classification`` job): measures that job's own data pipeline (its
strategy, batch size and workers, its image size and augmentation, one rank's share of the data) on
this machine without training, next to the decode limit of the same images, so workers and batch
size can be tuned before the job is submitted.

Without one, in a checkout of the repository: the comparison with the peer loaders, which lives
outside the package (``python -m benchmarks``, run in its own process with the same arguments).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import lance_hpc
from lance_hpc.bench import report
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import run_rounds
from lance_hpc.errors import UserError
from lance_hpc.storage.files import write_file

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec
    from lance_hpc.tasks.image import ImageOptions

DEFAULT_OUT = "bench_out"
# Options of the comparison benchmark only: given one, the arguments go to it.
COMPARISON_OPTIONS = ("--sections", "--tiny")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 0, e.g. 2,4,8")
    return values


def image_options(spec: JobSpec, job: str) -> ImageOptions:
    """The image options of a job's task. The benchmark measures image decoding and resizing, so
    it takes image_classification jobs (or a task class that extends it) only."""
    from lance_hpc.tasks import task_class
    from lance_hpc.tasks.image import ImageClassification

    cls = task_class(spec.task.name)
    if not issubclass(cls, ImageClassification):
        raise UserError(
            f"{job}: task.name is {spec.task.name!r}, but lance-hpc bench measures the data pipelines of "
            "image_classification jobs only (image decode and resize)\n"
            "  fix: bench a job with task.name: image_classification, or time this task's data with a short "
            "training run (train.max_steps)"
        )
    return cls.Options.model_validate(spec.task.options)


def run_job_benchmark(args: argparse.Namespace) -> int:
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.spec import load_spec

    spec = load_spec(args.job, overrides=args.overrides).spec
    image = image_options(spec, args.job)
    data = spec.data
    ensure_dataset(data)
    out = Path(args.out)
    cores = len(os.sched_getaffinity(0))
    runs = args.runs or 3
    seconds = args.seconds or 5.0
    world_size = spec.slurm.world_size
    common: dict[str, Any] = dict(
        dataset="job",
        lance_uri=data.uri,
        image_size=image.image_size,
        image_column=image.image_column,
        label_column=image.label_column,
        augment=image.augment,
        seconds=seconds,
        data_world_size=world_size,
    )
    configs = [Measurement(report.DECODE_LIMIT, "decode_limit", cores=cores, data=data.model_dump(mode="json"), **common)]
    for workers in args.workers or [data.num_workers]:
        for batch_size in args.batch_size or [data.batch_size]:
            fields = {**data.model_dump(mode="json"), "num_workers": workers, "batch_size": batch_size}
            configs.append(
                Measurement(
                    f"{data.style}/{data.sampler} workers={workers} batch={batch_size}",
                    "lance_hpc",
                    batch_size=batch_size,
                    num_workers=workers,
                    data=fields,
                    **common,
                )
            )
    print(f"measuring the data pipeline of {args.job} (rank 0 of {world_size}) on {report.machine_description()}")
    print(f"{len(configs)} configurations x {runs} runs, {seconds:g} s window each, no training")
    summaries = run_rounds(configs, runs, out / "job_work")
    header, rows = report.table_rows(summaries)
    keep = [0, 1, 2, 6, 7, 8, 9, 10]  # the peers' ratio columns do not apply here
    print()
    print(report.format_text([header[i] for i in keep], [[row[i] for i in keep] for row in rows]))
    print(
        f"\nimages/s is one rank's loader on this machine's {cores} cores (the job asks for "
        f"slurm.cpus_per_task: {spec.slurm.cpus_per_task}). A training step that consumes images faster than this "
        "waits on data: raise data.num_workers up to the cores per task, or lower the decode cost "
        "(task.options.image_size)."
    )
    failures = [error for summary in summaries for error in summary.errors]
    for error in failures:
        print(f"failed: {error.strip().splitlines()[-1]}", file=sys.stderr)
    return 1 if failures else 0


# What --tune searches, one setting at a time from the job's own: each a data.* field.
TUNED = ("num_workers", "prefetch_factor", "io_depth")


def _candidates(name: str, current: int, cap: int) -> list[int]:
    if name == "num_workers":
        return sorted({value for value in (1, 2, 4, 8, 16, 32, 64) if value <= cap} | {min(current, cap)})
    if name == "prefetch_factor":
        return sorted({2, 4, current})
    return sorted({0, current, min(max(2 * current, 2), 16)})


def tune(args: argparse.Namespace) -> int:
    """Search data.num_workers, data.prefetch_factor and data.io_depth for the job's own data on
    this machine, one setting at a time from the job's own (the best value of each is kept for the
    next), within ``--budget-s``; print the choice and the runner-up, and ``--write`` them back."""
    import time

    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.spec import load_spec
    from lance_hpc.spec.yaml_text import set_block_keys

    spec = load_spec(args.job, overrides=args.overrides).spec
    image = image_options(spec, args.job)
    data = spec.data
    if args.write:  # an alias or anchor it could not write is refused now, not after the measurements
        set_block_keys(Path(args.job).read_text(), "data", {name: int(getattr(data, name)) for name in TUNED}, args.job)
    ensure_dataset(data)
    cores = len(os.sched_getaffinity(0))
    cap = max(1, min(cores, spec.slurm.cpus_per_task))
    seconds = args.seconds or 3.0
    common: dict[str, Any] = dict(
        dataset="job",
        lance_uri=data.uri,
        image_size=image.image_size,
        image_column=image.image_column,
        label_column=image.label_column,
        augment=image.augment,
        seconds=seconds,
        data_world_size=spec.slurm.world_size,
    )
    best = {name: int(getattr(data, name)) for name in TUNED}
    measured: dict[tuple[int, ...], float] = {}
    deadline = time.monotonic() + args.budget_s
    print(
        f"tuning the data pipeline of {args.job} (rank 0 of {spec.slurm.world_size}) on {report.machine_description()}: "
        f"{', '.join(f'data.{name}' for name in TUNED)}, up to {cap} workers (slurm.cpus_per_task {spec.slurm.cpus_per_task}, "
        f"{cores} cores here), {seconds:g} s a measurement, {args.budget_s:g} s in all"
    )
    out_of_time = False
    for name in TUNED:
        stage: dict[int, float] = {}
        for value in _candidates(name, best[name], cap):
            trial = {**best, name: value}
            key = tuple(trial[field] for field in TUNED)
            if key not in measured:
                if time.monotonic() > deadline:
                    out_of_time = True
                    break
                fields = {**data.model_dump(mode="json"), **trial}
                label = " ".join(f"{field}={trial[field]}" for field in TUNED)
                config = Measurement(
                    label, "lance_hpc", batch_size=data.batch_size, num_workers=trial["num_workers"], data=fields, **common
                )
                (summary,) = run_rounds([config], 1, Path(args.out) / "tune_work")
                measured[key] = summary.images_per_s if summary.ok_runs else 0.0
                print(f"  {label:<40} {measured[key]:>10,.0f} images/s", flush=True)
            stage[value] = measured[key]
        if stage:
            best[name] = max(stage, key=lambda value: stage[value])
        if out_of_time:
            print(f"  (the {args.budget_s:g} s budget ran out: the settings not measured keep the job's values)")
            break
    ranked = sorted(measured, key=lambda key: measured[key], reverse=True)
    if not ranked or measured[ranked[0]] == 0.0:
        print("no configuration read any images: see the logs under " + str(Path(args.out) / "tune_work"), file=sys.stderr)
        return 1
    choice = dict(zip(TUNED, ranked[0]))
    print(f"choice:    {' '.join(f'{k}={v}' for k, v in choice.items())}: {measured[ranked[0]]:,.0f} images/s")
    if len(ranked) > 1:
        second = ranked[1]
        print(
            f"runner-up: {' '.join(f'{k}={v}' for k, v in zip(TUNED, second))}: {measured[second]:,.0f} images/s "
            f"({measured[second] / measured[ranked[0]]:.2f}x the choice)"
        )
    flags = " ".join(f"--set data.{name}={value}" for name, value in choice.items())
    if not args.write:
        print(f"apply it: lance-hpc submit {args.job} {flags}  (or bench again with --write to put it in {args.job})")
        return 0
    return write_choice(args.job, choice, flags)


def write_choice(job: str, choice: dict[str, int], flags: str) -> int:
    """Put ``choice`` into the data section of the spec file ``job``, keeping its comments: the file
    is replaced whole (temporary file, fsync, rename, its mode kept), so a full disk or a crash
    leaves the spec as it was. A value that is an alias or an anchor is refused (UserError)."""
    from lance_hpc.spec.yaml_text import set_block_keys

    path = Path(os.path.realpath(job))  # a link to the spec: the file it names is the one to change
    updated = set_block_keys(path.read_text(), "data", choice, job)
    if updated is None:
        print(f"{job}: its data section is not a block mapping, so it was left as it is; apply it with: {flags}")
        return 0
    try:
        write_file(path, updated)
    except OSError as error:
        raise UserError(
            f"could not write {job}: {error.strerror or error}; it was left as it is\n"
            f"  fix: free space (or quota) there and tune again, or apply the choice: lance-hpc submit {job} {flags}"
        ) from None
    print(f"wrote {', '.join(f'data.{k}: {v}' for k, v in choice.items())} into {job} (its comments kept)")
    return 0


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(
        prog="lance-hpc bench",
        description="Measure a job spec's data pipeline on this machine, without training: one rank's loader "
        "(the job's strategy, workers, batch size, image size and augmentation) next to the decode limit of the "
        "same images, so data.num_workers and data.batch_size can be tuned before the job is submitted.",
        epilog="Without a job spec, from a checkout of the repository: the comparison of lance_hpc's loaders with "
        "the peers (python -m benchmarks --help).",
    )
    result.add_argument("job", nargs="?", help="job spec YAML (an image_classification job)")
    result.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT}/)")
    result.add_argument("--runs", type=int, help="runs per configuration (default 3)")
    result.add_argument("--seconds", type=float, help="measuring window per run after the first batch (default 5)")
    result.add_argument("--workers", type=_int_list, help="data.num_workers values to sweep, e.g. 2,4,8")
    result.add_argument("--batch-size", type=_int_list, help="data.batch_size values to sweep, e.g. 64,128")
    result.add_argument(
        "--tune",
        action="store_true",
        help="search data.num_workers, data.prefetch_factor and data.io_depth for this job's data here, within "
        "--budget-s; prints the choice and the runner-up",
    )
    result.add_argument("--budget-s", type=float, default=180.0, help="--tune: time for all its measurements (default 180)")
    result.add_argument("--write", action="store_true", help="--tune: write the choice into the job spec, keeping its comments")
    result.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. --set data.num_workers=8",
    )
    return result


def checkout_root() -> Path | None:
    """The repository this lance_hpc runs from, when it holds the comparison benchmarks beside the
    package (an editable install or a checkout on PYTHONPATH); None for an installed wheel. Only
    that directory's ``benchmarks/`` is ever run: never one found in the working directory."""
    root = Path(lance_hpc.__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "__main__.py").is_file() else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare = any(arg.split("=", 1)[0] in COMPARISON_OPTIONS for arg in argv)  # before parsing: --help is theirs then
    args, rest = parser().parse_known_args(argv) if not compare else (None, [])
    if compare or (args is not None and args.job is None and "-h" not in argv and "--help" not in argv):
        root = checkout_root()
        if root is None:
            parser().error(
                "give a job spec to measure its data pipeline; the comparison with the peer loaders runs from a "
                "checkout of the repository: python -m benchmarks"
            )
        # runpy with the checkout first on sys.path and the working directory nowhere (-P): "python -m"
        # would put it first, and a benchmarks/ or runpy.py there (anyone's) would run instead
        start = f"import runpy, sys; sys.path.insert(0, {str(root)!r}); runpy.run_module('benchmarks', run_name='__main__')"
        return subprocess.run([sys.executable, "-P", "-c", start, *argv]).returncode
    if rest or args is None:
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return tune(args) if args.tune else run_job_benchmark(args)
    except UserError as error:
        print(error, file=sys.stderr)
        return 2
