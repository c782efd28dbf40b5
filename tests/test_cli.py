"""The command line: one dispatcher, one module per command under lance_hpc/cli/, one way to end on a
mistake (one message, exit 2, no traceback), and the ``python -m`` shims that scripts and SLURM
tasks run, each the same command as ``lance-hpc``'s."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import lance_hpc
from lance_hpc import cli
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.errors import ExitCode, UserError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(lance_hpc.__file__).parent
# Commands that read a job spec as their first argument.
SPEC_COMMANDS = ("validate", "render", "submit", "plan", "bench", "status", "logs")
# python -m shim -> the prog its --help names
SHIMS = {
    "lance_hpc.submit": "python -m lance_hpc.submit",
    "lance_hpc.run": "python -m lance_hpc.run",
    "lance_hpc.ingest": "lance-hpc ingest",
    "lance_hpc.bench": "lance-hpc bench",
}


def write_spec(directory: Path, raw: dict[str, Any], name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(raw))
    return path


def run_module(*arguments: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *arguments], capture_output=True, text=True, timeout=120, cwd=ROOT, env=environ)


# ---- the dispatcher -----------------------------------------------------------------------------


def test_cli_lists_commands_and_rejects_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)
    assert cli.main([]) == 2
    assert "usage: lance-hpc COMMAND" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_cli_missing_module_is_a_clear_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.COMMANDS, "plan", ("lance_hpc.no_such_module", "plan"))
    assert cli.main(["plan", "job.yaml"]) == 2
    assert "lance-hpc plan: not available, lance_hpc.no_such_module cannot be loaded" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_is_one_module_of_the_cli_package_with_its_help(command: str) -> None:
    module_name, _ = cli.COMMANDS[command]
    assert module_name == f"lance_hpc.cli.{command}"
    assert callable(importlib.import_module(module_name).main)
    result = run_module("lance_hpc", command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: lance-hpc {command} "), result.stdout


def test_the_command_line_lives_in_the_cli_package_and_reports_errors_in_one_place() -> None:
    """argparse only under lance_hpc/cli/, and no command catches UserError itself: cli/reporting.py does."""
    parsers, catches = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        tree = ast.parse(path.read_text(), where)
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        if "argparse" in imported and path.parent.name != "cli":
            parsers.append(where)
        if path.parent.name == "cli" and path.name != "reporting.py":
            for node in ast.walk(tree):
                if isinstance(node, ast.ExceptHandler) and node.type is not None and "UserError" in ast.unparse(node.type):
                    catches.append(f"{where}:{node.lineno}")
    assert not parsers, f"a command line outside lance_hpc/cli/: {parsers}"
    assert not catches, f"a command that reports UserError itself instead of through run_reporting_errors: {catches}"


def test_the_docs_name_every_command() -> None:
    page = (ROOT / "docs" / "command-line.md").read_text()
    missing = [name for name in cli.COMMANDS if f"`lance-hpc {name}" not in page]
    assert not missing, f"docs/command-line.md does not describe: {missing}"


# ---- the one error handler ----------------------------------------------------------------------


def test_the_handler_turns_a_user_error_into_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    def bad() -> int:
        raise UserError("data.uri: no dataset there\n  fix: ingest it first")

    assert run_reporting_errors(bad, "lance-hpc thing") == ExitCode.USER_ERROR
    assert capsys.readouterr().err == "lance-hpc thing: data.uri: no dataset there\n  fix: ingest it first\n"

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert run_reporting_errors(interrupted) == ExitCode.INTERRUPTED
    assert run_reporting_errors(lambda: 3) == 3


def test_a_closed_pipe_ends_a_command_quietly() -> None:
    """``lance-hpc ... | head``: the reader goes away, the command ends with 0 and no second error."""
    script = (
        "import sys\n"
        "from lance_hpc.cli.reporting import run_reporting_errors\n"
        "def flood():\n"
        "    while True:\n"
        "        print('x' * 1000, flush=True)\n"
        "sys.exit(run_reporting_errors(flood))\n"
    )
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ)
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.read(10)
    writer.stdout.close()
    error = writer.stderr.read().decode()
    assert writer.wait(timeout=60) == 0 and error == "", error


@pytest.mark.parametrize("command", SPEC_COMMANDS)
def test_every_command_reports_a_missing_spec_as_one_message(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing.yaml")
    assert cli.main([command, missing]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    assert f"spec file {missing} does not exist" in err and "fix:" in err and "Traceback" not in err, err
    prefix = f"lance-hpc {command}" if command in ("status", "logs") else "error"
    assert err.startswith(f"{prefix}: "), err


# ---- commands -----------------------------------------------------------------------------------


def test_cli_validate_and_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = {"name": "v", "data": {"uri": "/d"}, "slurm": {"log_dir": str(tmp_path)}}
    spec_path = write_spec(tmp_path, raw)
    assert cli.main(["validate", str(spec_path), "--set", "slurm.nodes=3"]) == 0
    assert "valid (v: 3 node(s) x 1 task(s)" in capsys.readouterr().out
    assert cli.main(["validate", str(spec_path), "--set", "slurm.nodes=0"]) == 2
    assert "slurm.nodes: must be >= 1" in capsys.readouterr().err
    assert cli.main(["render", str(spec_path)]) == 0
    assert (tmp_path / "v.sbatch").exists() and (tmp_path / "v.spec.yaml").exists()


@pytest.mark.parametrize("command", ["submit", "run"])
def test_local_runs_the_written_spec_with_nproc(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``submit --local`` and ``run --local``: the resolved spec written, then its ranks here."""
    import lance_hpc.launch.local

    started: list[tuple[str, int]] = []
    monkeypatch.setattr(
        lance_hpc.launch.local, "run_local", lambda spec_file, nproc: started.append((str(spec_file), nproc)) or 0
    )
    raw = {"name": "loc", "data": {"uri": "/d"}, "slurm": {"tasks_per_node": 3, "log_dir": str(tmp_path)}}
    spec_path = write_spec(tmp_path, raw)
    assert cli.main([command, str(spec_path), "--local"]) == 0
    assert cli.main([command, str(spec_path), "--local", "--nproc", "2"]) == 0
    assert cli.main([command, str(spec_path), "--local", "--set", "slurm.tasks_per_node=4"]) == 0
    written = str(tmp_path / "loc.spec.yaml")
    assert started == [(written, 3), (written, 2), (written, 4)]


