"""``lance-hpc lineage DATASET|CHECKPOINT_DIR``: where a dataset's columns and a checkpoint came from."""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.cli.arguments import add_storage_options
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.manage.lineage import print_lineage


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc lineage",
        description="Show where a dataset's columns and a checkpoint came from, read from the dataset's schema and "
        "the checkpoints' manifests (nothing is loaded).",
        epilog=(
            "For a dataset: each column an infer or map job wrote, as a chain: the data its checkpoint was trained\n"
            "on -> the checkpoint (directory, step, weights) or function -> the column (the version it read, the\n"
            "rows, each refresh since). A column whose checkpoint was trained on rows of the dataset it scored is\n"
            "flagged: on those rows its values are not held-out predictions (validation leakage).\n"
            "For a checkpoint directory: each checkpoint in it, the data it was trained and validated on, its spec.\n\n"
            "examples:\n"
            "  lance-hpc lineage data/photos.lance             # the columns written into a dataset\n"
            "  lance-hpc lineage checkpoints/photos_resnet     # what each checkpoint was trained on\n"
            "  lance-hpc lineage s3://bucket/photos.lance --storage-option endpoint=http://127.0.0.1:9000"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target", metavar="DATASET_OR_CHECKPOINT_DIR", help="a Lance dataset (path or s3://...) or a checkpoint directory"
    )
    add_storage_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    malformed = [option for option in args.storage_option if "=" not in option]
    if malformed:
        parser.error(f"--storage-option {malformed[0]!r}: give KEY=VALUE")
    given = dict(option.split("=", 1) for option in args.storage_option)
    return run_reporting_errors(lambda: print_lineage(args.target, given))
