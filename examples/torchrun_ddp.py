"""A plain DDP training script over a Lance dataset with lance_hpc's Loader, launched by torchrun:

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --data rows.lance --checkpoint ckpt.pt

It trains a small model on the dataset's ``vec`` column (fixed-size lists of 4 floats), saves the
model, the optimizer and the loader's position every ``--save-every`` steps, and resumes from that
checkpoint when it exists: run it again, with as many processes as you like, and it continues at
the first batch not yet trained on. ``--rows-log DIR`` writes the row ids each rank trained on (one
file per rank and world size), ``--stop-after K`` ends the run after step K, saved.

SIGTERM (what ``torchrun`` and lance_hpc's ``command:`` jobs send on SLURM's warning before the time
limit) ends the run after the step in progress, saved, on every rank at the same step. As a
lance_hpc job (docs/command-jobs.md), preempted and requeued on SLURM:

    command: [python3, examples/torchrun_ddp.py, --data, rows.lance, --checkpoint, ckpt.pt]
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lance_hpc import Loader


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the Lance dataset (a vec column of 4 floats)")
    parser.add_argument("--checkpoint", required=True, help="file of model, optimizer and loader state")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="end after this step, with a checkpoint")
    parser.add_argument("--rows-log", default=None, help="directory for the row ids each rank trained on")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="the least time a step takes (to watch a stop)")
    return parser.parse_args()


def save(path: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Loader) -> None:
    """Rank 0 writes the checkpoint (the loader's state is the same on every rank); all wait for it."""
    if dist.get_rank() == 0:
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # a crash while saving leaves the previous checkpoint whole
    dist.barrier()


class StopFlag:
    """Set by SIGTERM; ranks agree on it once a step, so that all stop after the same step even
    when the signal reaches them at different moments."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self.request)

    def request(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def main() -> None:
    args = parse_arguments()
    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the Loader reads the rank from here.
    stop = StopFlag()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    loader = Loader(
        args.data, batch_size=args.batch_size, columns=["vec"], num_workers=args.workers, pin_memory=device.type == "cuda"
    )
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = 0
    if os.path.exists(args.checkpoint):  # a checkpoint this script wrote: weights_only refuses anything else
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
    ddp_model = DistributedDataParallel(model)
    log = None
    if args.rows_log:
        log = Path(args.rows_log, f"rows-{dist.get_world_size()}-{dist.get_rank()}.txt").open("a")
    for epoch in range(loader.epoch, args.epochs):  # a resumed epoch continues where it stopped
        loader.set_epoch(epoch)
        for batch in loader:
            vectors = batch["vec"].to(device, non_blocking=True)
            loss = nn.functional.mse_loss(ddp_model(vectors).squeeze(1), vectors.sum(dim=1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if args.step_seconds:
                time.sleep(args.step_seconds)
            if log is not None:
                log.write(f"{epoch} {' '.join(map(str, batch['row_id'].tolist()))}\n")
                log.flush()
            stopping = stop.agreed(device) or step == args.stop_after
            if step % args.save_every == 0 or stopping:
                save(args.checkpoint, step, model, optimizer, loader)
            if stopping:
                dist.destroy_process_group()
                return
    save(args.checkpoint, step, model, optimizer, loader)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
