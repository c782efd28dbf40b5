"""A DeepSpeed ZeRO loop over a Lance dataset with lance_hpc's Loader, launched by torchrun (or
the ``deepspeed`` launcher):

    torchrun --standalone --nproc-per-node 2 examples/deepspeed_train.py --data rows.lance --checkpoints ckpt/

It trains a small model on the dataset's ``vec`` column (fixed-size lists of 4 floats) with ZeRO
stage 1 (gloo and DeepSpeed's CPU accelerator where there is no GPU). Every ``--save-every`` steps
``engine.save_checkpoint`` writes the model and each rank's optimizer shard, with the Loader's state
in ``client_state``; a run that finds ``ckpt/latest`` resumes at the first batch not yet trained
on, with as many processes as saved (ZeRO's shards are per rank). ``--rows-log DIR`` writes the row
ids each rank trained on, ``--stop-after K`` saves and ends the run after step K.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import deepspeed
import torch
from torch import nn

from lance_hpc import Loader


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the Lance dataset (a vec column of 4 floats)")
    parser.add_argument("--checkpoints", required=True, help="directory of DeepSpeed's checkpoints")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="save and end after this step")
    parser.add_argument("--rows-log", default=None, help="directory for the row ids each rank trained on")
    return parser.parse_args()


def main() -> None:
    args = parse_arguments()
    # torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the Loader reads the rank from the group.
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    loader = Loader(args.data, batch_size=args.batch_size, columns=["vec"], num_workers=args.workers)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,  # a torch optimizer: DeepSpeed's own build their ops
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    step = 0
    if os.path.exists(os.path.join(args.checkpoints, "latest")):
        # DeepSpeed reads its files with torch.load(weights_only=False): resume only from checkpoints you wrote
        _, client_state = engine.load_checkpoint(args.checkpoints)
        loader.load_state_dict(client_state["loader"])
        step = client_state["step"]
    log = None
    if args.rows_log:
        log = Path(args.rows_log, f"rows-{engine.world_size}-{engine.global_rank}.txt").open("a")
    for epoch in range(loader.epoch, args.epochs):  # a resumed epoch continues where it stopped
        loader.set_epoch(epoch)
        for batch in loader:
            vectors = batch["vec"].to(engine.device, non_blocking=True)
            loss = nn.functional.mse_loss(engine(vectors).squeeze(1), vectors.sum(dim=1))
            engine.backward(loss)
            engine.step()
            step += 1
            if log is not None:
                log.write(f"{epoch} {' '.join(map(str, batch['row_id'].tolist()))}\n")
                log.flush()
            if step % args.save_every == 0 or step == args.stop_after:
                # every rank calls it (each writes its ZeRO shard); the Loader's state is the same on all
                engine.save_checkpoint(args.checkpoints, client_state={"step": step, "loader": loader.state_dict()})
            if step == args.stop_after:
                return
    engine.save_checkpoint(args.checkpoints, client_state={"step": step, "loader": loader.state_dict()})


if __name__ == "__main__":
    main()
