"""Each rank's random number generators in a checkpoint: captured at every save, given back at the
same world size, reseeded from (seed, step, rank) at another (:func:`lance_hpc.checkpoint.resuming.restore_rank`)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every generator of this process from (seed, step, rank): deterministic, distinct per rank."""
    value = int(np.random.SeedSequence([seed % 2**32, step, rank]).generate_state(1)[0])
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states, in types torch.load(weights_only=True) reads."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_key = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_key}},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    numpy_state = states["numpy"]
    np.random.set_state(
        {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].numpy().astype(np.uint32)}}
    )
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
