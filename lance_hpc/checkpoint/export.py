"""``lance-hpc checkpoint export DIR OUT``: a checkpoint's model as one state dict, for use outside
lance_hpc (``torch.load`` or safetensors), whether the checkpoint is one file (ddp) or shards (fsdp).

Reading the shards needs no process group: the tensors named ``model.*`` in the shards' metadata
are read whole, in one process, and nothing else (the optimizer state stays where it is).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lance_hpc.errors import UserError, run_reporting_errors

PROG = "lance-hpc checkpoint"
FORMATS = (".pt", ".safetensors")


def model_state(saved: Any, name: str = "model") -> dict[str, Any]:
    """The whole state dict of the object registered as ``name`` in ``saved`` (a loaded
    :class:`~lance_hpc.checkpoint.resuming.Checkpoint`), read from its shards when it has them."""
    if saved.shards is None:
        if name not in saved.objects:
            raise UserError(f"checkpoint {saved.path} holds no {name!r} (it has {', '.join(saved.objects) or 'nothing'})")
        return dict(saved.objects[name])
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lance_hpc.checkpoint import shard_files

    reader = shard_files.reader(saved.directory, saved.shards)
    metadata = reader.read_metadata()
    prefix = f"{name}."
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            state[key[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        raise UserError(f"checkpoint {saved.path}: its shards hold no {name!r}")
    dcp.load({name: state}, storage_reader=reader, no_dist=True)
    return state


def export(directory: str, out: Path, step: int | None) -> str:
    """Write the model of ``directory``'s newest checkpoint (or of ``step``) to ``out``; what was written."""
    import torch

    from lance_hpc.checkpoint import resuming

    if out.suffix not in FORMATS:
        raise UserError(f"{out}: unknown format {out.suffix or '(no suffix)'}\n  fix: name the file *.pt or *.safetensors")
    saved = resuming.load_step(directory, step) if step is not None else resuming.load_latest(directory)
    if saved is None:
        raise UserError(f"{directory} holds no checkpoint\n  fix: name the checkpoint.dir of a job that has saved one")
    state = {key: value.detach().cpu().contiguous() for key, value in model_state(saved).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory (a tied head and embedding): each gets its own copy
        save_file({key: value.clone() for key, value in state.items()}, str(temporary), metadata={"step": str(saved.step)})
    else:
        torch.save(state, temporary)
    temporary.replace(out)
    count = sum(value.numel() for value in state.values())
    return f"{out}: the model of {saved.path} (step {saved.step}), {len(state)} tensors, {count:,} values"


def main(argv: Sequence[str] | None = None) -> int:
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
        "export", help="write a checkpoint's model as one state dict (.pt or .safetensors), sharded or not"
    )
    exporting.add_argument("directory", help="checkpoint.dir: a directory or s3://bucket/prefix")
    exporting.add_argument("out", type=Path, help="the file to write: *.pt (torch.save) or *.safetensors")
    exporting.add_argument("--step", type=int, default=None, help="that step's checkpoint instead of the newest")
    args = parser.parse_args(argv)

    def command() -> int:
        print(export(args.directory, args.out, args.step), flush=True)
        return 0

    return run_reporting_errors(command, PROG)


if __name__ == "__main__":
    sys.exit(main())
