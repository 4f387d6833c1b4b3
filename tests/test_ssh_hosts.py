"""``tfdist run -H``: two hosts (network namespaces on a veth link), the second reached through a real sshd.

The test starts its own ``sshd`` inside the second namespace, with its own config, host key
and a user key it makes with ssh-keygen, all in a temporary directory; the client side gets
an ssh config file the test writes (its own known_hosts) through ``--ssh-config-file`` and
the key through ``--ssh-identity-file``. Nothing of the machine's own ssh setup is used.
Skipped, with the reason, without root, namespaces, or openssh-server.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import netns
from tests.jobs import REPO, WORKERS, job_env

SSH_PORT = 2222
TIMEOUT = 200
MPI_TIMEOUT = 90


def _unavailable():
    missing = [tool for tool in ("ssh", "ssh-keygen", "/usr/sbin/sshd") if shutil.which(tool) is None]
    if missing:
        return f"{missing} not installed (apt-get install openssh-server openssh-client)"
    return netns.unavailable()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    keys = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "user_key", "stranger_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True,
                       timeout=30)
    (keys / "authorized_keys").write_text((keys / "user_key.pub").read_text())
    os.chmod(keys, 0o700)
    with netns.hosts(prefix="t20n") as made:
        config = keys / "sshd_config"
        config.write_text(
            f"Port {SSH_PORT}\nListenAddress {made[1].address}\nHostKey {keys / 'host_key'}\n"
            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile {keys / 'sshd.pid'}\nStrictModes no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nLogLevel ERROR\n")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        sshd = subprocess.Popen(made[1].command(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        client = keys / "ssh_config"
        client.write_text(f"Host *\n  UserKnownHostsFile {keys / 'known_hosts'}\n  LogLevel ERROR\n")
        try:
            _wait_for_sshd(made, sshd)
            yield made, keys
        finally:
            sshd.send_signal(signal.SIGTERM)
            try:
                sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sshd.kill()
                sshd.wait()


def _wait_for_sshd(made, sshd):
    probe = f"import socket; socket.create_connection(('{made[1].address}', {SSH_PORT}), timeout=1)"
    for _ in range(50):
        if sshd.poll() is not None:
            raise RuntimeError(f"sshd exited: {sshd.stdout.read().decode()}")
        if subprocess.run(made[0].command([sys.executable, "-c", probe]), capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("sshd did not listen within 10 s")


def launch(hosts, out, *args, key="user_key", where=None, env=None, config="ssh_config"):
    made, keys = hosts
    where = where or ["-H", f"{made[0].address}:1,{made[1].address}:1"]
    command = made[0].command([
        sys.executable, "-m", "tfdist.run", *where, "--ssh-port", str(SSH_PORT),
        "--ssh-identity-file", str(keys / key), "--ssh-config-file", str(keys / config),
        "--timeout", str(TIMEOUT - 30), "--grace-period", "2", "--start-timeout", "60", *args, "--",
        sys.executable, str(WORKERS / "horovod_example_job.py"), str(out), str(REPO / "examples" / "multi_worker_fit.py"),
        str(out)])
    began = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=job_env(env), capture_output=True, text=True, timeout=TIMEOUT)
    result.seconds = time.monotonic() - began
    return result


def nothing_left_running(hosts, wait=10.0):
    """No process in either namespace but the test's sshd (ssh sessions get ``wait`` seconds to close)."""
    made, keys = hosts
    sshd = {(keys / "sshd.pid").read_text().strip()}
    end = time.monotonic() + wait
    while time.monotonic() < end and not _only(made, sshd):
        time.sleep(0.5)
    return _only(made, sshd)


def _only(made, sshd):
    for host in made:
        pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
        if set(pids) - set(sshd):
            return False
    return True


