"""Checkpoint files: atomic writes that survive a crash mid-write, pruning, RNG round trips, the
collective save, and the preemption flag."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lance_hpc import checkpoint, checkpoint_store
from lance_hpc.env import DistEnv, detect, process_group


@pytest.fixture
def single_rank() -> Iterator[torch.device]:
    with process_group(detect({}), timeout_s=30) as device:
        yield device


def state(step: int) -> dict:
    return {"step": step, "model": {"weight": torch.full((4, 4), float(step))}, "note": f"step {step}"}


def test_atomic_write_lists_and_prunes(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        checkpoint.write_atomically(state(step), checkpoint.checkpoint_path(tmp_path, step))
    (tmp_path / ".step-00000025.pt.999.tmp").write_bytes(b"half a checkpoint")
    assert [path.name for path in checkpoint.list_checkpoints(tmp_path)] == [
        "step-00000005.pt", "step-00000010.pt", "step-00000015.pt", "step-00000020.pt"
    ]
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000015.pt", "step-00000020.pt"]
    found = checkpoint.load_latest(tmp_path)
    path, loaded = found.path, found.state
    assert path.name == "step-00000020.pt" and loaded["note"] == "step 20"
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_failure_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    checkpoint.write_atomically(state(1), checkpoint.checkpoint_path(tmp_path, 1))

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_store.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.write_atomically(state(2), checkpoint.checkpoint_path(tmp_path, 2))
    found = checkpoint.load_latest(tmp_path)
    path, loaded = found.path, found.state
    assert path.name == "step-00000001.pt" and torch.equal(loaded["model"]["weight"], torch.full((4, 4), 1.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]  # the temporary file is gone


def test_process_killed_mid_write_leaves_a_loadable_previous_checkpoint(tmp_path: Path) -> None:
    """A real crash: the writer is SIGKILLed after its data hit the temporary file, before the rename."""
    child = textwrap.dedent(
        f"""
        import os, sys, time, torch
        from lance_hpc import checkpoint, checkpoint_store
        directory = {str(tmp_path)!r}
        checkpoint.write_atomically({{"step": 1, "weight": torch.ones(1000)}}, checkpoint.checkpoint_path(directory, 1))
        real_fsync = os.fsync
        def fsync_then_hang(fd):
            real_fsync(fd)
            print("written", flush=True)
            time.sleep(600)
        checkpoint_store.os.fsync = fsync_then_hang
        checkpoint.write_atomically({{"step": 2, "weight": torch.zeros(10_000_000)}}, checkpoint.checkpoint_path(directory, 2))
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "written"
    finally:
        process.kill()
        process.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(checkpoint.TEMP_SUFFIX)]
    assert len(leftovers) == 1 and (tmp_path / leftovers[0]).stat().st_size > 40_000_000
    found = checkpoint.load_latest(tmp_path)
    path, loaded = found.path, found.state
    assert path.name == "step-00000001.pt" and loaded["step"] == 1
    checkpoint.prune(tmp_path, keep=3)  # the next save clears what the crash left
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, capsys) -> None:
    checkpoint.write_atomically(state(1), checkpoint.checkpoint_path(tmp_path, 1))
    checkpoint.checkpoint_path(tmp_path, 2).write_bytes(b"not a checkpoint")
    path = checkpoint.load_latest(tmp_path).path
    assert path.name == "step-00000001.pt"
    assert "skipping unreadable checkpoint" in capsys.readouterr().err


def test_rng_states_round_trip() -> None:
    states = checkpoint.capture_rng()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    checkpoint.restore_rng(states)
    assert random.random() == expected[0] and float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_collective_save_gathers_every_rank_and_keeps_k(tmp_path: Path, single_rank: torch.device) -> None:
    for step in range(1, 5):
        path = checkpoint.save(tmp_path, step, state(step), {"loader": {"batches_consumed": step}}, keep=2)
    assert path == checkpoint.checkpoint_path(tmp_path, 4)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000003.pt", "step-00000004.pt"]
    loaded = checkpoint.load_latest(tmp_path).state
    assert len(loaded["ranks"]) == dist.get_world_size() and loaded["ranks"][0]["loader"] == {"batches_consumed": 4}
    assert set(loaded["ranks"][0]["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_failed_save_raises_instead_of_hanging(tmp_path: Path, single_rank: torch.device) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    with pytest.raises(RuntimeError, match="cannot write checkpoint"):
        checkpoint.save(blocker / "checkpoints", 1, state(1), {}, keep=1)


def test_preemption_signal_only_sets_a_flag(single_rank: torch.device) -> None:
    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    with checkpoint.Preemption() as preemption:
        assert not preemption.agreed(single_rank) and preemption.agreed_signal is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.agreed(single_rank) and preemption.agreed_signal == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a later SIGTERM does not take back the requeue request
        assert preemption.agreed(single_rank) and preemption.agreed_signal == signal.SIGUSR2
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)) == before


def test_no_requeue_beyond_max_requeues() -> None:
    env = DistEnv("slurm", 0, 0, 1, 1, 0, 1, "node1", 20001, job_id="12", restart_count=3)
    requeued, message = checkpoint.requeue_sbatch(env, max_requeues=3)
    assert not requeued and "requeued 3 times already (slurm.max_requeues: 3)" in message
