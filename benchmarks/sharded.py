"""The sharded section: a GPT trained by 2 and 4 local gloo ranks under ddp and under fsdp, on the
CPU, each configuration in fresh processes, every figure a ratio against ddp measured in the same run.

Measured per configuration (one process group of N ranks, the same GPT, AdamW, the same global batch):
- state bytes per rank: parameters, gradients and optimizer state held by the rank after a step;
- start-up: from the rank's start to a model ready for its first step (built, wrapped, optimizer):
  ddp as lance_hpc built it before (the seeded constructor on the CPU, then DDP) against fsdp on a
  model built on the meta device and initialised on its shards;
- the step loop's wait per save: ddp's one file from rank 0, a synchronous sharded save and a
  background one (blocked only while the shards are staged);
- throughput: tokens per second over the steps after the first.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result

KIND = "sharded"
DATASET = "gpt"
# at least 100M parameters (the state-bytes model) and a 350M one for start-up
MODELS = {
    "gpt-110m": dict(vocab_size=32000, sequence_length=128, layers=12, width=768, heads=12),
    "gpt-350m": dict(vocab_size=50257, sequence_length=128, layers=24, width=1024, heads=16),
    "gpt-tiny": dict(vocab_size=512, sequence_length=32, layers=2, width=64, heads=2),
}
GLOBAL_BATCH = 8  # sequences per optimizer step, whatever the world size
STEPS = 3
STATE_TARGETS = {2: 0.55, 4: 0.3}  # fsdp / ddp state bytes per rank
SAVE_TARGETS = {"fsdp async": 0.2, "fsdp sync": 0.6}  # vs ddp's file, on 2 ranks
STARTUP_TARGET = 0.5


def _free_port() -> int:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        return int(held.getsockname()[1])


def _local_bytes(tensor: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    held = sum(_local_bytes(parameter) + _local_bytes(parameter.grad) for parameter in model.parameters())
    for state in optimizer.state.values():
        held += sum(_local_bytes(value) for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)
    return held


def _build(mode: str, shape: dict[str, int], world_size: int) -> nn.Module:
    """The model as each mode builds it: ddp from the seeded constructor on the CPU (lance_hpc before
    meta initialisation), fsdp on the meta device, sharded, then initialised on its shards."""
    from lance_hpc.parallel.fsdp import shard
    from lance_hpc.parallel.materialise import build_on_meta, materialise
    from lance_hpc.spec import TrainSpec
    from lance_hpc.tasks.gpt import GPT

    device = torch.device("cpu")
    if mode == "ddp":
        torch.manual_seed(0)
        return nn.parallel.DistributedDataParallel(GPT(**shape))
    meta = build_on_meta(lambda: GPT(**shape))
    model = meta.model
    blocks = model.blocks
    assert isinstance(blocks, nn.ModuleList)
    shard(model, list(blocks), device, TrainSpec(parallelism="fsdp", precision="fp32"), world_size)
    model.to_empty(device=device)
    materialise(meta, device, seed=0)
    return model


def _save_blocked(
    mode: str, model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, step: int
) -> tuple[float, float]:
    """Seconds the loop waits in a save, and until that save is complete (background included): the
    second of two saves, as in a run that saves every N steps (a background save reuses the host
    memory it staged the first into)."""
    from lance_hpc.checkpoint import saving
    from lance_hpc.checkpoint.shards.saver import ShardedSaver, tensor_state
    from lance_hpc.checkpoint.stores import open_store

    saver, store = ShardedSaver(None), open_store(directory)
    figures = (0.0, 0.0)
    for save_step in (step, step + 1):
        state = {"step": save_step, "epoch": 0, "progress": 0.0, "mid_epoch": False, "world_size": dist.get_world_size()}
        dist.barrier()
        started = time.perf_counter()
        if mode == "ddp":
            bare = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
            objects = {"model": bare.state_dict(), "optimizer": optimizer.state_dict()}
            saving.save(store, save_step, {**state, "objects": objects}, {}, keep=2)
            blocked = time.perf_counter() - started
            figures = (blocked, blocked)
            continue
        tensors = tensor_state({"model": model, "optimizer": optimizer})
        saving.save(store, save_step, {**state, "objects": {}}, {}, keep=2, sharded=(saver, tensors, mode == "fsdp async"))
        blocked = time.perf_counter() - started
        saver.wait()
        figures = (blocked, time.perf_counter() - started)
    return figures


def _rank(rank: int, world_size: int, port: int, job: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    shape, mode = MODELS[job["model"]], job["mode"]
    started = time.perf_counter()
    model = _build("ddp" if mode == "ddp" else "fsdp", shape, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dist.barrier()
    startup_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(rank)
    per_rank = max(GLOBAL_BATCH // world_size, 1)
    tokens = torch.randint(shape["vocab_size"], (per_rank, shape["sequence_length"] + 1), generator=generator)
    timed_from = 0.0
    for step in range(job["steps"]):
        if step == 1:
            dist.barrier()
            timed_from = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        if step < job["steps"] - 1:
            optimizer.zero_grad(set_to_none=False)
    dist.barrier()
    seconds = time.perf_counter() - timed_from
    tokens_per_s = (job["steps"] - 1) * per_rank * world_size * shape["sequence_length"] / seconds
    state_bytes = _state_bytes(model, optimizer)
    blocked_s, complete_s = _save_blocked(mode, model, optimizer, Path(job["out"]), job["steps"])
    figures = torch.tensor([state_bytes, startup_s, blocked_s, complete_s, tokens_per_s], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(world_size)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        worst = torch.stack(gathered).max(dim=0).values.tolist()
        names = ("state_bytes", "startup_s", "blocked_s", "complete_s", "tokens_per_s")
        figures_out = dict(zip(names, worst))
        figures_out["tokens_per_s"] = float(gathered[0][4])  # the same on every rank: measured between barriers
        figures_out["parameters"] = float(sum(parameter.numel() for parameter in model.parameters()))
        Path(job["result"]).write_text(json.dumps(figures_out))
    dist.barrier()  # no rank leaves the group while another still uses it
    dist.destroy_process_group()


def measure(config: Measurement) -> Result:
    """One configuration: ``config.data["ranks"]`` ranks started here, their slowest rank's figures."""
    job = dict(config.data)
    ranks = int(job["ranks"])
    with tempfile.TemporaryDirectory(prefix="lance_hpc-sharded-") as work:
        job.update(out=str(Path(work) / "checkpoints"), result=str(Path(work) / "figures.json"))
        started = time.perf_counter()
        mp.start_processes(_rank, args=(ranks, _free_port(), job), nprocs=ranks, start_method="spawn")
        figures = json.loads(Path(job["result"]).read_text())
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=figures["tokens_per_s"],
        first_batch_s=figures["startup_s"],
        images=0,
        batches=job["steps"],
        seconds=time.perf_counter() - started,
        main_rss_mib=0.0,
        worker_rss_mib=0.0,
        worker_growth_mib=0.0,
        store=figures,
    )


