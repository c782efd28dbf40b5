"""Restarts inside the allocation, without a cluster: the policy (what restarts, what stops and
with which error), the nodes a restart takes, what srun and the ranks' notes say of a failure, the
supervisor program run as the batch script runs it (a copy, ``python3 -I``, the standard library
only) around a fake srun, the spec's rules, the script, and the lines ``lance-hpc status`` prints.
The same on the real SLURM test cluster: tests/test_train_slurm.py, tests/test_ingest_slurm.py;
with local ranks: tests/test_trainer.py."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lance_hpc.kinds import standby
from lance_hpc.launch import render, restart_script, restarts
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.restarts import Attempt, Cause, StepReport, attempt_cause, choose_nodes, decide
from lance_hpc.manage.attempts import attempt_lines
from lance_hpc.runtime import attempt as rank_attempt
from lance_hpc.runtime import failures
from lance_hpc.runtime.restart_variables import ATTEMPT_VARIABLE
from lance_hpc.slurm.records import JobRef
from lance_hpc.spec import SpecError, validate_spec
from tests.support.jobs import REPO_ROOT

KILLED = Cause("killed", "was killed (srun: Killed)", 1, "node2")
BAD_BATCH = Cause("error", "ValueError: bad batch", 1, "node2", step=5)


def failed(number: int, cause: Cause | None, code: int = 1) -> Attempt:
    return Attempt(number, 1000.0 + number, ["node1", "node2"], 4, ended=1010.0 + number, exit_code=code, cause=cause)


@pytest.mark.parametrize(
    ("history", "restart", "code", "reason"),
    [
        ([failed(0, None, 0)], False, 0, "finished"),
        ([failed(0, KILLED, 137)], True, 137, "restart 1 of at most 2"),
        ([failed(0, KILLED, 137), failed(1, KILLED, 137)], True, 137, "restart 2 of at most 2"),
        # out of restarts: the job ends with the first attempt's error and exit code
        (
            [failed(0, KILLED, 137), failed(1, BAD_BATCH), failed(2, KILLED, 143)],
            False,
            137,
            "no restarts left (slurm.max_restarts: 2); the first error: rank 1 on node2 was killed",
        ),
        # the same error at the same step: a bug, not a fault
        (
            [failed(0, BAD_BATCH), failed(1, BAD_BATCH)],
            False,
            1,
            "the same error at step 5 in attempts 1 and 2, so a restart would fail again: rank 1 on node2 at step 5: "
            "ValueError: bad batch",
        ),
        ([failed(0, BAD_BATCH), failed(1, Cause("error", "ValueError: bad batch", 0, "node1", step=9))], True, 1, "restart 2"),
        # the same error outside any step (an entry that fails before its loop, a job without one)
        (
            [failed(0, Cause("error", "KeyError: 'x'", 0, "node1")), failed(1, Cause("error", "KeyError: 'x'", 0, "node1"))],
            False,
            1,
            "the same error in attempts 1 and 2, so a restart would fail again: rank 0 on node1: KeyError: 'x'",
        ),
        ([failed(0, Cause("error", "no such column", 0, "node1", user_error=True))], False, 2, "a problem in the spec or data"),
        ([failed(0, None, 2)], False, 2, "a problem in the spec or data"),
        # exit 2 whose note says no user must fix it: another process took the rendezvous port
        ([failed(0, Cause("error", "rank 0 cannot listen on port 20009", 0, "node1"), 2)], True, 2, "restart 1 of at most 2"),
        ([failed(0, None, 3)], False, 3, "stopped by a signal"),
        # rank 0 stopped on a signal (its checkpoint saved); srun's --kill-on-bad-exit then ended the
        # slower rank, so srun's own code is 143: the rank's own exit decides
        ([failed(0, Cause("exit", "exited with exit code 3 (srun)", 0, "node1", exit_code=3), 143)], False, 3, "stopped"),
        ([failed(0, Cause("exit", "exited with exit code 1 (srun)", 0, "node1", exit_code=1), 143)], True, 143, "restart 1"),
        ([failed(0, None, 255)], False, 255, "requeued"),
    ],
)
def test_what_restarts_and_what_stops(history: list[Attempt], restart: bool, code: int, reason: str) -> None:
    decision = decide(history, max_restarts=2)
    assert (decision.restart, decision.exit_code) == (restart, code), decision
    assert reason in decision.reason, decision.reason


def test_a_restart_takes_a_spare_for_a_failed_node_or_goes_on_with_fewer_down_to_min_nodes() -> None:
    allocated = ["node1", "node2", "node3"]
    assert choose_nodes(allocated, {}, wanted=2, minimum=2) == ["node1", "node2"]  # node3 is the spare
    assert choose_nodes(allocated, {"node2": "failed"}, wanted=2, minimum=2) == ["node1", "node3"]
    assert choose_nodes(allocated, {"node2": "failed", "node3": "down"}, wanted=2, minimum=1) == ["node1"]
    assert choose_nodes(allocated, {"node2": "failed", "node3": "down"}, wanted=2, minimum=2) is None


def test_srun_and_the_ranks_notes_say_which_rank_or_node_failed_first(tmp_path: Path) -> None:
    report = StepReport()
    for line in (
        "0: step 3/10",
        "srun: error: node2: task 1: Killed",
        "srun: launch/slurm: _step_signal: Terminating StepId=7.0",
        "srun: error: node1: tasks 0,2-3: Exited with exit code 1",
    ):
        report.read(line)
    assert report.first_task() == Cause("killed", "was killed (srun: Killed)", 1, "node2")
    assert [task.rank for task in report.tasks] == [1, 0, 2, 3]
    assert attempt_cause(tmp_path, report, 137).describe() == "rank 1 on node2 was killed (srun: Killed)"

    # a rank that lost contact with the dead one may exit before srun hears of the death
    late = StepReport()
    for line in ("srun: error: node1: task 0: Exited with exit code 1", "srun: error: node1: task 1: Killed"):
        late.read(line)
    assert late.first_task() == Cause("exit", "exited with exit code 1 (srun)", 0, "node1", exit_code=1)
    (tmp_path / "late").mkdir()
    failures.note_failure(0, "lost contact", lost_contact=True, directory=str(tmp_path / "late"), host="node1")
    assert attempt_cause(tmp_path / "late", late, 137) == Cause("killed", "was killed (srun: Killed)", 1, "node1")

    # a rank's own error beats srun's account of who exited; one that lost contact does not
    failures.note_failure(0, "lost contact", lost_contact=True, directory=str(tmp_path), host="node1")
    failures.note_failure(1, "ValueError: bad batch", lost_contact=False, directory=str(tmp_path), step=5, host="node2")
    assert attempt_cause(tmp_path, report, 1) == BAD_BATCH

    # a failed node beats both: its ranks' errors follow from it
    report.read("srun: error: Node failure on node2")
    assert attempt_cause(tmp_path, report, 1) == Cause("node", "srun reported a node failure", host="node2")
    assert report.failed_nodes == {"node2": "srun reported a node failure"}


def test_the_supervisor_program_holds_what_it_imports_of_lance_hpc() -> None:
    """It runs outside any container, where lance_hpc may not be installed: every module in it imports
    the standard library and the modules packed beside it, nothing else."""
    sources = restart_script.packed_sources()
    packed = {name.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for name in sources}
    wanted = {
        "lance_hpc.cli.restarts",
        "lance_hpc.launch.restarts.supervisor",
        "lance_hpc.runtime.ports",
        "lance_hpc.runtime.restart_variables",  # the names it sets for the ranks, which they read from it too
        "__main__",
    }
    assert wanted <= packed, sorted(packed)
    for name, source in sources.items():
        tree = ast.parse(source, name)
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        outside = {
            module for module in imported if module.split(".")[0] not in sys.stdlib_module_names and module not in packed
        } - {"__future__"}
        assert not outside, f"{name} imports {sorted(outside)}, which the supervisor program does not hold"
    assert restart_script.supervisor_program() == restart_script.supervisor_program()  # a re-render writes the same file


def test_each_lance_hpc_variable_is_named_in_one_module() -> None:
    """The supervisor and its ranks (and any other two processes) share a variable by importing its
    name, never by writing it twice: a copy that drifted would leave the ranks blind to their attempt."""
    package = Path(restart_script.__file__).resolve().parents[1]
    modules: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"LANCE_HPC_[A-Z_]+", node.value):
                modules.setdefault(node.value, set()).add(str(path.relative_to(package)))
    assert modules["LANCE_HPC_ATTEMPT"] == {"runtime/restart_variables.py"}
    twice = {name: sorted(where) for name, where in modules.items() if len(where) > 1}
    assert not twice, f"variables named in more than one module (import the name instead): {twice}"


def write_program(tmp_path: Path) -> Path:
    """The supervisor as write_job_files writes it beside a job's script."""
    program = tmp_path / "job.restarts.pyz"
    program.write_bytes(restart_script.supervisor_program())
    return program


