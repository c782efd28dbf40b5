"""``lance-hpc validate job.yaml [--set KEY=VALUE ...]``: check a job spec, list every problem."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Sequence

from lance_hpc.cli.arguments import add_overrides, add_spec
from lance_hpc.cli.reporting import run_reporting_errors

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc validate",
        description="Check a job spec; list every problem, each with its YAML path and how to fix it. A valid spec "
        "is summed up in one line, with how its placeholders resolved.",
    )
    add_spec(parser)
    add_overrides(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: validate(args.spec, args.set))


def validate(spec_file: str, overrides: list[str]) -> int:
    from lance_hpc.spec import load_spec
    from lance_hpc.spec.schema import entry_note

    loaded = load_spec(spec_file, overrides)
    check_own_format(loaded.spec, spec_file)
    slurm = loaded.spec.slurm
    what = f"{loaded.spec.data.style}/{loaded.spec.data.sampler}, {describe_task(loaded.spec)}"
    if loaded.spec.command is not None:  # it reads no data
        what = f"command {shlex.join(loaded.spec.command.argv)}"
    print(f"{spec_file}: valid ({loaded.spec.name}: {slurm.nodes} node(s) x {slurm.ntasks_per_node} task(s), {what})")
    for item in loaded.resolutions:
        print(f"  {item.path}: {item.before} -> {item.after}")
    note = entry_note(loaded.spec)
    if note:
        print(f"  {note}")
    return 0


def check_own_format(spec: JobSpec, spec_file: str) -> None:
    """A format of one's own in data.ingest.source imported and checked, as job and task.name are
    (the spec's layer knows only its form): one error when it is missing or not a ShardFormat."""
    from lance_hpc.ingest.formats import format_class, is_builtin_source, is_shard_source

    source = spec.data.ingest.source if spec.data.ingest is not None else ""
    if is_shard_source(source) and not is_builtin_source(source):
        format_class(source, where=f"{spec_file}: data.ingest.source: ")


def describe_task(spec: JobSpec) -> str:
    """``image_classification (resnet50)``, ``my_pkg.tasks:MyTask``, or ``entry my_pkg.train:main``."""
    model = spec.task.options.get("model")
    text = spec.task.name + (f" ({model})" if isinstance(model, str) else "")
    return f"{text}, entry {spec.entry}" if spec.entry else text
