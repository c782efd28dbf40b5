"""lance_hpc.Loader, the trainer's loader for a script of one's own: dict batches of the columns,
a transform run in the worker processes, equal steps on every rank (real gloo ranks), a state the
same on every rank that resumes on another world size and batch size with every row of the epoch
read once, and one UserError for each mistake."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lance_hpc import Loader, UserError
from lance_hpc.kinds.rank import exit_process
from tests.support.jobs import REPO_ROOT


def write_rows(uri: str, fragment_rows: list[int]) -> str:
    """A dataset whose ``x`` is the row id, with a vector, a string and a binary column."""
    total = sum(fragment_rows)
    ids = np.arange(total)
    table = pa.table(
        {
            "x": pa.array(ids),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float32)), 4),
            "name": pa.array([f"row {i}" for i in ids]),
            "blob": pa.array([bytes([i % 256]) * 3 for i in ids], pa.binary()),
        }
    )
    offset = 0
    for index, rows in enumerate(fragment_rows):
        lance.write_dataset(table.slice(offset, rows), uri, mode="create" if index == 0 else "append")
        offset += rows
    return uri


@pytest.fixture
def rows_uri(tmp_path: Path) -> str:
    return write_rows(str(tmp_path / "rows.lance"), [30, 30, 30, 13])


def double_vectors(batch: dict) -> dict:
    """A transform: runs in a worker process."""
    return {"vec": batch["vec"] * 2, "rows": batch["row_id"], "names": batch["name"]}


def failing_transform(batch: dict) -> dict:
    raise ValueError(f"cannot use a batch of {len(batch['x'])} rows")


def test_a_batch_is_a_dict_of_tensors_and_lists(rows_uri: str) -> None:
    loader = Loader(rows_uri, batch_size=8, columns=["x", "vec", "name", "blob"], num_workers=0)
    assert len(loader) == 13  # 103 rows, one rank: 12 full batches and 7 rows
    batches = list(loader)
    assert len(batches) == 13
    batch = batches[0]
    assert set(batch) == {"x", "vec", "name", "blob", "row_id"}
    assert batch["x"].dtype == torch.int64 and batch["x"].shape == (8,)
    assert batch["vec"].dtype == torch.float32 and batch["vec"].shape == (8, 4)
    assert torch.equal(batch["vec"][:, 0], batch["x"].float()) and torch.equal(batch["row_id"], batch["x"])
    assert batch["name"] == [f"row {int(i)}" for i in batch["x"]]
    assert batch["blob"] == [bytes([int(i) % 256]) * 3 for i in batch["x"]]
    rows = [int(row) for batch in batches for row in batch["row_id"]]
    assert sorted(rows) == list(range(103))


def test_the_transform_runs_in_the_worker_processes(rows_uri: str) -> None:
    loader = Loader(rows_uri, batch_size=10, columns=["vec", "name"], transform=double_vectors, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 11
    for batch in batches:
        assert set(batch) == {"vec", "rows", "names"}
        assert torch.equal(batch["vec"][:, 3], batch["rows"].float() * 2)
        assert batch["names"] == [f"row {int(i)}" for i in batch["rows"]]
    assert sorted(int(row) for batch in batches for row in batch["rows"]) == list(range(103))


def test_workers_hand_over_the_in_process_batches_each_in_one_shared_buffer(tmp_path: Path) -> None:
    """Without a transform the tensors of a worker's batch lie in one reused buffer (not a shared
    segment each); the batches equal the in-process ones, key order and dtypes too, and a column
    with nulls in a batch still comes as a list."""
    uri = write_rows(str(tmp_path / "rows.lance"), [30, 30, 30, 13])
    scores = pa.array([None if row % 17 == 0 else row / 2 for row in range(103)], pa.float64())
    lance.write_dataset(lance.dataset(uri).to_table().append_column("score", scores), uri, mode="overwrite")
    columns = ["vec", "x", "name", "score"]
    reference = list(Loader(uri, batch_size=8, columns=columns, num_workers=0, seed=3))
    batches = list(Loader(uri, batch_size=8, columns=columns, num_workers=2, seed=3))
    assert len(batches) == len(reference) == 13
    for batch, want in zip(batches, reference):
        assert list(batch) == list(want) == [*columns, "row_id"]
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                assert batch[name].dtype == value.dtype and torch.equal(batch[name], value), name
            else:
                assert batch[name] == value, name
        storages = {value.untyped_storage().data_ptr() for value in batch.values() if isinstance(value, torch.Tensor)}
        assert len(storages) == 1, "one buffer per batch"
    kinds = {type(batch["score"]) for batch in batches}
    assert kinds == {list, torch.Tensor}, "score has nulls in some batches only"


def test_set_epoch_changes_the_order_deterministically(rows_uri: str) -> None:
    def order(epoch: int) -> list[int]:
        loader = Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, seed=5)
        loader.set_epoch(epoch)
        return [int(row) for batch in loader for row in batch["x"]]

    assert order(1) == order(1)
    assert order(1) != order(2) and sorted(order(1)) == sorted(order(2))


def rows_of(loader: Loader, batches: int | None = None) -> list[int]:
    """The row ids of the loader's next ``batches`` batches (all of the pass when None)."""
    rows = []
    for index, batch in enumerate(loader):
        rows += batch["row_id"].tolist()
        if batches is not None and index + 1 == batches:
            break
    return rows


