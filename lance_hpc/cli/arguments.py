"""Arguments that several commands share, written once so they read the same in every ``--help``."""

from __future__ import annotations

import argparse

SPEC_HELP = "job spec YAML file"
TARGET_HELP = "a job spec (the YAML you submitted) or a SLURM job id"


def add_spec(parser: argparse.ArgumentParser, help_text: str = SPEC_HELP) -> None:
    """The job spec a command reads, its first argument."""
    parser.add_argument("spec", help=help_text)


def add_overrides(
    parser: argparse.ArgumentParser, example: str = "train.lr=0.05", dest: str = "set", condition: str = ""
) -> None:
    """``--set KEY=VALUE`` (repeatable): a spec field changed for this command only; ``condition``
    (``"with --local: "``) says when it applies."""
    parser.add_argument(
        "--set",
        dest=dest,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{condition}override a spec field, e.g. --set {example} (repeatable)",
    )


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): an object store's endpoint, region, allow_http."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="object-store option (endpoint, region, allow_http); credentials come from AWS_* variables",
    )


def target_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """The parser of a command about a submitted job (status, logs, cancel): the spec or job id,
    --set, --job."""
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


def int_list(text: str) -> list[int]:
    """``2,4,8``: one or more integers >= 0 (an argparse type)."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 0, e.g. 2,4,8")
    return values