def test_a_host_known_only_to_the_ssh_config_is_reached_by_its_alias(hosts, tmp_path):
    """-H gpu1 where only --ssh-config-file knows gpu1's HostName (ssh -G): toy workers, no TensorFlow."""
    made, keys = hosts
    config = keys / "alias_config"
    config.write_text(f"Host gpu1\n  HostName {made[1].address}\n" + (keys / "ssh_config").read_text())
    command = made[0].command([
        sys.executable, "-m", "tfdist.run", "-H", f"{made[0].address}:1,gpu1:1", "--ssh-port", str(SSH_PORT),
        "--ssh-identity-file", str(keys / "user_key"), "--ssh-config-file", str(config), "--grace-period", "2",
        "--start-timeout", "60", "--", sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "echo"])
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "node 1 (gpu1, over ssh): 1 worker(s)" in output and "[1] hello from 1" in output
    assert "all workers finished on 2 nodes" in output
    assert nothing_left_running(hosts)


def test_worker_killed_on_the_ssh_host_stops_both_hosts_naming_it(hosts, tmp_path):
    result = launch(hosts, tmp_path, "-x", "HOROVOD_TEST_KILL", env={"HOROVOD_TEST_KILL": "1:0:1:2"})
    output = result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGKILL, output[-4000:]
    assert "worker 1 on node 1 was killed by SIGKILL; stopped all workers on 2 nodes" in output, output[-4000:]
    assert "[0] Epoch 3/3" not in output
    assert nothing_left_running(hosts)


def test_ssh_auth_refused_is_an_error_naming_the_host_and_the_fix(hosts, tmp_path):
    result = launch(hosts, tmp_path, key="stranger_key")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    made, _ = hosts
    assert f"could not start node 1 ({made[1].address}, over ssh) over ssh (ssh exited with 255: " in output, output[-3000:]
    assert "Permission denied" in output and "works without a password prompt" in output
    assert "[0] Epoch" not in output and result.seconds < 60
    assert nothing_left_running(hosts)


def test_unreachable_host_is_an_error_naming_it(hosts, tmp_path):
    made, _ = hosts
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{made[0].address} slots=1\n10.77.0.99 slots=1\n")
    result = launch(hosts, tmp_path, where=["--hostfile", str(hostfile)])
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "could not start node 1 (10.77.0.99, over ssh) over ssh (ssh exited with 255: " in output, output[-3000:]
    assert "the host is up and reachable" in output
    assert nothing_left_running(hosts)