def _label(mode: str, world_size: int, model: str) -> str:
    return f"{mode}, {world_size} ranks, {model}"


def configs(context: Context) -> list[Measurement]:
    """ddp, fsdp (synchronous save) and fsdp (background save) on 2 and 4 ranks; the 350M model for
    start-up; with --tiny, no background save on 4 ranks (no target reads it)."""
    models = ("gpt-tiny",) if context.tiny else ("gpt-110m", "gpt-350m")
    found = []
    for model in models:
        for world_size in (2, 4) if model != "gpt-350m" else (2,):
            for mode in ("ddp", "fsdp sync", "fsdp async"):
                if model == "gpt-350m" and mode == "fsdp async":
                    continue  # start-up only: the save mode changes nothing before the first step
                if context.tiny and world_size == 4 and mode == "fsdp async":
                    continue  # --tiny checks state bytes on 4 ranks (ddp, fsdp sync); the save targets are on 2
                # one worker process, which starts the ranks itself (Measurement.world_size would start one per rank)
                data = {"model": model, "mode": mode, "steps": STEPS, "ranks": world_size}
                found.append(Measurement(_label(mode, world_size, model), KIND, DATASET, data=data))
    return found


def _median(summary: Any, key: str) -> float:
    values = sorted(run[0].store[key] for run in summary.ok_runs)
    return values[len(values) // 2] if values else 0.0


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == DATASET}
    header = [
        "configuration",
        "parameters",
        "state MB/rank",
        "x ddp",
        "start-up s",
        "x ddp",
        "save: loop waits s",
        "x ddp",
        "save complete s",
        "tokens/s",
        "x ddp",
    ]
    rows: list[list[str]] = []
    targets: list[Target] = []
    for label, summary in found.items():
        if not summary.ok_runs:
            rows.append([label, "failed"] + ["-"] * (len(header) - 2))
            continue
        mode, ranks, model = label.split(", ")
        ddp = found.get(_label("ddp", int(ranks.split()[0]), model))

        def ratio(key: str, summary: Any = summary, ddp: Any = ddp) -> float:
            base = _median(ddp, key) if ddp and ddp.ok_runs else 0.0
            return _median(summary, key) / base if base else 0.0

        rows.append(
            [
                label,
                f"{_median(summary, 'parameters') / 1e6:.0f}M",
                f"{_median(summary, 'state_bytes') / 2**20:,.0f}",
                f"{ratio('state_bytes'):.2f}x",
                f"{_median(summary, 'startup_s'):.2f}",
                f"{ratio('startup_s'):.2f}x",
                f"{_median(summary, 'blocked_s'):.2f}",
                f"{ratio('blocked_s'):.2f}x",
                f"{_median(summary, 'complete_s'):.2f}",
                f"{_median(summary, 'tokens_per_s'):,.0f}",
                f"{ratio('tokens_per_s'):.2f}x",
            ]
        )
        world = int(ranks.split()[0])

        def target(name: str, key: str, wanted: float, ratio: Any = ratio) -> Target:
            return Target(name, 0 < ratio(key) <= wanted, f"{ratio(key):.2f}x (wanted <= {wanted}x)")

        if mode == "fsdp sync" and world in STATE_TARGETS and model != "gpt-350m":
            targets.append(target(f"state bytes per rank, fsdp vs ddp, {world} ranks", "state_bytes", STATE_TARGETS[world]))
        if mode in SAVE_TARGETS and world == 2 and model != "gpt-350m":
            targets.append(target(f"loop blocked per save, {mode} vs ddp's file, 2 ranks", "blocked_s", SAVE_TARGETS[mode]))
        if mode == "fsdp sync" and (model == "gpt-350m" or context.tiny):
            name = f"start-up to the first step, meta-initialised fsdp vs ddp's CPU build ({model})"
            targets.append(target(name, "startup_s", STARTUP_TARGET))
    title = (
        f"sharded training: a GPT on local gloo ranks (CPU), AdamW, {GLOBAL_BATCH} sequences per step in all, "
        f"{STEPS} steps; ratios against ddp at the same world size and model, in the same run"
    )
    widths = [max(len(str(row[index])) for row in [header, *rows]) for index in range(len(header))]
    text = [title, "  ".join(cell.ljust(width) for cell, width in zip(header, widths))]
    text += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    text += [target.line() for target in targets]
    markdown = [f"## Sharded training\n\n{title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(row) + " |" for row in rows]
    markdown += [""] + [f"- {target.line()}" for target in targets] + [""]
    return SectionReport(text=text, markdown=markdown, targets=targets)
