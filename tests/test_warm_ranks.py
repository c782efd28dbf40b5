"""Local ranks forked from one warm server (``lance_hpc.launch.warm_ranks``): the launcher checks the
job in a forked process and never imports torch or Lance itself, each rank is named in ``ps``, a
restart forks from the same server, and without the server the launcher starts fresh ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lance_hpc.cli import submit
from lance_hpc.launch.warm_ranks import WarmRanks
from tests.support.jobs import final_state, write_spec
from tests.support.ranks import launch, rank_pid, read_until


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ranks_fork_from_one_warm_server_and_the_launcher_never_imports_torch(tmp_path: Path, digits) -> None:
    spec_file = write_spec(
        tmp_path, digits, data={"num_workers": 1}, train={"epochs": 1}, logging={"log_every_steps": 1, "progress": False}
    )
    launcher = launch(spec_file, 2)
    try:
        before = read_until(launcher, "step 2/")
        ranks = [rank_pid(launcher, rank) for rank in range(2)]
        for rank, pid in enumerate(ranks):
            assert Path(f"/proc/{pid}/comm").read_text().strip() == f"lance_hpc r{rank}"
            server = parent_of(pid)
            assert b"lance_hpc.launch.warm_ranks" in Path(f"/proc/{server}/cmdline").read_bytes()
            assert parent_of(server) == launcher.pid
            assert "libtorch_cpu" in mapped_libraries(pid)
        assert "libtorch_cpu" not in mapped_libraries(launcher.pid)  # the check ran in a forked process
        assert "lance.abi3" not in mapped_libraries(launcher.pid)
        output = before + launcher.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert "final validation accuracy" in output and "fork-safe" not in output, output
    assert not Path(f"/proc/{ranks[0]}").exists() and not Path(f"/proc/{server}").exists()


def test_a_killed_rank_restarts_from_the_same_server_and_the_job_ends(tmp_path: Path, digits) -> None:
    spec_file = write_spec(tmp_path, digits, logging={"log_every_steps": 1, "progress": False})
    launcher = launch(spec_file, 2)
    try:
        before = read_until(launcher, "step 50/")  # in epoch 2 of 4, a checkpoint at step 50
        first = rank_pid(launcher, 1)
        server = parent_of(first)
        os.kill(first, signal.SIGKILL)
        between = read_until(launcher, "restart 1: first step")
        assert parent_of(rank_pid(launcher, 1)) == server  # the next attempt forks from the same server
        output = before + between + launcher.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output
    assert f"rank 1 (pid {first}) was killed by SIGKILL" in output, output
    assert final_state(tmp_path)["step"] == 180, output


def test_without_the_server_the_launcher_starts_fresh_ranks(
    tmp_path: Path, digits, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    spec_file = write_spec(tmp_path, digits, train={"epochs": 1}, logging={"log_every_steps": 10, "progress": False})
    monkeypatch.setattr(WarmRanks, "start", classmethod(lambda cls: None))
    assert submit.main([str(spec_file), "--local", "--nproc", "2"]) == 0
    out, err = capfd.readouterr()
    assert "final validation accuracy" in out, out + err
    assert final_state(tmp_path)["step"] == 45
