"""`tfdist run`: starting, watching and stopping workers (toy workers, no TensorFlow)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.jobs import WORKERS, job_env

LAUNCH_TIMEOUT = 60


def launch(tmp_path, mode, *launcher_args, num_workers=2):
    command = [sys.executable, "-m", "tfdist.run", "-n", str(num_workers), "--grace-period", "1",
               *launcher_args, "--", sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), mode]
    return subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_pids(tmp_path):
    return [int(p.read_text()) for p in tmp_path.glob("pid*")]


def test_workers_get_distinct_tf_configs_and_prefixed_output(tmp_path):
    result = launch(tmp_path, "echo", "--cpu-devices", "2")
    assert result.returncode == 0, result.stdout
    assert "[0] hello from 0" in result.stdout and "[1] hello from 1" in result.stdout
    envs = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in (0, 1)]
    configs = [json.loads(env["TF_CONFIG"]) for env in envs]
    assert configs[0]["cluster"] == configs[1]["cluster"]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    addresses = configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert [env["TFDIST_WORKER_INDEX"] for env in envs] == ["0", "1"]
    assert all(env["TFDIST_NUM_WORKERS"] == "2" and env["TFDIST_CPU_DEVICES"] == "2" for env in envs)


def test_failed_worker_stops_the_others_and_sets_the_exit_code(tmp_path):
    started = time.monotonic()
    result = launch(tmp_path, "fail1")
    assert result.returncode == 3
    assert time.monotonic() - started < 30
    assert "worker 1 exited with code 3; stopped all workers" in result.stdout
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_worker_that_ignores_sigterm_is_killed(tmp_path):
    result = launch(tmp_path, "ignore_term", "--timeout", "3")
    assert result.returncode == 124
    assert "the job ran past --timeout; stopped all workers" in result.stdout
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_workers_that_never_join_are_stopped_after_the_start_timeout(tmp_path):
    started = time.monotonic()
    result = launch(tmp_path, "join_alone", "--start-timeout", "1")
    assert result.returncode == 124
    assert ("worker(s) [0, 1] did not join the cluster within --start-timeout 1s; worker(s) [1] never reached "
            "tfdist.scope()/init()") in result.stdout
    assert time.monotonic() - started < 20
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_interrupt_stops_every_worker(tmp_path):
    command = [sys.executable, "-m", "tfdist.run", "-n", "2", "--grace-period", "1", "--",
               sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "sleep"]
    launcher = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(worker_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 130
    assert "interrupted; stopped all workers" in output
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_max_restarts_starts_every_worker_again(tmp_path):
    result = launch(tmp_path, "fail_first_attempt", "--max-restarts", "1")
    assert result.returncode == 0, result.stdout
    assert "worker 1 exited with code 5" in result.stdout and "restarting all workers (1/1)" in result.stdout
    assert sorted(p.name for p in tmp_path.glob("pid*")) == ["pid0.0", "pid0.1", "pid1.0", "pid1.1"]


@pytest.mark.parametrize("args, message", [
    (["-n", "0", "--", "python"], "-n must be at least 1: received -n 0"),
    (["-n", "2"], "no command to run: put it after --"),
    (["-n", "2", "--", "no-such-program-xyz"], "command 'no-such-program-xyz' was not found"),
    (["-n", "2", "--cpu-devices", "0", "--", "python"], "--cpu-devices must be at least 1: received 0"),
    (["-n", "2", "--timeout", "-1", "--", "python"], "--timeout must be positive seconds: received -1.0"),
    (["-n", "2", "--max-restarts", "-1", "--", "python"], "--max-restarts must be 0 or more: received -1"),
    (["-n", "2", "--start-timeout", "0", "--", "python"], "--start-timeout must be positive seconds: received 0.0"),
    (["-n", "2", "--port", "80", "--", "python"], "--port must leave room for 2 ports in 1024..65535: received 80"),
])
def test_bad_launcher_arguments_fail_fast(args, message):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tfdist.run", *args], env=job_env(),
                            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 2
    assert message in result.stderr
    assert time.monotonic() - started < 10


def test_cli_dispatches_and_rejects_unknown_commands():
    ok = subprocess.run([sys.executable, "-m", "tfdist.cli", "run", "--help"], env=job_env(),
                        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert ok.returncode == 0 and "tfdist run" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "tfdist.cli", "fly"], env=job_env(),
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert bad.returncode == 2 and "unknown command 'fly'" in bad.stderr


def test_launcher_never_imports_tensorflow():
    code = "import sys, tfdist, tfdist.run, tfdist.cli; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT)
    assert result.stdout.strip() == "False", result.stderr