def start_sleepers(hosts, out):
    """A -H job of toy workers that sleep; returns the launcher once both workers have started."""
    made, keys = hosts
    command = made[0].command([
        sys.executable, "-m", "tfdist.run", "-H", f"{made[0].address}:1,{made[1].address}:1", "--ssh-port",
        str(SSH_PORT), "--ssh-identity-file", str(keys / "user_key"), "--ssh-config-file", str(keys / "ssh_config"),
        "--timeout", "120", "--grace-period", "2", "--", sys.executable, str(WORKERS / "toy_worker.py"), str(out),
        "sleep"])
    launcher = subprocess.Popen(command, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    end = time.monotonic() + 60
    while not all((out / f"pid{rank}.0").exists() for rank in (0, 1)):
        assert launcher.poll() is None and time.monotonic() < end, launcher.stdout.read()
        time.sleep(0.2)
    return launcher


def finish(launcher, timeout=60):
    """The launcher's (exit code, output); kills it and fails the test if it runs past ``timeout``."""
    try:
        output, _ = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.kill()
        output, _ = launcher.communicate()
        raise AssertionError(f"the launcher did not stop within {timeout}s:\n{output[-3000:]}")
    return launcher.returncode, output


def test_ctrl_c_stops_every_hosts_workers(hosts, tmp_path):
    launcher = start_sleepers(hosts, tmp_path)
    launcher.send_signal(signal.SIGINT)
    code, output = finish(launcher)
    assert code == 130, output[-3000:]
    assert "[0] hello from 0" in output and "[1] hello from 1" in output  # the ssh host's output, prefixed
    assert "interrupted" in output
    assert nothing_left_running(hosts)


def test_a_dead_host_stops_the_other_hosts_workers_naming_it(hosts, tmp_path):
    made, keys = hosts
    launcher = start_sleepers(hosts, tmp_path)
    sshd = (keys / "sshd.pid").read_text().strip()
    for pid in subprocess.run(["ip", "netns", "pids", made[1].namespace], capture_output=True, text=True).stdout.split():
        if pid != sshd:  # the host "dies": its launcher, its workers, its ssh session
            os.kill(int(pid), signal.SIGKILL)
    code, output = finish(launcher)
    assert code != 0
    # Whichever the launcher notices first, the ssh client's exit or the master's lost connection, it names the host.
    lost = [line for line in output.splitlines() if "lost node 1" in line]
    assert lost and made[1].address in lost[0], output[-3000:]
    assert "stopped all workers" in output and "[hosts]: could not start" not in output
    assert nothing_left_running(hosts)


def test_a_changed_host_key_is_refused(hosts, tmp_path):
    made, keys = hosts
    stranger = (keys / "stranger_key.pub").read_text().split()
    (tmp_path / "known_hosts").write_text(f"[{made[1].address}]:{SSH_PORT} {stranger[0]} {stranger[1]}\n")
    (keys / "changed_config").write_text(f"Host *\n  UserKnownHostsFile {tmp_path / 'known_hosts'}\n")
    result = launch(hosts, tmp_path, config="changed_config")
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "[1]" not in output
    assert "Host key verification failed" in output and "its host key did not change" in output, output[-3000:]
    assert nothing_left_running(hosts)


def test_two_hosts_train_one_job_and_restart_both_after_a_worker_dies_on_the_ssh_host(hosts, tmp_path):
    """One job trains across both hosts; with --max-restarts, a worker killed on the ssh host restarts both."""
    result = launch(hosts, tmp_path, "--max-restarts", "1", "-x", "HOROVOD_TEST_KILL",
                    env={"HOROVOD_TEST_KILL": "1:0:1:2"})  # rank 1 (ssh host), first attempt only
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    made, _ = hosts
    assert f"node 1 ({made[1].address}, over ssh): 1 worker(s)" in output
    assert "worker 1 on node 1 was killed by SIGKILL" in output
    assert "restarting all workers on 2 nodes (1/1)" in output and "all workers finished on 2 nodes" in output
    assert "[0] Epoch 3/3" in output
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in (0, 1)]
    assert [w["attempt"] for w in workers] == [1, 1]
    assert workers[0]["final_weights"] == workers[1]["final_weights"]
    logs = workers[0]["fits"][-1]["epoch_logs"]
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert (tmp_path / "multi_worker_model.keras").exists()
    assert nothing_left_running(hosts)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")
def test_mpirun_across_the_two_hosts_builds_one_cluster(hosts, tmp_path):
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install mpi4py)")
    made, keys = hosts
    ssh = f"ssh -F {keys / 'ssh_config'} -i {keys / 'user_key'} -p {SSH_PORT} -o BatchMode=yes -o StrictHostKeyChecking=accept-new"
    subnet = f"{netns.SUBNET}.0/24"
    command = made[0].command([
        "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-H", f"{made[0].address}:1,{made[1].address}:1",
        "--mca", "plm_rsh_agent", ssh, "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet,
        "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "--wdir", str(REPO),
        sys.executable, str(WORKERS / "horovod_example_job.py"), str(tmp_path), str(REPO / "examples" / "multi_worker_fit.py"),
        str(tmp_path)])
    process = subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, output = finish(process, MPI_TIMEOUT)
    assert code == 0, output[-4000:]
    assert "worker 0 of 2: 2 replicas in sync" in output
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in (0, 1)]
    assert workers[0]["final_weights"] == workers[1]["final_weights"]
    assert nothing_left_running(hosts)
