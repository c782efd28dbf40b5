"""docs/walkthrough.md's commands work as written: run in order, from raw data to a LanceDB query, in
a fresh directory that holds the specs and examples they name (so that their data/, checkpoints/
and runs/ land there, not in the checkout)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "walkthrough.md"
BASH = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# What each step prints when it worked, by the command's first words.
SAYS = {
    "lance-hpc ingest": ["wrote 1,438 training rows to", "and 359 validation rows to"],
    "lance-hpc submit jobs/quickstart.yaml": ["final validation accuracy:", "checkpoint step 45: "],
    "lance-hpc submit jobs/quickstart_infer.yaml": ["with embedding, predicted, score for 359 rows"],
    "python3 examples/query_embeddings.py": ["rows predicted wrong", "nearest rows to row 0"],
    "python3 examples/lancedb_search.py": ["rows predicted wrong (table digits_val in data)", "rows nearest to one with label"],
}


def commands() -> list[str]:
    """The page's shell commands, in order, without the install line (this environment has them)."""
    lines = [line.strip() for block in BASH.findall(PAGE.read_text()) for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "python3 -m pip install"))]


def test_the_page_walks_every_step() -> None:
    assert [next(prefix for prefix in SAYS if command.startswith(prefix)) for command in commands()] == list(SAYS)


@pytest.mark.slow
def test_the_walkthrough_runs_from_raw_data_to_a_lancedb_query(tmp_path: Path) -> None:
    for folder in ("jobs", "examples"):
        shutil.copytree(REPO_ROOT / folder, tmp_path / folder)
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for command, (prefix, expected) in zip(commands(), SAYS.items()):
        program, _, rest = command.partition(" ")
        run = f"{sys.executable} {'-m lance_hpc ' if program == 'lance-hpc' else ''}{rest}"  # this interpreter, this checkout
        if prefix == "lance-hpc submit jobs/quickstart.yaml":
            run += " --set train.epochs=1"  # the path, not the accuracy: the quick start's test trains all 6 epochs
        done = subprocess.run(run, shell=True, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{command}\n{output}"
        assert all(text in output for text in expected), f"{command}\n{output}"