@pytest.mark.parametrize("option", [["--nproc", "2"], ["--set", "train.lr=0.1"], ["--sweep", "train.lr=0.1,0.2"]])
def test_run_without_local_refuses_the_options_of_a_local_run(
    option: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["run", str(tmp_path / "job.spec.yaml"), *option])
    assert stopped.value.code == 2
    assert f"{option[0]} goes with --local" in capsys.readouterr().err


# ---- the python -m shims ------------------------------------------------------------------------


@pytest.mark.parametrize("module", sorted(SHIMS))
def test_each_python_dash_m_shim_is_its_command(module: str) -> None:
    result = run_module(module, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {SHIMS[module]} "), result.stdout


def test_the_submit_shim_reports_errors_as_the_command_does(tmp_path: Path) -> None:
    result = run_module("lance_hpc.submit", str(tmp_path / "missing.yaml"), "--dry-run")
    assert result.returncode == ExitCode.USER_ERROR and result.stdout == ""
    assert result.stderr.startswith("error: ") and "does not exist" in result.stderr and "Traceback" not in result.stderr


# A spec's commands in one process, each followed by whether torch has been imported so far.
TORCH_PROBE = """
import sys
from lance_hpc.cli import main
for args in ARGS:
    sys.argv = ["lance-hpc", *args]
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
    print("PROBE", " ".join(args), "->", code, "torch" in sys.modules, flush=True)
"""


@pytest.mark.parametrize(
    ("spec", "commands"),
    [
        ("quickstart", ("validate", "render", "submit --dry-run", "plan", "status", "logs")),  # small_cnn
        ("lm_quickstart", ("validate", "render", "submit --dry-run", "status", "logs")),
        # an inference job's dry run checks the task's inputs against its outputs, which builds the task
        ("quickstart_infer", ("validate", "render", "status", "logs")),
    ],
)
def test_reading_a_spec_of_a_built_in_task_never_imports_torch(spec: str, commands: tuple[str, ...], tmp_path: Path) -> None:
    """Validation checks a built-in task's options without importing the task: on a login node,
    where importing torch can take many seconds, status, logs and a render take well under one."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / f"{spec}.yaml").write_text((ROOT / "jobs" / f"{spec}.yaml").read_text())
    calls = [[*command.split()[:1], f"jobs/{spec}.yaml", *command.split()[1:]] for command in commands]
    probe = TORCH_PROBE.replace("ARGS", repr(calls))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [line.removeprefix("PROBE ") for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == len(calls), result.stdout + result.stderr
    assert all(line.endswith("False") for line in lines), "\n".join(lines) + "\n" + result.stderr[-2000:]
    stopped = [line for line in lines if " -> 0 " not in line and not line.startswith(("status", "logs"))]
    assert not stopped, stopped  # each ran to its end (status and logs find no job here)


def test_each_registered_task_checks_its_options_with_the_model_it_runs_with() -> None:
    from lance_hpc.tasks.registry import OPTIONS, TASKS, options_class, task_class

    assert set(OPTIONS) == set(TASKS)
    assert all(options_class(name) is task_class(name).Options for name in TASKS)
