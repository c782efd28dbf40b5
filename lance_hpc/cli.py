"""``lance-hpc``: one command with a subcommand for each step, each handled by its module's main().

Modules are imported only when their subcommand runs, so a part one subcommand cannot load never
stands in the way of another (``validate`` imports only the spec and the task it names).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from lance_hpc.errors import ExitCode, UserError

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec

# subcommand -> (module, function, one-line help)
COMMANDS = {
    "validate": ("lance_hpc.cli", "validate", "check a job spec and show how its placeholders resolved"),
    "render": ("lance_hpc.cli", "render", "write the sbatch script and resolved spec (= submit --render-only)"),
    "submit": ("lance_hpc.cli", "submit", "submit to SLURM through submitit; --dry-run, --render-only, --local"),
    "run": ("lance_hpc.cli", "run", "run one rank of a job (what srun starts); with --local: N ranks here"),
    "status": ("lance_hpc.manage.status", "main", "a job's state, restarts, step, last loss and time left"),
    "logs": ("lance_hpc.manage.logs", "main", "print a job's output across requeues; -f follows, --rank N"),
    "cancel": ("lance_hpc.manage.cancel", "main", "stop a job after it saves a checkpoint; --now at once"),
    "plan": ("lance_hpc.data.plan", "main", "show how the data splits over ranks, steps and workers"),
    "ingest": ("lance_hpc.data.ingest", "main", "write an image or text source into a Lance dataset"),
    "tokenizer": ("lance_hpc.data.tokenizer", "main", "train a BPE tokenizer offline for text ingest (tokenizer train)"),
    "checkpoint": (
        "lance_hpc.checkpoint.export",
        "main",
        "export a checkpoint's model (sharded or not) as one .pt or .safetensors",
    ),
    "bench": ("lance_hpc.bench.cli", "main", "benchmark a job's data pipeline (and, in a checkout, the peers)"),
    "lineage": ("lance_hpc.lineage.show", "main", "where a dataset's columns and a checkpoint came from; warns of leakage"),
}


# Commands with no training steps to profile: USR1 (a profiler trace, which scancel --signal=USR1
# sends to every process of a SLURM job) is ignored by them instead of ending them.
UNPROFILED = frozenset({"ingest", "tokenizer"})


def usage() -> str:
    lines = ["usage: lance-hpc COMMAND [ARGS...]   (lance-hpc COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
    lines += ["", "a first run: lance-hpc submit jobs/quickstart.yaml --local"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return ExitCode.USER_ERROR
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lance-hpc: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return ExitCode.USER_ERROR
    module_name, function_name, _ = COMMANDS[name]
    if name in UNPROFILED:  # before the imports, which take seconds
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        function: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), function_name)
    except ImportError as error:
        print(
            f"lance-hpc {name}: not available, {module_name} cannot be loaded: {error}\n"
            "  fix: reinstall lance-hpc with its dependencies (pip install -e .)",
            file=sys.stderr,
        )
        return ExitCode.USER_ERROR
    return int(function(rest) or 0)


def validate(argv: list[str]) -> int:
    """``lance-hpc validate job.yaml [--set KEY=VALUE ...]``."""
    from lance_hpc.spec import load_spec
    from lance_hpc.spec.schema import entry_note

    parser = argparse.ArgumentParser(prog="lance-hpc validate", description="Check a job spec; list every problem.")
    parser.add_argument("spec", help="job spec YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    args = parser.parse_args(argv)
    try:
        loaded = load_spec(args.spec, args.set)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR
    slurm = loaded.spec.slurm
    print(
        f"{args.spec}: valid ({loaded.spec.name}: {slurm.nodes} node(s) x {slurm.ntasks_per_node} task(s), "
        f"{loaded.spec.data.style}/{loaded.spec.data.sampler}, {describe_task(loaded.spec)})"
    )
    for item in loaded.resolutions:
        print(f"  {item.path}: {item.before} -> {item.after}")
    note = entry_note(loaded.spec)
    if note:
        print(f"  {note}")
    return 0


def describe_task(spec: JobSpec) -> str:
    """``image_classification (resnet50)``, ``my_pkg.tasks:MyTask``, or ``entry my_pkg.train:main``."""
    model = spec.task.options.get("model")
    text = spec.task.name + (f" ({model})" if isinstance(model, str) else "")
    return f"{text}, entry {spec.entry}" if spec.entry else text


def submit(argv: list[str]) -> int:
    from lance_hpc import submit as submit_module

    return submit_module.main(argv, prog="lance-hpc submit")


def render(argv: list[str]) -> int:
    """``lance-hpc render job.yaml [-o FILE] [--set ...]``: the script for your own sbatch."""
    from lance_hpc.launch.render import write_job_files
    from lance_hpc.spec import load_spec

    parser = argparse.ArgumentParser(
        prog="lance-hpc render", description="Write the sbatch script and the resolved spec it runs; submit nothing."
    )
    parser.add_argument("spec", help="job spec YAML file")
    parser.add_argument("-o", "--output", type=Path, metavar="FILE", help="script path [<log_dir>/<name>.sbatch]")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    args = parser.parse_args(argv)
    try:
        spec_file, script_path = write_job_files(load_spec(args.spec, args.set).spec, args.output)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(f"wrote {script_path}\n  (its tasks read {spec_file})\nsubmit it with: sbatch {script_path}")
    return 0


def run(argv: list[str]) -> int:
    """``lance-hpc run SPEC`` is one rank (lance_hpc.run); ``--local [--nproc N]`` runs N ranks here."""
    if "--local" in argv:
        from lance_hpc import submit

        return submit.main(argv, prog="lance-hpc run")
    from lance_hpc.runtime import rank as run_module

    return run_module.main(argv)
