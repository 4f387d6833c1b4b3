"""One gate pass: Keras' test files (or tests, by node id) run by pytest in a process of their own, plain or with
tfdist imported first; or only collected (``collect``).

``workers=2`` runs the pass under ``tfdist run -n 2``: every worker runs the files, each writing its own
outcomes; a test counts as passed only if it passed on every worker. Else ``run`` shares the tests between
``SIDE_BY_SIDE`` pytest processes (one per core), each collecting every file and running every other test.
"""

from __future__ import annotations

import concurrent.futures
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
SIDE_BY_SIDE = 2    # pytest processes a pass without tfdist run shares its tests between


@dataclasses.dataclass(frozen=True)
class Pass:
    """What a pass saw: the tests it collected, the outcome of each it ran, the files that failed to collect, the
    plugin's checks in each of its processes, its time."""

    name: str
    collected: list[str]              # node ids
    outcomes: dict[str, str]          # a test it ran -> 'passed', 'failed' or 'skipped'
    failures: dict[str, str]          # a failed test's report (its end)
    collection_errors: dict[str, str]
    checks: dict[str, dict]           # process ('tfdist', 'FILE: worker 0', ...) -> the plugin's checks there
    seconds: float
    returncode: int
    output: str

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def counts(self) -> str:
        return (f"{len(self.collected)} collected, {self.count('passed')} passed, {self.count('failed')} failed, "
                f"{self.count('skipped')} skipped, {len(self.collection_errors)} files not collected "
                f"({self.seconds:.0f} s)")


def environment(with_tfdist: bool, result: pathlib.Path, shard: str = "") -> dict[str, str]:
    """The pass's environment: TensorFlow backend, tfdist's defaults (no TFDIST_* setting of the caller's), the
    plugin's shard if any (``i/n``)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TFDIST_")}
    env.update({"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", plugin.RESULT_ENV: str(result),
                plugin.PASS_ENV: "tfdist" if with_tfdist else "plain", **({plugin.SHARD_ENV: shard} if shard else {})})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def pytest_command(tests: pathlib.Path, basetemp: pathlib.Path, extra: tuple[str, ...] = ()) -> list[str]:
    """pytest over the files or node ids listed in the file ``tests`` (one a line: no command-line length limit, and
    an id's brackets and spaces reach pytest as they are), its temporary directories under ``basetemp`` (never
    pytest's shared numbered ones, which the suite running the gate, and the passes beside this one, use too)."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.keras_gate.plugin",
            "--import-mode=importlib", "--continue-on-collection-errors", "-o", f"timeout={TEST_TIMEOUT}",
            "--no-header", "-rN", f"--basetemp={basetemp}", *extra, f"@{tests}"]


def run(root: pathlib.Path, files: list[str], with_tfdist: bool, workers: int = 1, timeout: float = 3600,
        extra: tuple[str, ...] = (), processes: int = SIDE_BY_SIDE) -> Pass:
    """Runs ``files`` (relative to ``root``, the extracted tests; or node ids) in ``root``; never outlives ``timeout``.

    ``workers == 1``: the tests shared between ``processes`` pytest processes run at once. ``workers > 1``: each
    file in a job of its own under ``tfdist run -n workers`` (whose start-up hook applies tfdist's fixes in every
    worker): Keras' tf.distribute test files reset TensorFlow's context (``context._reset_context()``), which in a
    worker drops the cluster the job connected at start-up, and with it what an earlier file made on the worker's
    devices.
    """
    began = time.monotonic()
    if workers > 1:
        parts = {file: _run_once(root, [file], with_tfdist, workers, timeout, extra) for file in files}
        return merged(f"tfdist run -n {workers}", parts, time.monotonic() - began)
    if processes == 1:
        return _run_once(root, files, with_tfdist, 1, timeout, extra)
    shards = [f"{index}/{processes}" for index in range(processes)]
    with concurrent.futures.ThreadPoolExecutor(len(shards)) as pool:
        parts = list(pool.map(lambda shard: _run_once(root, files, with_tfdist, 1, timeout, extra, shard), shards))
    return merged(parts[0].name, {f"shard {shard}": part for shard, part in zip(shards, parts)},
                  time.monotonic() - began)


