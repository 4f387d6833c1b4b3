"""`tfdist doctor`: reports, and exits non-zero on problems."""

import socket
import subprocess
import sys

from tfdist.cluster import make_tf_config
from tfdist.doctor import diagnose
from tests.jobs import job_env


def test_doctor_runs_with_no_gpu_and_no_cluster(no_gpu_here):
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


def test_a_one_machine_job_reachable_from_other_addresses_is_a_warning():
    from tfdist.doctor import Report, check_exposure

    with socket.socket() as everywhere, socket.socket() as loopback_only:
        everywhere.bind(("0.0.0.0", 0))  # as TensorFlow's worker server binds
        loopback_only.bind(("127.0.0.1", 0))
        for sock in (everywhere, loopback_only):
            sock.listen()
        exposed, private = everywhere.getsockname()[1], loopback_only.getsockname()[1]
        one_machine = [f"127.0.0.1:{exposed}", f"127.0.0.1:{private}"]
        report = Report()
        check_exposure(report, one_machine, 1, addresses=["127.0.0.2"])  # any other address of this machine
        several = Report()
        check_exposure(several, ["10.0.0.1:1", f"127.0.0.1:{exposed}"], 1, addresses=["127.0.0.2"])
    assert report.warnings == [
        f"worker port(s) {exposed} on 127.0.0.2 answer on a non-loopback address, in a one-machine job: TensorFlow's "
        "worker gRPC listens on every interface, with no authentication, so anyone who can reach this machine can "
        "connect to the job. Block those ports in the firewall, or keep the machine on a network you trust "
        "(README: Running on several machines)."]
    assert not report.problems and not several.warnings  # a job across machines needs its ports reachable