@pytest.mark.parametrize("strategy", [dict(sampler="distributed"), dict(style="iterable", sampler="sharded_fragment")])
def test_a_state_saved_on_2_ranks_resumes_on_3_with_another_batch_size(rows_uri: str, strategy: dict) -> None:
    """Ranks in one process (rank= and world_size= given): each reads its own share."""
    first = [Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, rank=r, world_size=2, **strategy) for r in range(2)]
    for loader in first:
        loader.set_epoch(3)
    seen = [row for loader in first for row in rows_of(loader, 4)]
    states = [loader.state_dict() for loader in first]
    assert states[0] == states[1], "the state is the same on every rank"
    state = json.loads(json.dumps(states[0]))  # plain values
    second = [Loader(rows_uri, batch_size=5, columns=["x"], num_workers=0, rank=r, world_size=3, **strategy) for r in range(3)]
    rest = []
    for loader in second:
        loader.load_state_dict(state)
        assert loader.epoch == 3
        loader.set_epoch(loader.epoch)
        rest.append(rows_of(loader))
    counts = collections.Counter(seen + [row for rows in rest for row in rows])
    planned = 103 - 103 % 2  # uneven: drop leaves fewer than world_size rows out
    assert sorted(counts.values()) == [1] * planned, "every row of the epoch once, over both parts"


def test_a_state_saved_in_a_loop_of_workers_resumes_at_the_next_batch(rows_uri: str) -> None:
    loader = Loader(rows_uri, batch_size=10, columns=["x"], num_workers=2)
    whole = [batch["x"].tolist() for batch in loader]
    loader.set_epoch(0)
    batches = iter(loader)
    head = [next(batches)["x"].tolist() for _ in range(4)]
    state = loader.state_dict()
    del batches
    resumed = Loader(rows_uri, batch_size=10, columns=["x"], num_workers=2)
    resumed.load_state_dict(state)
    assert head + [batch["x"].tolist() for batch in resumed] == whole


