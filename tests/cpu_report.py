"""The suite's CPU by test and by module, printed after pytest's ``--durations`` (tests/conftest.py loads it).

On 2 cores the suite's wall time is bounded by its CPU seconds over 2, whatever runs in parallel:
this report shows where they go. Each test's figure is the CPU of the pytest process over its
setup, call and teardown plus that of every process it started and waited for (worker jobs,
launchers, their children), from ``getrusage``. Under pytest-xdist each worker measures its own
tests and the figures reach the report through the test reports' ``user_properties``.
"""

from __future__ import annotations

import collections
import resource

import pytest

KEY = "cpu_s"
SHOWN = 15
_started: dict[str, float] = {}


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of every child it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started[item.nodeid] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and item.nodeid in _started:
        report.user_properties.append((KEY, cpu_seconds() - _started.pop(item.nodeid)))


def pytest_terminal_summary(terminalreporter):
    per_test = {report.nodeid: dict(report.user_properties)[KEY]
                for reports in terminalreporter.stats.values() for report in reports
                if getattr(report, "when", None) == "teardown" and KEY in dict(getattr(report, "user_properties", ()))}
    if not per_test:
        return
    per_module: dict[str, float] = collections.defaultdict(float)
    for nodeid, seconds in per_test.items():
        per_module[nodeid.split("::")[0]] += seconds
    total = sum(per_test.values())
    terminalreporter.write_sep("=", f"CPU: {total:.0f} s in all ({total / 60:.1f} min), most CPU first")
    for title, figures in (("tests", per_test), ("modules", per_module)):
        terminalreporter.write_line(f"{title}:")
        for name, seconds in sorted(figures.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
