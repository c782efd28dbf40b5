"""``lance-hpc checkpoint export DIR OUT``: a checkpoint's model as one file (:mod:`lance_hpc.checkpoint.export`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from lance_hpc.cli.reporting import run_reporting_errors

PROG = "lance-hpc checkpoint"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Work with a job's checkpoints.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  lance-hpc checkpoint export checkpoints/lm model.safetensors   # the newest checkpoint's model\n"
            "  lance-hpc checkpoint export s3://bucket/runs/lm model.pt --step 2000\n\n"
            "Load the result with torch.load(path) or safetensors.torch.load_file(path), then\n"
            "model.load_state_dict(state): the keys are the task model's own."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser(
        "export",
        help="write a checkpoint's model as one state dict (.pt or .safetensors), sharded or not",
        description="Write the model of a checkpoint (the newest in DIRECTORY, or --step's) as one state dict that "
        "torch.load or safetensors reads, whether the job saved one file (ddp) or shards (fsdp); the optimizer "
        "state is left where it is.",
    )
    exporting.add_argument("directory", help="checkpoint.dir: a directory or s3://bucket/prefix")
    exporting.add_argument("out", type=Path, help="the file to write: *.pt (torch.save) or *.safetensors")
    exporting.add_argument("--step", type=int, default=None, help="that step's checkpoint instead of the newest")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: export(args.directory, args.out, args.step), PROG)


def export(directory: str, out: Path, step: int | None) -> int:
    from lance_hpc.checkpoint.export import export as export_model

    print(export_model(directory, out, step), flush=True)
    return 0
