"""Profiler traces of a few steps on every rank, from the spec or asked of a running job by USR1:
the trace files are opened and checked (Chrome trace JSON with the steps and torch's operators)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.support.jobs import check_trace, write_spec
from tests.support.ranks import launch, read_until

pytestmark = pytest.mark.slow


def test_the_spec_profiles_steps_and_usr1_profiles_a_running_job(tmp_path: Path, digits) -> None:
    spec = write_spec(
        tmp_path,
        digits,
        train={"epochs": 2, "profile": {"start_step": 3, "steps": 2}},
        logging={"progress": False, "log_every_steps": 5},
    )
    launcher = launch(spec)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output
    traces = sorted((tmp_path / "runs" / "profile").glob("*.pt.trace.json"))
    assert [path.name for path in traces] == ["rank0.step3.pt.trace.json", "rank1.step3.pt.trace.json"], output
    for path in traces:
        check_trace(path)
    assert "profiler trace of steps 3..4 written for every rank" in output

    asked = tmp_path / "asked"
    spec = write_spec(asked, digits, train={"epochs": 50}, logging={"progress": False, "log_every_steps": 5})
    launcher = launch(spec)
    try:
        read_until(launcher, "step 10/")
        launcher.send_signal(signal.SIGUSR1)  # the launcher passes it to its ranks
        read_until(launcher, "profiler trace of steps", timeout_s=120)
        time.sleep(1)
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.communicate(timeout=60)
    traces = sorted((asked / "runs" / "profile").glob("rank*.pt.trace.json"))
    assert len(traces) == 2, traces
    for path in traces:
        check_trace(path)
