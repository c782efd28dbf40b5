"""Real multi-process DDP data loading: 3 gloo ranks (spawned), one DataLoader worker each,
a full epoch of every strategy with an all-reduce every step on a dataset whose last fragment is
short (the reference example's shape). Every rank must take the same number of steps and the rows
must be covered as planned; a hang fails the test at its deadline instead of blocking CI."""

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lance_hpc.kinds.rank import exit_process
from lance_hpc.spec import DataSpec
from tests.support.loaders import eval_loader, train_loader, write_dataset

WORLD_SIZE = 3
DEADLINE_S = 540
RUNS = [
    ("map", "distributed", "drop"),
    ("iterable", "sharded_batch", "pad"),
    ("iterable", "sharded_fragment", "drop"),
    ("iterable", "full_scan", "drop"),
]


def rank_main(rank: int, world_size: int, store: str, uri: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    results = {}
    for style, sampler, uneven in RUNS:
        data = DataSpec(uri=uri, val_uri=uri, style=style, sampler=sampler, uneven=uneven, batch_size=8, num_workers=1, seed=11)
        loader = train_loader(data, rank, world_size)
        loader.set_epoch(2)
        rows, steps = [], 0
        for batch in loader:
            ranks_here = torch.ones(1)
            dist.all_reduce(ranks_here)  # a rank short of batches would leave the others waiting here
            assert int(ranks_here.item()) == world_size
            assert torch.equal(batch["row_id"], batch["label"])  # the label is the row id
            rows += batch["label"].tolist()
            steps += 1
        step_counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(step_counts, torch.tensor([steps]))
        results[sampler] = {
            "steps": steps,
            "planned": loader.steps_per_epoch,
            "all_steps": [int(c) for c in step_counts],
            "rows": rows,
            "dropped": loader.source.plan.dropped,
            "padded": loader.source.plan.padded,
        }
        del loader
    evaluated = [batch["label"].tolist() for batch in eval_loader(data, rank, world_size)]
    results["eval"] = {"rows": [row for batch in evaluated for row in batch]}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # as a rank of lance_hpc.run ends: gloo's threads may still hold the last collective's tensors


@pytest.mark.slow
def test_every_strategy_takes_equal_steps_on_every_rank_under_ddp(tmp_path):
    uri = write_dataset(str(tmp_path / "ddp.lance"), [50] * 6 + [13])
    context = mp.start_processes(
        rank_main,
        args=(WORLD_SIZE, str(tmp_path / "store"), uri, str(tmp_path)),
        nprocs=WORLD_SIZE,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"DDP data loading did not finish within {DEADLINE_S}s: a rank is stuck (hang)")
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    total = 313
    for _, sampler, uneven in RUNS:
        per_rank = [result[sampler] for result in results]
        planned = per_rank[0]["planned"]
        assert all(r["steps"] == planned and r["all_steps"] == [planned] * WORLD_SIZE for r in per_rank), sampler
        rows = [row for r in per_rank for row in r["rows"]]
        if sampler == "full_scan":
            assert all(sorted(r["rows"]) == list(range(total)) for r in per_rank)
        elif uneven == "drop":
            assert len(rows) == len(set(rows)) == total - per_rank[0]["dropped"]
        else:
            assert set(rows) == set(range(total)) and len(rows) == total + per_rank[0]["padded"]
    assert sorted(row for result in results for row in result["eval"]["rows"]) == list(range(total))
