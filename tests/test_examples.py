"""The README's examples run as written, through the launcher."""

import re
import subprocess
import sys

from tests.jobs import REPO, job_env

TIMEOUT = 180


def launch(*args, env=None):
    command = [sys.executable, "-m", "tfdist.run", *args]
    return subprocess.run(command, cwd=REPO, env=env or job_env(), capture_output=True, text=True, timeout=TIMEOUT)


def test_mirrored_example_trains_on_two_logical_cpus():
    result = launch("-n", "1", "--cpu-devices", "2", "--timeout", str(TIMEOUT), "--",
                    sys.executable, "examples/mirrored_fit.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "MirroredStrategy with 2 replica(s)" in result.stdout
    accuracy = float(result.stdout.split("final accuracy: ")[1].split()[0])
    assert accuracy > 0.9


def test_main_command_saves_on_the_chief_only_and_prints_no_tensorflow_start_up_logs(tmp_path):
    """The README's main command, with the user's environment (no TF_CPP_MIN_LOG_LEVEL of their own)."""
    env = job_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    result = launch("-n", "2", "--timeout", str(TIMEOUT), "--",
                    sys.executable, "examples/multi_worker_fit.py", str(tmp_path), env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] worker 0 of 2: 2 replicas in sync" in result.stdout
    assert "saved" in result.stdout and "[1] loss" not in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["multi_worker_model.keras"]
    lines = result.stdout.splitlines()
    assert not [line for line in lines if "oneDNN" in line or "cuInit" in line or "coordination" in line.lower()]
    assert "shuffle" not in result.stdout  # Keras' warning about a shuffle the script never passed
    assert "BackupAndRestore" not in result.stdout  # no preemption hint where no scheduler can preempt
    assert len(lines) < 20, result.stdout
    assert re.fullmatch(r"tfdist run: 2 worker\(s\), exit codes \[0, 0\], \d+\.\ds; all workers finished", lines[-1])


def test_horovod_style_example_checkpoints_on_rank_0_only(tmp_path):
    result = launch("-n", "2", "--timeout", str(TIMEOUT), "--",
                    sys.executable, "examples/horovod_style.py", str(tmp_path), "1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] test accuracy" in result.stdout and "[1] test accuracy" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.keras"]  # no worker temp dirs left
