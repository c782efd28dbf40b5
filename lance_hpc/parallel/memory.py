"""What a model's training state needs per rank, said when a GPU runs out of memory.

Weights, gradients and optimizer state take a fixed number of bytes per parameter: fp32 weights
and gradients (4 + 4), AdamW's two moments (8) or SGD's momentum (4). DDP keeps all of it on
every rank; FSDP divides it by the number of ranks and adds, while a block computes, that block's
gathered weights. Activations come on top and grow with the batch.
"""

from __future__ import annotations

from lance_hpc.spec import JobSpec

GIB = 2**30


def optimizer_bytes(optimizer: str, momentum: float) -> int:
    """Bytes of optimizer state per parameter."""
    if optimizer == "adamw":
        return 8
    return 4 if momentum > 0 else 0


def per_rank(parameters: int, spec: JobSpec, world_size: int, parallelism: str) -> dict[str, float]:
    """Bytes each rank holds for weights, gradients and optimizer state under ``parallelism``."""
    share = world_size if parallelism == "fsdp" else 1
    state = {
        "weights": parameters * 4 / share,
        "gradients": parameters * 4 / share,
        f"{spec.train.optimizer} state": parameters * optimizer_bytes(spec.train.optimizer, spec.train.momentum) / share,
    }
    if parallelism == "fsdp" and spec.train.cpu_offload:
        state = {name: 0.0 for name in state}  # kept in host memory between uses
    return state


def out_of_memory_message(error: BaseException, spec: JobSpec, parameters: int, world_size: int, device: str, total: int) -> str:
    """One message for a device that ran out of memory: what the model's state needs per rank in
    this mode and in the others, and what to change."""
    mode = spec.train.parallelism
    needed = per_rank(parameters, spec, world_size, mode)
    parts = " + ".join(f"{name} {value / GIB:.1f} GiB" for name, value in needed.items())
    size = f" ({total / GIB:.0f} GiB)" if total else ""
    lines = [
        f"out of memory on {device}{size}: the model has {parameters / 1e9:.2f}B parameters; under "
        f"train.parallelism {mode} on {world_size} rank(s) each rank holds {parts} = {sum(needed.values()) / GIB:.1f} GiB "
        "before activations",
    ]
    fixes = []
    if mode == "ddp":
        sharded = sum(per_rank(parameters, spec, world_size, "fsdp").values())
        more = sum(per_rank(parameters, spec, world_size * 4, "fsdp").values())
        fixes.append(
            f"train.parallelism: fsdp ({sharded / GIB:.1f} GiB per rank on {world_size} rank(s), "
            f"{more / GIB:.1f} GiB on {world_size * 4})"
        )
    else:
        fixes.append("more ranks (slurm.nodes or tasks_per_node): each holds 1/N of the state")
        if not spec.train.cpu_offload:
            fixes.append("train.cpu_offload: true (the state waits in host memory)")
    if mode == "fsdp" and not spec.train.activation_checkpointing:
        fixes.append("train.activation_checkpointing: true (activations recomputed, not kept)")
    fixes.append(
        f"a smaller data.batch_size (now {spec.data.batch_size} per rank) with train.grad_accum to keep the global batch"
    )
    lines.append("  fix: " + "; or ".join(fixes))
    lines.append(f"  (PyTorch said: {str(error).splitlines()[0][:300]})")
    return "\n".join(lines)