FAKE_SRUN = """#!/bin/bash
# a step of {ranks} ranks: each attempt counted; rank 1 notes its error while the file says so
n=$(cat "$COUNT" 2>/dev/null || echo 0); echo $((n + 1)) > "$COUNT"
echo "attempt $LANCE_HPC_ATTEMPT of the step: $*"
step=${{STEP:-7}}; [ "$step" = each ] && step=$n  # each: a new step every attempt
if [ -e "$FAIL_FILE" ]; then
    printf '{{"rank": 1, "host": "n1", "time": %s, "lost_contact": false, "message": "%s", "step": %s}}' \\
        "$(date +%s)" "$(cat "$FAIL_FILE")" "$step" > "$LANCE_HPC_FAILURE_DIR/rank-1.json"
    echo "srun: error: n1: task 1: Exited with exit code 1" >&2
    [ -n "$FAIL_ONCE" ] && rm -f "$FAIL_FILE"
    exit 1
fi
"""


def supervise(tmp_path: Path, message: str, **variables: str) -> tuple[subprocess.CompletedProcess[str], list[Attempt]]:
    """The supervisor as the batch script runs it: a copy, with python3 -I, around a fake srun."""
    program = write_program(tmp_path)
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir(exist_ok=True)
    srun.write_text(FAKE_SRUN.format(ranks=2))
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "fail").write_text(message)
    environ = {
        "PATH": f"{srun.parent}:{os.environ['PATH']}",
        "COUNT": str(tmp_path / "count"),
        "FAIL_FILE": str(tmp_path / "fail"),
        **variables,
    }
    command = [sys.executable, "-I", str(program), "--max-restarts=2", "--nodes=1", "--min-nodes=1", "--tasks-per-node=2"]
    command += [f"--record={tmp_path / 'record'}", "--no-standby", "--", "srun", "python3", "-m", "lance_hpc.run", "x.yaml"]
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return result, restarts.read_attempts(tmp_path / "record" / restarts.ATTEMPTS_FILE)


