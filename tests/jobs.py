"""Runs real multi-worker jobs through ``tfdist run`` for tests, with hard timeouts.

A worker script gets an output directory as its first argument and writes
``worker<rank>.json`` there; ``run_job`` returns the launcher's result and those files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


@dataclasses.dataclass
class JobResult:
    returncode: int
    output: str
    results: dict[int, dict]  # rank -> what the worker wrote

    def check(self) -> "JobResult":
        assert self.returncode == 0, f"job failed with {self.returncode}:\n{self.output[-6000:]}"
        return self


SHIELD = REPO / "tests" / "shield"


def job_env(extra: dict[str, str] | None = None, shield: bool = True) -> dict[str, str]:
    """The environment for a job: the test tree first on PYTHONPATH (for ``tests.*``), quiet TensorFlow logs.

    Under ``bash tests/run.sh`` that tree holds no tfdist sources: workers import the installed package.
    With ``shield``, the job imports TensorFlow and Keras without jax, pandas and matplotlib (tests/shield).
    """
    env = dict(os.environ)
    path = [str(SHIELD)] * shield + [str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def run_job(script: str, out_dir: pathlib.Path, *args: str, num_workers: int = 2, timeout: float = 180,
            launcher_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> JobResult:
    """Starts ``tests/workers/<script>`` on ``num_workers`` workers; never outlives ``timeout``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "tfdist.run", "-n", str(num_workers), "--timeout", str(timeout),
               "--grace-period", "2", *launcher_args, "--",
               sys.executable, str(WORKERS / script), str(out_dir), *args]
    proc = subprocess.run(command, env=job_env(env), capture_output=True, text=True, timeout=timeout + 30)
    results = {}
    for path in out_dir.glob("worker*.json"):
        results[int(path.stem.removeprefix("worker"))] = json.loads(path.read_text())
    return JobResult(proc.returncode, proc.stdout + proc.stderr, results)
