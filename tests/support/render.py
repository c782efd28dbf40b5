"""Golden files for rendered batch scripts: compare a script with ``tests/golden/NAME``, or record
it there when ``LANCE_HPC_RECORD_GOLDEN=1``; and the files a rendered script needs to run."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from lance_hpc.launch.paths import JobPaths, make_private_dirs, write_private
from lance_hpc.launch.restart_script import supervisor_program
from lance_hpc.spec import JobSpec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("LANCE_HPC_RECORD_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    expected = path.read_text() if path.exists() else ""
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), f"golden/{name}", "rendered"))
        pytest.fail(
            f"the rendered script differs from tests/golden/{name}:\n{diff}\n"
            "if the change is intended, re-record the golden files and review them in git:\n"
            "  LANCE_HPC_RECORD_GOLDEN=1 python -m pytest tests/test_render.py",
            pytrace=False,
        )


def write_restarts_program(spec: JobSpec) -> None:
    """Put the restart supervisor where a script rendered for ``spec`` runs it, as
    ``write_job_files`` does (for tests that run a rendered script without writing the job's files)."""
    if spec.slurm.max_restarts:
        path = JobPaths.of(spec).restarts_program
        make_private_dirs(path.parent)
        write_private(path, supervisor_program())
