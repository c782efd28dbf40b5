"""Processes lance_hpc starts never import from the working directory: local ranks and their
DataLoader workers, ingest workers, and the worker server of a process that lance_hpc did not
start itself. Each runs from a directory where someone planted ``typing_extensions.py`` (which
torch and pydantic import), a module that notes every process that imports it; the spec's own
import paths (a task file named relative to where the job is started) still import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lance
import pytest
import yaml

from lance_hpc.imports import SAFE_PATH_VARIABLE, child_environment, python_command
from tests.support.jobs import REPO_ROOT, write_spec
from tests.support.shards import digit_rows, write_webdataset

PLANTED_MODULE = "typing_extensions"


def plant(directory: Path) -> Path:
    """A ``typing_extensions.py`` in ``directory`` that notes the pid and command of each process
    importing it (in ``imported-by``, which the tests expect never to exist)."""
    directory.mkdir(parents=True, exist_ok=True)
    note = directory / "imported-by"
    (directory / f"{PLANTED_MODULE}.py").write_text(
        textwrap.dedent(f"""\
            import os, sys
            with open({str(note)!r}, "a") as note:
                note.write(f"pid {{os.getpid()}}: {{sys.argv}}\\n")
            """)
    )
    return note


def not_imported(note: Path, output: str) -> str:
    return f"the planted {PLANTED_MODULE}.py was imported by:\n{note.read_text()}\n--- output:\n{output}"


def without_safe_path() -> dict[str, str]:
    """This environment, this checkout importable, and no PYTHONSAFEPATH inherited from the test run."""
    environ = {key: value for key, value in os.environ.items() if key != SAFE_PATH_VARIABLE}
    return {**environ, "PYTHONPATH": str(REPO_ROOT)}


def test_a_child_gets_the_flag_the_variable_and_this_lance_hpc() -> None:
    assert python_command("-m", "x") == [sys.executable, "-P", "-m", "x"]
    environ = child_environment({"PYTHONPATH": "/elsewhere"})
    assert environ[SAFE_PATH_VARIABLE] == "1"
    assert environ["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
    probe = "import sys, lance_hpc; print(sys.flags.safe_path, lance_hpc.__file__)"
    shown = subprocess.run(
        python_command("-c", probe), env=child_environment({}), cwd="/", capture_output=True, text=True, check=True
    )
    assert shown.stdout.split() == ["True", str(REPO_ROOT / "lance_hpc" / "__init__.py")], shown.stderr


@pytest.mark.slow
def test_local_ranks_and_their_workers_never_import_from_the_working_directory(tmp_path: Path, digits) -> None:
    shared = tmp_path / "shared"  # where the job is started: a directory others can write to
    note = plant(shared)
    (shared / "tasks").mkdir()
    (shared / "tasks" / "my_task.py").write_text("from tests.custom_task import PixelMLP\n\n\nclass MyMLP(PixelMLP):\n    pass\n")
    spec_file = write_spec(
        tmp_path / "job",
        digits,
        task={"name": "tasks/my_task.py:MyMLP", "options": {"hidden": 8}},  # relative to where the job starts
        data={"num_workers": 1},  # each rank starts a worker server and a worker
        train={"epochs": 1, "max_steps": 3},
    )
    # the launcher is the user's own process: -P keeps it from importing the planted module itself
    launcher = [sys.executable, "-P", "-m", "lance_hpc.submit", str(spec_file), "--local", "--nproc", "2"]
    done = subprocess.run(launcher, env=without_safe_path(), cwd=shared, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert not note.exists(), not_imported(note, output)
    assert done.returncode == 0, output
    resolved = yaml.safe_load((tmp_path / "job" / "logs" / "digits.spec.yaml").read_text())
    assert resolved["task"]["name"] == f"{shared / 'tasks' / 'my_task.py'}:MyMLP"


@pytest.mark.slow
def test_ingest_workers_never_import_from_the_working_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    note = plant(shared)
    write_webdataset(tmp_path / "wds", digit_rows(24), per_tar=6)
    target = tmp_path / "train.lance"
    ingest = [sys.executable, "-P", "-m", "lance_hpc.ingest", f"webdataset:{tmp_path}/wds/*.tar", str(target), "--nproc", "2"]
    done = subprocess.run(ingest, env=without_safe_path(), cwd=shared, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert not note.exists(), not_imported(note, output)
    assert done.returncode == 0, output
    assert lance.dataset(str(target)).count_rows() == 24


def test_the_worker_server_never_imports_from_the_working_directory(tmp_path: Path) -> None:
    """A user's own script (its directory, not the working directory, on its sys.path) whose
    loader uses lance_hpc's workers: the worker server starts as ``python -c``, which would put
    the working directory first."""
    note = plant(tmp_path / "shared")
    script = tmp_path / "code" / "load.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent("""\
            from torch.utils.data import DataLoader
            from lance_hpc.loading import worker_context
            if __name__ == "__main__":
                loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, multiprocessing_context=worker_context())
                print([batch.tolist() for batch in loader])
            """)
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env=without_safe_path(),
        cwd=tmp_path / "shared",
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert not note.exists(), not_imported(note, output)
    assert done.returncode == 0 and "[[0, 1], [2, 3]]" in done.stdout, output


def test_a_task_file_imports_its_siblings_but_never_shadows_an_installed_module(tmp_path: Path) -> None:
    """A task named by its file (``my_task.py:Task``) in a folder where someone planted ``lance.py``
    and ``json.py``: the task and its own sibling module import, Lance and the standard library's
    json are the real ones, and the folder is not first on sys.path."""
    folder = tmp_path / "shared"
    folder.mkdir()
    marker = folder / "planted-ran"
    for planted in ("lance", "json"):
        (folder / f"{planted}.py").write_text(f"open({str(marker)!r}, 'a').write({planted!r} + '\\n')\n")
    (folder / "helpers.py").write_text("WIDTH = 8\n")
    (folder / "my_task.py").write_text("import json\nfrom helpers import WIDTH\n\n\nclass Task:\n    width = WIDTH\n")
    probe = textwrap.dedent(f"""\
        import sys
        assert "lance" not in sys.modules and "json" not in sys.modules
        from lance_hpc.imports import load_object
        task = load_object({str(folder / "my_task.py")!r} + ":Task", "task.name")
        import lance, json
        print(task.width, task.__module__, sys.path[0] == {str(folder)!r}, lance.__file__, json.__file__)
        """)
    done = subprocess.run(python_command("-c", probe), env=child_environment({}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), f"the planted module ran: {marker.read_text()}"
    width, module, first, lance_file, json_file = done.stdout.split()
    assert (width, module, first) == ("8", "my_task", "False")
    assert str(folder) not in lance_file and str(folder) not in json_file
