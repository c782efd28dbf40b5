"""Each rank's random number generators in a checkpoint: captured at every save, given back at the
same world size, reseeded from (seed, step, rank) at another."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from lance_hpc.checkpoint.resuming import Checkpoint
    from lance_hpc.runtime.environment import DistEnv


def restore_rank(resumed: Checkpoint, env: DistEnv, seed: int) -> None:
    """This rank's RNG states.

    At the world size that wrote the checkpoint, each rank gets back its own. At another, the
    saved RNG states belong to ranks that no longer exist (or are missing for new ones): every
    rank reseeds from (seed, step, rank) instead (its loader continues from the position all ranks
    shared, see :meth:`Checkpoint.loader_position`, splitting the rest of the epoch over the new ranks).
    """
    if resumed.world_size == env.world_size:
        restore_rng(resumed.rank_state(env.rank)["rng"])
    else:
        reseed(seed, resumed.step, env.rank)


def saved_position(resumed: Checkpoint, env: DistEnv) -> dict[str, Any]:
    """The per-rank state this rank continues from: its own at the same world size, else rank 0's
    (every rank saved the same data position; only RNG states differ, and those are not reused)."""
    return resumed.rank_state(env.rank if resumed.world_size == env.world_size else 0)


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
