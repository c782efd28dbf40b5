"""Checkpoint helpers shared by the checkpoint and trainer tests: a small training state to save,
and a real, small file system to fill up."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch


def state(step: int) -> dict:
    return {"step": step, "model": {"weight": torch.full((4, 4), float(step))}, "note": f"step {step}"}


@contextmanager
def small_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (tmpfs) at ``mount_point``; the test is skipped where mounting
    is not permitted (not root, or a container without CAP_SYS_ADMIN)."""
    mount_point.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