def test_a_state_of_other_data_is_refused_naming_what_differs(rows_uri: str) -> None:
    state = Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, seed=1).state_dict()
    other = Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, seed=2, filter="x > 3")
    with pytest.raises(UserError, match="seed= was 1, is 2") as error:
        other.load_state_dict(state)
    assert "filter= was None, is 'x > 3'" in str(error.value) and "fix:" in str(error.value)
    lance.write_dataset(lance.dataset(rows_uri).to_table().slice(0, 5), rows_uri, mode="append")  # version 5
    newer = Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, seed=1)
    with pytest.raises(UserError, match="version= was 4, is 5"):
        newer.load_state_dict(state)
    Loader(rows_uri, batch_size=8, columns=["x"], num_workers=0, seed=1, version=4).load_state_dict(state)
    with pytest.raises(UserError, match="not a state of lance_hpc.Loader"):
        newer.load_state_dict({"epoch": 1})
    for pinned in ([], {"sources": "x"}, {"sources": [1]}):  # shapes a state never has
        with pytest.raises(UserError, match="not a state of lance_hpc.Loader"):
            newer.load_state_dict({**state, "pinned": pinned})
    with pytest.raises(UserError, match="incomplete or damaged"):
        newer.load_state_dict({**state, "version": 2, "pinned": {**state["pinned"], "version": 5}, "epoch": "one"})


def test_bad_arguments_are_one_error_naming_each(rows_uri: str) -> None:
    with pytest.raises(UserError) as error:
        Loader(rows_uri, batch_size=0, sampler="random", num_workers=0, bogus=1)
    message = str(error.value)
    assert "3 bad arguments" in message
    assert "batch_size: must be >= 1" in message and "sampler: 'random' is not a valid choice" in message
    assert "bogus: unknown key" in message and "fix:" in message


def test_a_missing_column_lists_the_datasets_columns(rows_uri: str) -> None:
    with pytest.raises(UserError, match="'label' not in") as error:
        Loader(rows_uri, columns=["x", "label"], num_workers=0)
    assert "x (int64)" in str(error.value) and "vec (fixed_size_list" in str(error.value)


