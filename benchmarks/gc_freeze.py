"""What freezing TensorFlow's and Keras' import-time objects out of Python's collector saves (tfdist.startup).

    python benchmarks/gc_freeze.py --rounds 5

Two commands, each run with ``TFDIST_GC_FREEZE=0`` (the collector left alone: the baseline) and
unset (tfdist's default), in alternating order every round:

* ``import``: one process, ``import tfdist, keras`` (every worker's start);
* ``job``: the README's main command, ``tfdist run -n 2 --cpu-devices 1 -- python
  examples/multi_worker_fit.py`` (two workers, a small fit, a save).

Each run's CPU is its process tree's (user + system, from ``RUSAGE_CHILDREN``), and its wall
time. Prints every round, then per command the medians and frozen / baseline (CPU and wall) as
the ratio of the medians and the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
COMMANDS = {
    "import": [sys.executable, "-c", "import tfdist, keras"],
    "job": [sys.executable, "-m", "tfdist.run", "-n", "2", "--cpu-devices", "1", "--",
            sys.executable, str(REPO / "examples" / "multi_worker_fit.py")],
}
SETUPS = {"baseline": {"TFDIST_GC_FREEZE": "0"}, "frozen": {}}


def run(command: list[str], env: dict) -> tuple[float, float]:
    """CPU seconds of the command's process tree, and its wall seconds."""
    before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    wall, after = time.monotonic() - began, resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"{command} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "TFDIST_GC_FREEZE"}
    figures = {(command, setup): [] for command in COMMANDS for setup in SETUPS}
    for round_ in range(args.rounds):
        order = list(SETUPS) if round_ % 2 == 0 else list(reversed(SETUPS))
        for command, argv in COMMANDS.items():
            for setup in order:
                cpu, wall = run(argv, {**base, **SETUPS[setup]})
                figures[command, setup].append((cpu, wall))
                print(f"round {round_ + 1} {command:6s} {setup:8s} cpu {cpu:6.2f} s  wall {wall:6.2f} s", flush=True)
    for command in COMMANDS:
        base_runs, frozen_runs = figures[command, "baseline"], figures[command, "frozen"]
        for index, what in ((0, "cpu"), (1, "wall")):
            b = [run_[index] for run_ in base_runs]
            f = [run_[index] for run_ in frozen_runs]
            per_round = statistics.median(x / y for x, y in zip(f, b))
            print(f"{command:6s} {what:4s}: baseline {statistics.median(b):.2f} s, frozen {statistics.median(f):.2f} s;"
                  f" frozen/baseline {statistics.median(f) / statistics.median(b):.3f} (median of rounds"
                  f" {per_round:.3f})")


if __name__ == "__main__":
    main()
