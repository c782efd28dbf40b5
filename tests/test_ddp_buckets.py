"""Deterministic runs sum gradients alike whether or not they were resumed.

DDP regroups its gradient buckets after a run's first backward pass. With three or more ranks the
grouping decides the order in which all-reduce adds the ranks' gradients, so a resumed run (whose
first step would use DDP's initial grouping) could drift from the uninterrupted run by the last
bit. wrap_model groups the buckets once, before the first step; this test runs real DDP over gloo
on three processes, with a model big enough for several buckets.
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import torch
from torch import nn

from lance_hpc.quiet import exec_children

RANKS = 3
STEPS = 4
STOP_AFTER = 2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def train(state: dict[str, torch.Tensor] | None, steps: range, rank: int) -> dict[str, torch.Tensor]:
    """``steps`` of SGD on DDP (deterministic), from a fresh model or ``state``; the weights after."""
    from lance_hpc.parallel.ddp import wrap_model

    module = model()
    if state is not None:
        module.load_state_dict(state)
    wrapped = wrap_model(module, torch.device("cpu"), deterministic=True)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        inputs, labels = torch.randn(32, 256, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(inputs), labels).backward()
        optimizer.step()
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def rank_main(rank: int, rendezvous: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=RANKS)
    try:
        uninterrupted = train(None, range(STEPS), rank)
        stopped = train(None, range(STOP_AFTER), rank)
        resumed = train(stopped, range(STOP_AFTER, STEPS), rank)
    finally:
        torch.distributed.destroy_process_group()
    Path(out).write_bytes(pickle.dumps((uninterrupted, resumed)))


def test_a_resumed_deterministic_run_ends_bit_for_bit_where_the_uninterrupted_one_does(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{rank}.pickle" for rank in range(RANKS)]
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    with exec_children():
        processes = [context.Process(target=rank_main, args=(rank, rendezvous, str(outs[rank]))) for rank in range(RANKS)]
        for process in processes:
            process.start()
    for process in processes:
        process.join(timeout=300)
        assert process.exitcode == 0
    uninterrupted, resumed = pickle.loads(outs[0].read_bytes())
    assert uninterrupted.keys() == resumed.keys()
    assert not any(torch.equal(uninterrupted[name], model().state_dict()[name]) for name in uninterrupted)  # it trained
    differing = [name for name in uninterrupted if not torch.equal(uninterrupted[name], resumed[name])]
    assert differing == []