def test_a_failed_step_starts_again_and_the_attempts_are_recorded(tmp_path: Path) -> None:
    result, attempts = supervise(tmp_path, "OSError: a flaky disk", FAIL_ONCE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attempt 0 of the step" in result.stdout and "attempt 1 of the step" in result.stdout
    assert (
        "lance_hpc: attempt 1 failed after" in result.stdout and "rank 1 on n1 at step 7: OSError: a flaky disk" in result.stdout
    )
    assert "srun: error: n1: task 1: Exited with exit code 1" in result.stderr  # srun's own lines pass through
    assert [(attempt.number, attempt.exit_code) for attempt in attempts] == [(0, 1), (1, 0)]
    assert attempts[0].cause == Cause("error", "OSError: a flaky disk", 1, "n1", step=7)
    assert attempts[0].outcome == "restarted (restart 1 of at most 2)" and attempts[1].outcome == "finished"


def test_a_restart_promises_no_checkpoint_the_job_may_not_have_saved(tmp_path: Path) -> None:
    """The supervisor cannot see whether the job saved a checkpoint (it failed before one, or its
    kind keeps none): the line says it resumes from what the job saved, if anything."""
    result, _ = supervise(tmp_path, "OSError: a flaky disk", FAIL_ONCE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from the latest checkpoint" not in result.stdout, result.stdout
    assert (
        "restart 1 of at most 2 in this allocation, resuming from what the job saved (its latest checkpoint, if any)"
    ) in result.stdout, result.stdout


def test_the_same_error_at_the_same_step_stops_after_the_second_attempt_with_that_error(tmp_path: Path) -> None:
    result, attempts = supervise(tmp_path, "ValueError: bad batch on rank 1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert (tmp_path / "count").read_text().strip() == "2"
    assert (
        "lance_hpc: the job failed after 2 attempt(s) in this allocation: the same error at step 7 in attempts 1 and 2, "
        "so a restart would fail again: rank 1 on n1 at step 7: ValueError: bad batch on rank 1"
    ) in result.stderr
    assert len(attempts) == 2 and "the same error" in attempts[1].outcome


def test_a_job_out_of_restarts_ends_with_the_first_error(tmp_path: Path) -> None:
    result, attempts = supervise(tmp_path, "ValueError: bad batch", STEP="each")
    assert result.returncode == 1, result.stdout + result.stderr
    assert len(attempts) == 3  # the first and slurm.max_restarts (2) more
    assert "no restarts left (slurm.max_restarts: 2); the first error: rank 1 on n1 at step 0: ValueError" in result.stderr


def test_the_script_asks_for_spares_keeps_the_allocation_and_runs_srun_through_the_supervisor() -> None:
    raw = {"name": "big", "data": {"uri": "/d"}, "slurm": {"nodes": 4, "spare_nodes": 1, "min_nodes": 3, "log_dir": "/logs"}}
    spec = validate_spec(raw).spec
    script = render.render_sbatch(spec, "/logs/big.spec.yaml")
    directives = dict(render.sbatch_directives(script))
    assert directives["nodes"] == "5" and directives["no-kill"] is True
    supervisor = (
        f"python3 -I -c {shlex.quote(restart_script.RUN_OWN_PROGRAM)} /logs/big.restarts.pyz --max-restarts=2 --nodes=4 --min-nodes=3 --tasks-per-node=1 "
        '--record=/logs/big.attempts/"$SLURM_JOB_ID" --progress=/logs/big.watch/"$SLURM_JOB_ID" --'
    )
    assert f"{supervisor} \\\n    srun --label" in script
    assert restart_script.srun_through_restarts(spec)[-1] == f'srun() {{ {supervisor} srun "$@"; }}'  # submitit's script
    off = validate_spec({**raw, "slurm": {"nodes": 4, "max_restarts": 0, "log_dir": "/logs"}}).spec
    assert "no-kill" not in dict(render.sbatch_directives(render.render_sbatch(off, "/x.yaml")))
    assert restart_script.srun_through_restarts(off) == [] and "restarts.pyz" not in render.render_sbatch(off, "/x.yaml")


@pytest.mark.parametrize(
    ("slurm", "path", "message"),
    [
        ({"nodes": 2, "min_nodes": 3}, "slurm.min_nodes", "3 is more than slurm.nodes (2)"),
        ({"spare_nodes": 1, "max_restarts": 0}, "slurm.spare_nodes", "but slurm.max_restarts is 0"),
        ({"nodes": 2, "min_nodes": 1, "max_restarts": 0}, "slurm.min_nodes", "but slurm.max_restarts is 0"),
    ],
)
def test_restart_settings_that_cannot_work_are_refused_with_their_path(slurm: dict[str, Any], path: str, message: str) -> None:
    with pytest.raises(SpecError) as raised:
        validate_spec({"name": "x", "data": {"uri": "/d"}, "slurm": slurm})
    assert f"{path}: " in str(raised.value) and message in str(raised.value) and "fix:" in str(raised.value)


def test_status_shows_each_attempt_when_and_where_it_ran_and_why_it_ended(tmp_path: Path) -> None:
    spec = validate_spec({"name": "job", "data": {"uri": "/d"}, "slurm": {"log_dir": str(tmp_path)}}).spec
    record = JobPaths.of(spec).attempts / "42"
    record.mkdir(parents=True)
    first = failed(0, KILLED, 137)
    first.step, first.outcome = 31, "restarted (restart 1 of at most 2)"
    second = Attempt(1, 1020.0, ["node1"], 2)
    (record / restarts.ATTEMPTS_FILE).write_text(f"{first.line()}\n{second.line()}\n")
    lines = attempt_lines(JobRef("42", spec, "job.yaml"))
    assert lines[0] == "2 attempt(s) (slurm.max_restarts: 2 per allocation)"
    assert lines[1].endswith(
        "attempt 1 on node1,node2 (4 ranks): failed after 10 s: rank 1 on node2 was killed (srun: Killed) "
        "(ranks had reached step 31) -> restarted (restart 1 of at most 2)"
    )
    assert lines[2].endswith("attempt 2 on node1 (2 ranks): running")
    assert attempt_lines(JobRef("43", spec, "job.yaml")) == []  # no restart: nothing to add to the headline


def test_a_restarted_rank_knows_when_the_failure_was_and_a_standby_rank_waits_for_its_go(tmp_path: Path) -> None:
    assert rank_attempt.restarted({}) is None
    restart = rank_attempt.restarted({"LANCE_HPC_ATTEMPT": "1", "LANCE_HPC_FAILED_AT": "12.5", "LANCE_HPC_FAILED_STEP": "40"})
    assert restart == rank_attempt.Restart(1, 12.5, 40)
    assert rank_attempt.end_step_on_hang({"LANCE_HPC_RESTARTS_LEFT": "0"}) is None  # the last attempt only reports a hang

    go = tmp_path / "attempt1.go"
    go.write_text(json.dumps({"environ": {"MASTER_PORT": "23456", "LANCE_HPC_FAILED_AT": "12.5"}}))
    environ = {"LANCE_HPC_STANDBY": str(go), "SLURM_PROCID": "3"}
    standby.wait_if_standby(str(tmp_path / "missing.yaml"), environ)
    assert environ == {"SLURM_PROCID": "3", "MASTER_PORT": "23456", "LANCE_HPC_FAILED_AT": "12.5"}
    assert (tmp_path / "attempt1.go.ready-3").exists()  # what the supervisor counts to say the standby is ready


def test_the_benchmark_section_reports_both_paths_and_judges_their_ratio() -> None:
    from benchmarks import restarts as section
    from lance_hpc.bench.configs import Result
    from lance_hpc.bench.runner import Summary

    def summary(mode: str, seconds: float) -> Summary:
        figures = {"seconds": seconds, "steps_redone": 3.0, "resumed_at": 30.0}
        result = Result(mode, section.DATASET, 0.0, seconds, 0, 3, 60.0, 0.0, 0.0, 0.0, store=figures)
        return Summary(mode, section.DATASET, runs=[[result]])

    assert [config.data["mode"] for config in section.configs(None)] == ["restart", "requeue"]  # type: ignore[arg-type]
    summaries = {(section.DATASET, mode): summary(mode, seconds) for mode, seconds in (("restart", 2.5), ("requeue", 40.0))}
    report = section.section_report(None, summaries)  # type: ignore[arg-type]
    assert [target.met for target in report.targets] == [True]
    assert "0.06x (2.5 s vs 40.0 s; wanted <= 0.5x)" in report.targets[0].detail
    summaries[(section.DATASET, "restart")] = summary("restart", 30.0)
    assert [target.met for target in section.section_report(None, summaries).targets] == [False]  # type: ignore[arg-type]


# The job holds one node, this one, and SLURM marks it usable.
ALLOCATION = {
    "scontrol": '#!/bin/bash\n[ "$2" = job ] && echo "JobId=7 NodeList=here" || echo here\n',
    "sinfo": "#!/bin/bash\necho 'here idle'\n",
}


def fake_slurm(bin_dir: Path, srun: str) -> dict[str, str]:
    """scontrol, sinfo and ``srun`` in ``bin_dir`` for an allocation of one node, ``here``; the
    variables the batch step would have."""
    bin_dir.mkdir(exist_ok=True)
    for name, text in {**ALLOCATION, "srun": srun}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "here"}


STANDBY_SRUN = """#!/bin/bash
# a standby step: its 2 ranks say they are ready, then wait for the go file
if [ -n "$LANCE_HPC_STANDBY" ]; then
    touch "$LANCE_HPC_STANDBY.ready-0" "$LANCE_HPC_STANDBY.ready-1"
    until [ -e "$LANCE_HPC_STANDBY" ]; do sleep 0.05; done
    grep -q cancel "$LANCE_HPC_STANDBY" && exit 0
    echo "standby released as attempt $LANCE_HPC_ATTEMPT: $(cat "$LANCE_HPC_STANDBY")"
    exit 0
fi
# a running step: it publishes a step, and ends (with EXIT) once the standby step is ready
printf '{"rank": 0, "time": %s, "step": 3}' "$(date +%s.%N)" > "$PROGRESS/rank-0.json"
until ls "$RECORD"/*.go.ready-1 > /dev/null 2>&1; do sleep 0.05; done
sleep 0.5  # the supervisor looks every 0.1 s
[ "$EXIT" = 0 ] || echo "srun: error: n1: task 1: Killed" >&2
exit "$EXIT"
"""


@pytest.mark.parametrize("exit_code", [137, 0])
def test_a_standby_step_started_ahead_is_released_for_a_restart_or_cancelled_at_the_end(tmp_path: Path, exit_code: int) -> None:
    """Once the running attempt published a step, the next attempt's ranks start and wait: a failure
    releases them with the failure's time and a port held for their rank 0, a job that finishes
    tells them they are not needed."""
    program = write_program(tmp_path)
    (tmp_path / "progress").mkdir()
    record = tmp_path / "record"
    environ = {**fake_slurm(tmp_path / "bin", STANDBY_SRUN), "PROGRESS": str(tmp_path / "progress"), "RECORD": str(record)}
    command = [sys.executable, "-I", str(program), "--max-restarts=2", "--nodes=1", "--min-nodes=1", "--tasks-per-node=2"]
    command += [f"--record={record}", f"--progress={tmp_path / 'progress'}", "--", "srun", "true"]
    result = subprocess.run(command, env={**environ, "EXIT": str(exit_code)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lance_hpc: attempt 2's 2 ranks are started and waiting, should this one fail" in result.stdout
    go = json.loads((record / "run0-attempt1.go").read_text())
    if exit_code:
        assert "attempt 2 of at most 3 on here: 2 ranks (its ranks were started and waiting)" in result.stdout, result.stdout
        assert "standby released as attempt 1: " in result.stdout and "LANCE_HPC_FAILED_AT" in go["environ"], result.stdout
        assert go["environ"]["MASTER_PORT"].isdigit() and go["environ"]["LANCE_HPC_PORT_HANDOFF"].startswith("lance_hpc-port-"), (
            go
        )
    else:
        assert go == {"cancel": True} and "standby released" not in result.stdout


def test_a_rendezvous_port_another_process_took_is_noted_as_a_fault_and_a_spec_error_as_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lance_hpc.errors import UserError
    from lance_hpc.kinds.rank import note_rank_failure
    from lance_hpc.runtime.failures import PortInUse

    monkeypatch.setenv("LANCE_HPC_FAILURE_DIR", str(tmp_path))
    for rank, error in ((0, PortInUse("rank 0 cannot listen on port 20009")), (1, UserError("no column 'image'"))):
        monkeypatch.setenv("RANK", str(rank))
        note_rank_failure(error)
    notes = {note["rank"]: note for note in restarts.notes(tmp_path)}
    assert (notes[0]["user_error"], notes[1]["user_error"]) == (False, True)


def test_a_rank_on_fewer_nodes_than_the_job_holds_is_a_misconfiguration_unless_the_supervisor_chose_them() -> None:
    """A 1-rank job with a spare node holds 2 nodes and runs its step on one."""
    from lance_hpc.errors import UserError
    from lance_hpc.runtime.environment import detect

    task = {
        "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_NODELIST": "node1",
    }  # fmt: skip
    with pytest.raises(UserError, match="world size is 1 but the job holds 2 nodes"):
        detect(task)
    env = detect({**task, ATTEMPT_VARIABLE: "0"})
    assert (env.world_size, env.num_nodes, env.master_addr) == (1, 1, "node1")


TAKE_PORT = """\
import os, socket
from lance_hpc.runtime.ports import take_held_port

# rank 0 of an attempt, on the supervisor's node: it takes over the socket held for it on MASTER_PORT, if one is
port, attempt = int(os.environ["MASTER_PORT"]), os.environ["LANCE_HPC_ATTEMPT"]
name = os.environ.get("LANCE_HPC_PORT_HANDOFF", "")
held = take_held_port(port)
if held is None:
    print(f"attempt {attempt}: port {port} not held")
else:
    with socket.socket(fileno=held) as listener:
        listening = listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        print(f"attempt {attempt}: port {port} held, listening {listening}, handed over as {name}")
"""
PORT_SRUN = """#!/bin/bash
python3 "$TAKE_PORT"
[ "$LANCE_HPC_ATTEMPT" = 0 ] && { echo "srun: error: here: task 1: Killed" >&2; exit 137; }
exit 0
"""


def test_a_restart_gets_a_port_held_for_its_rank_0_as_the_first_attempt_does(tmp_path: Path) -> None:
    """After the first attempt, the batch step's holder is gone and another process took the port
    (the test holds it): the restart runs on a port the supervisor holds from before srun starts,
    which its rank 0 takes over listening; once the job ends nothing holds it."""
    program = write_program(tmp_path)
    (tmp_path / "take_port.py").write_text(TAKE_PORT)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        first_port = taken.getsockname()[1]
        environ = {
            **fake_slurm(tmp_path / "bin", PORT_SRUN),
            "PYTHONPATH": str(REPO_ROOT),  # for the fake rank 0 (the supervisor itself runs with -I)
            "TAKE_PORT": str(tmp_path / "take_port.py"),
            "MASTER_PORT": str(first_port),
            "LANCE_HPC_PORT_HANDOFF": "lance_hpc-port-of-the-batch-step-gone",
        }
        command = [sys.executable, "-I", str(program), "--max-restarts=1", "--nodes=1", "--min-nodes=1", "--tasks-per-node=2"]
        command += [f"--record={tmp_path / 'record'}", "--no-standby", "--", "srun", "true"]
        result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"attempt 0: port {first_port} not held" in output, output
    restarted = re.search(r"attempt 1: port (\d+) held, listening 1, handed over as (lance_hpc-port-\w+)", output)
    assert restarted and int(restarted.group(1)) != first_port, output
    assert "attempt 2 of at most 2 on here: 2 ranks" in output, output
    with socket.socket() as probe:  # the holder ended with the hand-over; nothing listens there now
        probe.bind(("0.0.0.0", int(restarted.group(1))))
