"""`tfdist doctor`: reports, and exits non-zero on problems."""

import socket
import subprocess
import sys

from tfdist.cluster import make_tf_config
from tfdist.doctor import diagnose
from tests.jobs import job_env


def test_doctor_runs_with_no_gpu_and_no_cluster():
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], env=job_env({"TF_CONFIG": ""}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("tensorflow   2.", "no GPU found", "nccl", "single worker", "No problems found.",
                     '"auto" picks float32: no GPU with tensor cores'):
        assert expected in result.stdout


def test_invalid_tf_config_is_a_problem_with_the_fix():
    result = subprocess.run([sys.executable, "-m", "tfdist.cli", "doctor"], env=job_env({"TF_CONFIG": "{oops"}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "PROBLEM: TF_CONFIG is not valid JSON" in result.stdout and "A valid TF_CONFIG looks like" in result.stdout


def test_peers_are_probed():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        addresses = ["127.0.0.1:1", f"127.0.0.1:{listening.getsockname()[1]}",
                     f"127.0.0.1:{closed.getsockname()[1]}", "no-such-host.invalid:2222"]
        report = diagnose({"TF_CONFIG": make_tf_config(addresses, 0)}, port_timeout=1, with_tensorflow=False)
    text = "\n".join(report.lines)
    assert "4 workers from tf_config; this is worker 0" in text
    assert f"worker 1     {addresses[1]} answers" in text
    assert "worker 2     " + addresses[2] + ": host reachable, nothing listening yet" in text
    assert report.problems == ["cannot resolve 'no-such-host.invalid:2222': check the host name in TF_CONFIG/the node list"]
