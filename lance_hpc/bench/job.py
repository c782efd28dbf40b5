"""One job's data pipeline measured (``lance-hpc bench job.yaml``) and tuned (``--tune``).

The pipeline measured is the job's own (its strategy, batch size and workers, its image size and
augmentation, one rank's share of the data) on this machine, without training, next to the
decode limit of the same images, so workers and batch size can be tuned before the job is
submitted. The command line is :mod:`lance_hpc.cli.bench`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from lance_hpc.bench import report
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import run_rounds
from lance_hpc.errors import UserError
from lance_hpc.storage.files import write_file

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec
    from lance_hpc.tasks.image import ImageOptions


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


def measurement_fields(spec: JobSpec, image: ImageOptions, seconds: float) -> dict[str, Any]:
    """What every measurement of a job's pipeline shares: its dataset, images and share of the data."""
    return dict(
        dataset="job",
        lance_uri=spec.data.uri,
        image_size=image.image_size,
        image_column=image.image_column,
        label_column=image.label_column,
        augment=image.augment,
        seconds=seconds,
        data_world_size=spec.slurm.world_size,
    )


def run_job_benchmark(
    job: str,
    overrides: Sequence[str],
    out: Path,
    runs: int | None = None,
    seconds: float | None = None,
    workers: Sequence[int] | None = None,
    batch_sizes: Sequence[int] | None = None,
) -> int:
    """Measure the data pipeline of the job spec ``job`` (``runs`` runs of ``seconds`` each), for
    each of ``workers`` and ``batch_sizes`` (default the job's own), and print the table; 1 if a
    measurement failed."""
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.spec import load_spec

    spec = load_spec(job, overrides=overrides).spec
    image = image_options(spec, job)
    data = spec.data
    ensure_dataset(data)
    cores = len(os.sched_getaffinity(0))
    runs = runs or 3
    seconds = seconds or 5.0
    world_size = spec.slurm.world_size
    common = measurement_fields(spec, image, seconds)
    configs = [Measurement(report.DECODE_LIMIT, "decode_limit", cores=cores, data=data.model_dump(mode="json"), **common)]
    for worker_count in workers or [data.num_workers]:
        for batch_size in batch_sizes or [data.batch_size]:
            fields = {**data.model_dump(mode="json"), "num_workers": worker_count, "batch_size": batch_size}
            configs.append(
                Measurement(
                    f"{data.style}/{data.sampler} workers={worker_count} batch={batch_size}",
                    "lance_hpc",
                    batch_size=batch_size,
                    num_workers=worker_count,
                    data=fields,
                    **common,
                )
            )
    print(f"measuring the data pipeline of {job} (rank 0 of {world_size}) on {report.machine_description()}")
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


def tune(job: str, overrides: Sequence[str], out: Path, seconds: float | None, budget_s: float, write: bool) -> int:
    """Search data.num_workers, data.prefetch_factor and data.io_depth for the job's own data on
    this machine, one setting at a time from the job's own (the best value of each is kept for the
    next), within ``budget_s``; print the choice and the runner-up, and with ``write`` put them into
    the spec file ``job``."""
    import time

    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.spec import load_spec
    from lance_hpc.spec.yaml_text import set_block_keys

    spec = load_spec(job, overrides=overrides).spec
    image = image_options(spec, job)
    data = spec.data
    if write:  # an alias or anchor it could not write is refused now, not after the measurements
        set_block_keys(Path(job).read_text(), "data", {name: int(getattr(data, name)) for name in TUNED}, job)
    ensure_dataset(data)
    cores = len(os.sched_getaffinity(0))
    cap = max(1, min(cores, spec.slurm.cpus_per_task))
    seconds = seconds or 3.0
    common = measurement_fields(spec, image, seconds)
    best = {name: int(getattr(data, name)) for name in TUNED}
    measured: dict[tuple[int, ...], float] = {}
    deadline = time.monotonic() + budget_s
    print(
        f"tuning the data pipeline of {job} (rank 0 of {spec.slurm.world_size}) on {report.machine_description()}: "
        f"{', '.join(f'data.{name}' for name in TUNED)}, up to {cap} workers (slurm.cpus_per_task {spec.slurm.cpus_per_task}, "
        f"{cores} cores here), {seconds:g} s a measurement, {budget_s:g} s in all"
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
                (summary,) = run_rounds([config], 1, out / "tune_work")
                measured[key] = summary.images_per_s if summary.ok_runs else 0.0
                print(f"  {label:<40} {measured[key]:>10,.0f} images/s", flush=True)
            stage[value] = measured[key]
        if stage:
            best[name] = max(stage, key=lambda value: stage[value])
        if out_of_time:
            print(f"  (the {budget_s:g} s budget ran out: the settings not measured keep the job's values)")
            break
    ranked = sorted(measured, key=lambda key: measured[key], reverse=True)
    if not ranked or measured[ranked[0]] == 0.0:
        print("no configuration read any images: see the logs under " + str(out / "tune_work"), file=sys.stderr)
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
    if not write:
        print(f"apply it: lance-hpc submit {job} {flags}  (or bench again with --write to put it in {job})")
        return 0
    return write_choice(job, choice, flags)


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
