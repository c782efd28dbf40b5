"""``lance-hpc checkpoint export DIR OUT``: a checkpoint's model as one state dict, for use outside
lance_hpc (``torch.load`` or safetensors), whether the checkpoint is one file (ddp) or shards (fsdp).

Reading the shards needs no process group: the tensors named ``model.*`` in the shards' metadata
are read whole, in one process, and nothing else (the optimizer state stays where it is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lance_hpc.errors import UserError
from lance_hpc.storage.files import replaced_atomically

FORMATS = (".pt", ".safetensors")


def model_state(saved: Any, name: str = "model") -> dict[str, Any]:
    """The whole state dict of the object registered as ``name`` in ``saved`` (a loaded
    :class:`~lance_hpc.checkpoint.resuming.Checkpoint`), read from its shards when it has them."""
    if saved.shards is None:
        if name not in saved.objects:
            raise UserError(f"checkpoint {saved.path} holds no {name!r} (it has {', '.join(saved.objects) or 'nothing'})")
        return dict(saved.objects[name])
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lance_hpc.checkpoint.shards import reading

    reader = saved.store.shard_reader(saved.shards)
    metadata = reader.read_metadata()
    prefix = f"{name}."
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            state[key[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        raise UserError(f"checkpoint {saved.path}: its shards hold no {name!r}")
    reading.load({name: state}, reader, no_dist=True)
    return state


def export(directory: str, out: Path, step: int | None) -> str:
    """Write the model of ``directory``'s newest checkpoint (or of ``step``) to ``out``; what was written."""
    import torch

    from lance_hpc.checkpoint import resuming
    from lance_hpc.checkpoint.stores import open_store

    if out.suffix not in FORMATS:
        raise UserError(f"{out}: unknown format {out.suffix or '(no suffix)'}\n  fix: name the file *.pt or *.safetensors")
    store = open_store(directory)
    saved = resuming.load_step(store, step) if step is not None else resuming.load_latest(store)
    if saved is None:
        raise UserError(f"{directory} holds no checkpoint\n  fix: name the checkpoint.dir of a job that has saved one")
    state = {key: value.detach().cpu().contiguous() for key, value in model_state(saved).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # A fresh temporary name beside OUT, created exclusively and never through a link, fsynced, then
    # renamed over OUT: a link planted at a guessable name is not followed, and two exports to one
    # OUT each rename a file of their own (the last one's stays, whole).
    with replaced_atomically(out) as file:
        if out.suffix == ".safetensors":
            from safetensors.torch import save

            # safetensors refuses tensors that share memory (a tied head and embedding): each gets its own copy
            file.write(save({key: value.clone() for key, value in state.items()}, metadata={"step": str(saved.step)}))
        else:
            torch.save(state, file)
    count = sum(value.numel() for value in state.values())
    return f"{out}: the model of {saved.path} (step {saved.step}), {len(state)} tensors, {count:,} values"
