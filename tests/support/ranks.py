"""Ranks for the tests: a process group of one in this process (the ``single_rank`` fixture), and
local ranks started as a user starts them (``lance-hpc submit SPEC --local --nproc 2``),
and what the tests read from them: their output up to a marker, a rank's pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lance_hpc.runtime.environment import detect, process_group
from tests.support.jobs import REPO_ROOT


def launch(spec_file: Path, nproc: int = 2) -> subprocess.Popen:
    """``python -m lance_hpc submit SPEC --local --nproc N`` in the background, its stdout piped."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "lance_hpc", "submit", str(spec_file), "--local", "--nproc", str(nproc)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
        cwd=REPO_ROOT,
    )


def read_until(process: subprocess.Popen, marker: str, timeout_s: float = 120) -> str:
    """The output of ``process`` up to and including the first line that contains ``marker``."""
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"{marker!r} never appeared:\n{''.join(lines)}")


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of local rank ``rank`` of ``launcher``: forked by its warm ranks' server (a child of
    the launcher), which names it ``lance_hpc r{rank}``, or started fresh by the launcher itself."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    for pid in children.get(launcher.pid, []):
        for candidate in [pid, *children.get(pid, [])]:
            try:
                name = Path(f"/proc/{candidate}/comm").read_text().strip()
                environ = Path(f"/proc/{candidate}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if name == f"lance_hpc r{rank}" or (candidate == pid and f"RANK={rank}".encode() in environ):
                return candidate
    raise AssertionError(f"rank {rank} of launcher {launcher.pid} not found")


@pytest.fixture
def single_rank() -> Iterator[torch.device]:
    """This process as rank 0 of a world of 1, its process group formed (gloo on CPU)."""
    with process_group(detect({}), timeout_s=30) as device:
        yield device
