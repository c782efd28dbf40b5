"""A script-mode entry that runs out of device memory the way PyTorch reports it, after its model is
built and registered (the tests cannot fill a GPU on a CPU machine)."""

from __future__ import annotations

from typing import Any

import torch

from lance_hpc import Context


def main(ctx: Context) -> dict[str, Any]:
    model = ctx.wrap(ctx.build_model())
    ctx.register(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)")