def test_a_lambda_transform_is_refused_before_any_worker_starts(rows_uri: str) -> None:
    with pytest.raises(UserError, match="cannot be sent to the worker processes"):
        Loader(rows_uri, columns=["x"], transform=lambda batch: batch, num_workers=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_transform_that_raises_names_the_batch_and_carries_its_message(rows_uri: str, num_workers: int) -> None:
    loader = Loader(rows_uri, batch_size=8, columns=["x"], transform=failing_transform, num_workers=num_workers)
    with pytest.raises(UserError) as error:
        list(loader)
    message = str(error.value)
    assert message.startswith("the transform failing_transform raised on batch 0 of epoch 0 (rows ")
    assert "ValueError: cannot use a batch of 8 rows" in message
    assert "Traceback" not in message and "lance_hpc/" not in message


def rank_main(rank: int, world_size: int, store: str, uri: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    loader = Loader(uri, batch_size=8, columns=["x", "vec"], num_workers=1)
    loader.set_epoch(1)
    steps, rows = 0, []
    for batch in loader:
        ranks_here = torch.ones(1)
        dist.all_reduce(ranks_here)  # a rank short of batches would leave the other waiting here
        rows += batch["x"].tolist()
        steps += 1
    result = {"rank": loader.rank, "world_size": loader.world_size, "steps": steps, "len": len(loader), "rows": rows}
    result["state"] = loader.state_dict()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # gloo's threads may still hold the last collective's tensors


@pytest.mark.slow
def test_two_gloo_ranks_take_equal_steps_on_an_uneven_dataset(tmp_path: Path) -> None:
    uri = write_rows(str(tmp_path / "uneven.lance"), [40, 40, 17])  # 97 rows: 48 a rank, 6 batches of 8
    context = mp.start_processes(
        rank_main, args=(2, str(tmp_path / "store"), uri, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "the ranks did not finish: one is waiting for the other"
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]  # from torch.distributed
    assert results[0]["steps"] == results[1]["steps"] == results[0]["len"] == 6
    assert results[0]["state"] == results[1]["state"]
    rows = results[0]["rows"] + results[1]["rows"]
    assert len(rows) == len(set(rows)) == 96  # one row dropped: fewer than world_size


def torchrun(nproc: int, *arguments: str, example: str = "torchrun_ddp.py") -> subprocess.CompletedProcess:
    """An example of examples/ under ``torchrun --standalone`` on CPU (gloo), one worker a rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = str(REPO_ROOT / "examples" / example)
    return subprocess.run(
        [*command, script, "--workers", "1", *arguments], env=environ, capture_output=True, text=True, timeout=400
    )


@pytest.mark.slow
def test_the_torchrun_example_resumes_on_3_ranks_what_2_ranks_began(tmp_path: Path) -> None:
    uri = write_rows(str(tmp_path / "rows.lance"), [30, 30, 30, 13])  # 51 rows a rank of 2: 7 steps of 8
    logs = tmp_path / "rows"
    logs.mkdir()
    common = ["--data", uri, "--checkpoint", str(tmp_path / "ckpt.pt"), "--rows-log", str(logs), "--save-every", "2"]
    first = torchrun(2, *common, "--stop-after", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(path.name for path in logs.iterdir()) == ["rows-2-0.txt", "rows-2-1.txt"]
    second = torchrun(3, *common)
    assert second.returncode == 0, second.stdout + second.stderr
    steps = {path.name: len(path.read_text().splitlines()) for path in logs.iterdir()}
    assert steps == {"rows-2-0.txt": 3, "rows-2-1.txt": 3, "rows-3-0.txt": 3, "rows-3-1.txt": 3, "rows-3-2.txt": 3}
    rows = [int(row) for path in logs.iterdir() for line in path.read_text().splitlines() for row in line.split()[1:]]
    assert sorted(collections.Counter(rows).values()) == [1] * 102, "every row of the epoch trained on once"


@pytest.mark.slow
def test_the_torchrun_example_as_a_command_job_stopped_by_usr2_on_2_ranks_resumes_on_3(tmp_path: Path) -> None:
    """The example as a ``command:`` job on the local launcher: SIGUSR2 (SLURM's warning) reaches
    each program as SIGTERM, every rank stops after the same step, saved; the rerun on 3 ranks
    trains on the rest of the epoch, every row once."""
    uri = write_rows(str(tmp_path / "rows.lance"), [200, 200, 100])  # 250 rows a rank of 2: 32 steps of 8
    logs = tmp_path / "rows"
    logs.mkdir()
    argv = [sys.executable, str(REPO_ROOT / "examples" / "torchrun_ddp.py"), "--data", uri, "--workers", "1"]
    argv += ["--checkpoint", str(tmp_path / "ckpt.pt"), "--rows-log", str(logs), "--save-every", "1000", "--step-seconds", "0.3"]
    (tmp_path / "job.yaml").write_text(json.dumps({"name": "ddp", "command": argv}))
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    submit = [sys.executable, "-m", "lance_hpc", "submit", "job.yaml", "--local", "--nproc"]
    first = subprocess.Popen(
        [*submit, "2"], cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not any(path.stat().st_size for path in logs.iterdir()):  # training has begun
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
            time.sleep(0.1)
        first.send_signal(signal.SIGUSR2)
        output = first.communicate(timeout=300)[0]
    finally:
        first.kill()
    assert first.returncode == 3, output  # stopped by the warning, to be run again
    stopped_at = {path.name: len(path.read_text().splitlines()) for path in logs.iterdir()}
    assert set(stopped_at) == {"rows-2-0.txt", "rows-2-1.txt"} and len(set(stopped_at.values())) == 1, stopped_at
    assert 0 < stopped_at["rows-2-0.txt"] < 32, f"stopped after the step in progress: {stopped_at}\n{output}"
    second = subprocess.run([*submit, "3"], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, second.stdout + second.stderr
    rows = [int(row) for path in logs.iterdir() for line in path.read_text().splitlines() for row in line.split()[1:]]
    assert sorted(collections.Counter(rows).values()) == [1] * 500, "every row of the epoch trained on once"
