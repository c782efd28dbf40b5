"""The command line: ``lance-hpc COMMAND ...`` (and ``python -m lance_hpc COMMAND ...``).

Each command is one module of this package, ``lance_hpc.cli.<command>``, whose ``main(argv)``
builds its argparse parser, calls into the subsystem that does the work, and reports a
:class:`~lance_hpc.errors.UserError` through :func:`lance_hpc.cli.reporting.run_reporting_errors`.
This module only dispatches: a command's module is imported when that command runs, so a part one
command cannot load never stands in the way of another (``validate`` imports only the spec and
the task it names).

The ``python -m`` commands that scripts and SLURM tasks run (``lance_hpc.submit``,
``lance_hpc.run``) are shims over the same modules; ``python -m lance_hpc.ingest`` and
``python -m lance_hpc.bench`` run ``python -m lance_hpc`` by name with their command in front.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Callable, Sequence

from lance_hpc.errors import ExitCode

# command -> (the module whose main(argv) runs it, its line in the list of commands)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("lance_hpc.cli.validate", "check a job spec and show how its placeholders resolved"),
    "render": ("lance_hpc.cli.render", "write the sbatch script and resolved spec (= submit --render-only)"),
    "submit": ("lance_hpc.cli.submit", "submit to SLURM through submitit; --dry-run, --render-only, --local"),
    "run": ("lance_hpc.cli.run", "run one rank of a job (what srun starts); with --local: N ranks here"),
    "status": ("lance_hpc.cli.status", "a job's state, restarts, step, last loss and time left"),
    "logs": ("lance_hpc.cli.logs", "print a job's output across requeues; -f follows, --rank N"),
    "cancel": ("lance_hpc.cli.cancel", "stop a job after it saves a checkpoint; --now at once"),
    "plan": ("lance_hpc.cli.plan", "show how the data splits over ranks, steps and workers"),
    "ingest": ("lance_hpc.cli.ingest", "write an image or text source into a Lance dataset"),
    "tokenizer": ("lance_hpc.cli.tokenizer", "train a BPE tokenizer offline for text ingest (tokenizer train)"),
    "checkpoint": ("lance_hpc.cli.checkpoint", "export a checkpoint's model (sharded or not) as one .pt or .safetensors"),
    "bench": ("lance_hpc.cli.bench", "benchmark a job's data pipeline (and, in a checkout, the peers)"),
    "lineage": ("lance_hpc.cli.lineage", "where a dataset's columns and a checkpoint came from; warns of leakage"),
}

# Commands with no training steps to profile: USR1 (a profiler trace, which scancel --signal=USR1
# sends to every process of a SLURM job) is ignored by them instead of ending them.
UNPROFILED = frozenset({"ingest", "tokenizer"})


def ignore_profile_requests() -> None:
    """Ignore USR1 in this process: called before the imports, which take seconds."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def usage() -> str:
    lines = ["usage: lance-hpc COMMAND [ARGS...]   (lance-hpc COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "a first run: lance-hpc submit jobs/quickstart.yaml --local"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``lance-hpc COMMAND ARGS...``: run COMMAND's ``main(ARGS)`` and return its exit code."""
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
    module_name, _ = COMMANDS[name]
    if name in UNPROFILED:
        ignore_profile_requests()
    try:
        command: Callable[[list[str]], int] = importlib.import_module(module_name).main
    except ImportError as error:
        print(
            f"lance-hpc {name}: not available, {module_name} cannot be loaded: {error}\n"
            "  fix: reinstall lance-hpc with its dependencies (pip install -e .)",
            file=sys.stderr,
        )
        return ExitCode.USER_ERROR
    return int(command(rest) or 0)
