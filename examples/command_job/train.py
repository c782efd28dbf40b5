"""A torchrun-style training script that knows nothing of lance_hpc: ``jobs/command_example.yaml``
runs it on every task (``job: command``), as ``torchrun train.py`` would.

It reads torchrun's variables, trains a tiny model with DDP, saves its state on SIGTERM (what the
job passes on of SLURM's warning before the time limit) and exits; lance_hpc requeues the job, and
the next run (LANCE_HPC_RUN_COUNT > 0) continues from that state.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint", type=Path, required=True)
    args = parser.parse_args()

    stop = []  # set by the signal; acted on between steps, never inside the handler
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))

    # One GPU per local rank: every task sees its node's GPUs, as under torchrun.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # env://: RANK, WORLD_SIZE, MASTER_*
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    step = 0
    if args.checkpoint.exists():  # a rerun: requeued (SLURM_RESTART_COUNT) or restarted after a failure
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"rank {dist.get_rank()}: run {os.environ.get('LANCE_HPC_RUN_COUNT')} resumes at step {step}", flush=True)

    while step < args.steps:
        stopping = torch.tensor(len(stop), device=device)
        dist.all_reduce(stopping)  # every rank stops at the same step
        if stopping.item():
            break
        inputs = torch.randn(32, 16, device=device)
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1

    if dist.get_rank() == 0:
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.checkpoint.with_suffix(".tmp")
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, temporary)
        temporary.replace(args.checkpoint)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
