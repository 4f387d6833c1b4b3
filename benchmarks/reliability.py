"""What a worker death costs: time to stop the job, and time lost per restart.

Runs tests/workers/fault_job.py (2 workers, 4 epochs, BackupAndRestore) through
`tfdist run` three ways: clean; worker 1 SIGKILLed mid-epoch 2 with no restarts;
the same with --max-restarts 1. Prints seconds and the restart cost as a ratio of
the clean run.

    python benchmarks/reliability.py
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_fault_job(inject: bool, *launcher_args: str) -> tuple[float, float | None, int]:
    """Returns (wall seconds, seconds from the kill to the launcher's exit, exit code)."""
    with tempfile.TemporaryDirectory() as out_dir:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
               "FAULT_INJECT": "1" if inject else "0"}
        command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--timeout", "300", *launcher_args, "--",
                   sys.executable, str(REPO / "tests/workers/fault_job.py"), out_dir]
        start = time.time()
        code = subprocess.run(command, env=env, capture_output=True, timeout=360).returncode
        end = time.time()
        killed = pathlib.Path(out_dir, "killed_at")
        return end - start, end - float(killed.read_text()) if killed.exists() else None, code


def main() -> None:
    clean, _, clean_code = run_fault_job(inject=False)
    _, stop_latency, stop_code = run_fault_job(True)
    restarted, _, restart_code = run_fault_job(True, "--max-restarts", "1")
    print(f"clean 4-epoch job:                 {clean:6.1f} s (exit {clean_code})")
    print(f"kill -> launcher exit, no restart: {stop_latency:6.1f} s (exit {stop_code})")
    print(f"killed + 1 restart, 4 epochs:      {restarted:6.1f} s (exit {restart_code})")
    print(f"time lost to the restart:          {restarted - clean:6.1f} s "
          f"({restarted / clean:.2f}x the clean job)")


if __name__ == "__main__":
    main()
