"""A Hugging Face Accelerate loop over a Lance dataset with lance_hpc's Loader, launched by torchrun
(or ``accelerate launch``):

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --data rows.lance --checkpoints ckpt/

It trains a small model on the dataset's ``vec`` column (fixed-size lists of 4 floats). Every
``--save-every`` steps ``accelerator.save_state`` writes the model, the optimizer and the random
states to ``ckpt/step-N``, the Loader's state goes beside them in ``progress.json``, and
``ckpt/latest`` names the newest whole checkpoint; a run that finds it resumes at the first batch
not yet trained on. ``--rows-log DIR`` writes the row ids each rank trained on (one file per rank
and world size), ``--stop-after K`` saves and ends the run after step K, as a preemption would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from lance_hpc import Loader


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the Lance dataset (a vec column of 4 floats)")
    parser.add_argument("--checkpoints", required=True, help="directory of the checkpoints")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="save and end after this step")
    parser.add_argument("--rows-log", default=None, help="directory for the row ids each rank trained on")
    return parser.parse_args()


def save(accelerator: Accelerator, root: Path, step: int, loader: Loader) -> None:
    """Accelerate's state in ``step-N`` and the Loader's beside it (the same on every rank, so the main
    process writes it); ``latest`` names it only once it is whole, then the previous one goes."""
    target = root / f"step-{step}"
    accelerator.save_state(str(target))
    if accelerator.is_main_process:
        (target / "progress.json").write_text(json.dumps({"step": step, "loader": loader.state_dict()}))
        previous = (root / "latest").read_text() if (root / "latest").exists() else None
        (root / "latest.tmp").write_text(target.name)
        os.replace(root / "latest.tmp", root / "latest")  # a crash before this keeps the previous one
        if previous and previous != target.name:
            shutil.rmtree(root / previous)
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, root: Path, loader: Loader) -> int:
    """The step the newest checkpoint was saved at, its states restored; 0 when there is none."""
    if not (root / "latest").exists():
        return 0
    source = root / (root / "latest").read_text()
    accelerator.load_state(str(source))
    # JSON, never unpickled: Accelerate's register_for_checkpointing would read it with weights_only=False
    progress = json.loads((source / "progress.json").read_text())
    loader.load_state_dict(progress["loader"])
    return int(progress["step"])


def main() -> None:
    args = parse_arguments()
    # Accelerate reads torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and joins the process
    # group; without a GPU it runs one process per rank only when told cpu=True (gloo).
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    # Not passed to prepare(): the Loader already gives each rank its own rows, and prepare() would
    # hand it back as it is (it rebuilds torch DataLoaders only), so batches are moved to the device here.
    loader = Loader(args.data, batch_size=args.batch_size, columns=["vec"], num_workers=args.workers)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    root = Path(args.checkpoints)
    root.mkdir(parents=True, exist_ok=True)
    step = resume(accelerator, root, loader)
    log = None
    if args.rows_log:
        log = Path(args.rows_log, f"rows-{accelerator.num_processes}-{accelerator.process_index}.txt").open("a")
    for epoch in range(loader.epoch, args.epochs):  # a resumed epoch continues where it stopped
        loader.set_epoch(epoch)
        for batch in loader:
            vectors = batch["vec"].to(accelerator.device, non_blocking=True)
            loss = nn.functional.mse_loss(model(vectors).squeeze(1), vectors.sum(dim=1))
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if log is not None:
                log.write(f"{epoch} {' '.join(map(str, batch['row_id'].tolist()))}\n")
                log.flush()
            if step % args.save_every == 0 or step == args.stop_after:
                save(accelerator, root, step, loader)
            if step == args.stop_after:
                accelerator.end_training()
                return
    save(accelerator, root, step, loader)
    accelerator.end_training()


if __name__ == "__main__":
    main()
