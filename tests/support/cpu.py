"""The CPU each test costs, listed at the end of a run beside pytest's slowest durations.

On two cores the suite is bound by CPU, not by waiting: a test that sleeps for a minute costs the
suite little, one whose ranks burn a minute of CPU costs it a minute. Each test process measures
its own CPU and that of the processes it waited for (a local job's launcher and, through it, its
ranks) from setup to teardown; a SLURM job's ranks are the cluster's processes and not counted.
The figure travels with the teardown report, so ``pytest -n`` lists it too.
"""

from __future__ import annotations

import resource

import pytest

KEY = "cpu_s"
LISTED = 30
_started = pytest.StashKey[float]()
_measured: dict[str, float] = {}


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_started] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    outcome = yield
    if call.when == "teardown" and _started in item.stash:
        outcome.get_result().user_properties.append((KEY, _cpu_s() - item.stash[_started]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == KEY:
                _measured[report.nodeid] = float(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _measured:
        return
    total = sum(_measured.values())
    listed = min(LISTED, len(_measured))
    terminalreporter.write_sep(
        "=", f"most CPU: {listed} of {len(_measured)} tests, {total:.0f} CPU s in all (SLURM jobs' ranks not counted)"
    )
    for nodeid, seconds in sorted(_measured.items(), key=lambda item: -item[1])[:listed]:
        terminalreporter.write_line(f"{seconds:7.1f}s {100 * seconds / total:4.1f}%  {nodeid}")