def collect(root: pathlib.Path, files: list[str], timeout: float = 3600, extra: tuple[str, ...] = ()) -> Pass:
    """The plain pass's collection of ``files`` (``pytest --collect-only`` without tfdist): its tests, collection
    errors and checks; no test runs."""
    return _run_once(root, files, False, 1, timeout, ("--collect-only", *extra))


def rerun(root: pathlib.Path, collection: Pass, tests: list[str], timeout: float = 3600) -> Pass:
    """The plain pass: ``collection`` (``collect``'s), and ``tests`` of it run plain by node id (none: no run)."""
    if not tests:
        return collection
    ran = run(root, tests, with_tfdist=False, timeout=timeout, processes=min(len(tests), SIDE_BY_SIDE))
    return merged(collection.name, {"collection": collection, "run": ran}, collection.seconds + ran.seconds)


def merged(name: str, parts: dict[str, Pass], seconds: float) -> Pass:
    """``parts`` (by label: a file, a shard, ...) as one pass that took ``seconds``: their tests, outcomes,
    failures and collection errors together, their checks by label and process, the worst exit status (killed or
    timed out, a negative one, first)."""
    def joined(field: str) -> dict:
        return {key: value for part in parts.values() for key, value in getattr(part, field).items()}

    return Pass(name, list(dict.fromkeys(test for part in parts.values() for test in part.collected)),
                joined("outcomes"), joined("failures"), joined("collection_errors"),
                {f"{label}: {process}": checks for label, part in parts.items()
                 for process, checks in part.checks.items()},
                seconds, max((part.returncode for part in parts.values()), key=lambda code: (code < 0, abs(code))),
                "\n".join(part.output for part in parts.values()))


def _run_once(root: pathlib.Path, tests: list[str], with_tfdist: bool, workers: int, timeout: float,
              extra: tuple[str, ...], shard: str = "") -> Pass:
    name = f"tfdist run -n {workers}" if workers > 1 else "tfdist" if with_tfdist else "plain"
    if not tests:  # pytest with no path collects the whole folder
        raise ValueError(f"a {name} pass of no test file")
    with tempfile.TemporaryDirectory(prefix="keras-gate-") as scratch:
        result, listed = pathlib.Path(scratch) / "result.json", pathlib.Path(scratch) / "tests"
        listed.write_text("\n".join(tests))
        command = pytest_command(listed, pathlib.Path(scratch) / "tmp", extra)
        if workers > 1:
            command = [sys.executable, "-m", "tfdist.run", "-n", str(workers), "--timeout", str(int(timeout)),
                       "--", sys.executable, "-c", _PER_WORKER, *command[3:]]
        began = time.monotonic()
        try:
            proc = subprocess.run(command, cwd=root, env=environment(with_tfdist, result, shard),
                                  capture_output=True, text=True, timeout=timeout + 60)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as expired:
            returncode, output = -1, f"timed out after {timeout:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}"
        seconds = time.monotonic() - began
        reports = _reports(result, workers)
    checks = ({name: reports[0]["checks"]} if workers == 1 else
              {f"worker {i}": report["checks"] for i, report in enumerate(reports)})
    return Pass(name, list(dict.fromkeys(test for r in reports for test in r["collected"])),
                _every_worker([r["outcomes"] for r in reports]),
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
    empty = {"collected": [], "outcomes": {}, "failures": {}, "collection_errors": {}, "checks": {}}
    return [json.loads(path.read_text()) if path.exists() else empty for path in paths]  # no file: it crashed


def _every_worker(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """One outcome per test: the worst any worker had ('failed' > 'skipped' > 'passed'); missing on one is failed."""
    names = set().union(*per_worker) if per_worker else set()
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    return {name: max((outcomes.get(name, "failed") for outcomes in per_worker), key=rank.__getitem__)
            for name in names}
