"""One gate pass: Keras' test files run by pytest in a process of their own, plain or with tfdist imported first.

``workers=2`` runs the pass under ``tfdist run -n 2``: every worker runs the files, each writing its own
outcomes; a test counts as passed only if it passed on every worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from tests.keras_gate import plugin

REPO = pathlib.Path(__file__).resolve().parents[2]
TEST_TIMEOUT = 600  # seconds one Keras test may take on a loaded 2-core machine


@dataclasses.dataclass(frozen=True)
class Pass:
    """What a pass saw: each test's outcome, the files that failed to collect, the plugin's checks, its time."""

    name: str
    outcomes: dict[str, str]
    failures: dict[str, str]          # a failed test's report (its end)
    collection_errors: dict[str, str]
    checks: dict
    seconds: float
    returncode: int
    output: str

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def counts(self) -> str:
        return (f"{self.count('passed')} passed, {self.count('failed')} failed, {self.count('skipped')} skipped, "
                f"{len(self.collection_errors)} files not collected ({self.seconds:.0f} s)")


def environment(with_tfdist: bool, result: pathlib.Path) -> dict[str, str]:
    """The pass's environment: TensorFlow backend, tfdist's defaults (no TFDIST_* setting of the caller's)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TFDIST_")}
    env.update({"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", plugin.RESULT_ENV: str(result),
                plugin.PASS_ENV: "tfdist" if with_tfdist else "plain"})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def pytest_command(files: list[str], basetemp: pathlib.Path, extra: tuple[str, ...] = ()) -> list[str]:
    """pytest over ``files``, its temporary directories under ``basetemp`` (never pytest's shared numbered ones,
    which the suite running the gate, and the other pass beside this one, use too)."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.keras_gate.plugin",
            "--import-mode=importlib", "--continue-on-collection-errors", "-o", f"timeout={TEST_TIMEOUT}",
            "--no-header", "-rN", f"--basetemp={basetemp}", *extra, *files]


def run(root: pathlib.Path, files: list[str], with_tfdist: bool, workers: int = 1, timeout: float = 3600,
        extra: tuple[str, ...] = ()) -> Pass:
    """Runs ``files`` (relative to ``root``, the extracted tests) in ``root``; never outlives ``timeout``.

    ``workers > 1``: each file in a job of its own under ``tfdist run -n workers`` (whose start-up hook applies
    tfdist's fixes in every worker): Keras' tf.distribute test files reset TensorFlow's context
    (``context._reset_context()``), which in a worker drops the cluster the job connected at start-up, and with it
    what an earlier file made on the worker's devices.
    """
    if workers == 1:
        return _run_once(root, files, with_tfdist, 1, timeout, extra)
    parts = [_run_once(root, [file], with_tfdist, workers, timeout, extra) for file in files]
    return Pass(f"tfdist run -n {workers}", {k: v for part in parts for k, v in part.outcomes.items()},
                {k: v for part in parts for k, v in part.failures.items()},
                {k: v for part in parts for k, v in part.collection_errors.items()},
                {f"{file}: {k}": v for file, part in zip(files, parts) for k, v in part.checks.items()},
                sum(part.seconds for part in parts), max(part.returncode for part in parts),
                "\n".join(part.output for part in parts))


def _run_once(root: pathlib.Path, files: list[str], with_tfdist: bool, workers: int, timeout: float,
              extra: tuple[str, ...]) -> Pass:
    name = f"tfdist run -n {workers}" if workers > 1 else "tfdist" if with_tfdist else "plain"
    with tempfile.TemporaryDirectory(prefix="keras-gate-") as scratch:
        result = pathlib.Path(scratch) / "result.json"
        command = pytest_command(files, pathlib.Path(scratch) / "tmp", extra)
        if workers > 1:
            command = [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--timeout", str(int(timeout)),
                       "--", sys.executable, "-c", _PER_WORKER, *command[3:]]
        began = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=root, env=environment(with_tfdist, result), capture_output=True,
                                  text=True, timeout=timeout + 60)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, output = -1, f"timed out after {timeout:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}"
        seconds = time.monotonic() - began
        reports = _reports(result, workers)
    checks = reports[0]["checks"] if workers == 1 else {f"worker {i}": r["checks"] for i, r in enumerate(reports)}
    return Pass(name, _every_worker([r["outcomes"] for r in reports]),
                {test: text for r in reports for test, text in r.get("failures", {}).items()},
                {test: error for r in reports for test, error in r["collection_errors"].items()},
                checks, seconds, returncode, output)


# What each worker of `tfdist run` starts (`python -c _PER_WORKER <pytest arguments>`): pytest, writing its
# results to a file of its own and keeping its temporary directories in one of its own (the worker's index appended).
_PER_WORKER = ("import os, sys, pytest; rank = '.' + os.environ['TFDIST_WORKER_INDEX']; os.environ[{0!r}] += rank; "
               "sys.exit(pytest.main([a + rank if a.startswith('--basetemp=') else a for a in sys.argv[1:]]))"
               ).format(plugin.RESULT_ENV)


def _reports(result: pathlib.Path, workers: int) -> list[dict]:
    paths = [result] if workers == 1 else [result.with_name(f"{result.name}.{rank}") for rank in range(workers)]
    empty = {"outcomes": {}, "failures": {}, "collection_errors": {}, "checks": {}}
    return [json.loads(path.read_text()) if path.exists() else empty for path in paths]  # no file: it crashed


def _every_worker(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """One outcome per test: the worst any worker had ('failed' > 'skipped' > 'passed'); missing on one is failed."""
    names = set().union(*per_worker) if per_worker else set()
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    return {name: max((outcomes.get(name, "failed") for outcomes in per_worker), key=rank.__getitem__)
            for name in names}
