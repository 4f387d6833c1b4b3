"""Multi-node jobs on separate network hosts: two network namespaces (10.77.0.1, 10.77.0.2) on a veth link.

Each namespace is a host with its own loopback, so workers on different nodes can only
talk across the veth pair. Skipped, with the reason, where namespaces cannot be made.
Also SLURM: examples/slurm/*.sbatch run as they are, with a stand-in srun (tests/slurm/)
giving each task SLURM's variables on its "node", node names resolved by each host's
own hosts file.
"""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import netns
from tests.jobs import REPO, WORKERS, job_env
from tests.nodes_jobs import node_command, run_nodes
from tests.test_faults import uninterrupted_weights
from tests.workers import common
from tfdist.cluster import expand_slurm_nodelist

MASTER_PORT = 29400
NODE_NAMES = ("node01", "node02")


@pytest.fixture(scope="module")
def hosts():
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"network namespaces are not available on this machine: {reason}")
    with netns.hosts(names=NODE_NAMES) as made:
        yield made


def run_on_hosts(hosts, worker, *launcher_args, timeout=150, env=None):
    master = f"{hosts[0].address}:{MASTER_PORT}"
    commands = [host.command(node_command(rank, 2, master, worker, *launcher_args, timeout=timeout))
                for rank, host in enumerate(hosts)]
    before = sum(host.veth_bytes() for host in hosts)
    results = run_nodes(commands, env=env, timeout=timeout + 30)
    return results, sum(host.veth_bytes() for host in hosts) - before


def nothing_left_running(hosts):
    return all(not subprocess.run(["ip", "netns", "pids", h.namespace], capture_output=True, text=True).stdout.split()
               for h in hosts)


def fault_job(out_dir):
    return [sys.executable, str(WORKERS / "fault_job.py"), str(out_dir)]


@pytest.fixture(scope="module")
def launcher_bytes(hosts, tmp_path_factory):
    """What the launchers alone send over the veth link for a job of toy workers (the baseline)."""
    out_dir = tmp_path_factory.mktemp("toy")
    results, traffic = run_on_hosts(hosts, [sys.executable, str(WORKERS / "toy_worker.py"), str(out_dir), "echo"])
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    return traffic


def test_restart_across_hosts_resumes_from_the_shared_backup(hosts, launcher_bytes, tmp_path):
    results, traffic = run_on_hosts(hosts, fault_job(tmp_path), "--max-restarts", "1")
    assert [r.returncode for r in results] == [0, 0], [r.output[-3000:] for r in results]
    for result in results:
        assert "worker 1 on node 1 was killed by SIGKILL" in result.output
        assert "restarting all workers on 2 nodes (1/1)" in result.output
    workers = [common_result(tmp_path, rank) for rank in (0, 1)]
    for rank, (worker, host) in enumerate(zip(workers, hosts)):
        cluster = json.loads(worker["tf_config"])["cluster"]["worker"]
        assert [a.rsplit(":", 1)[0] for a in cluster] == [hosts[0].address, hosts[1].address]
        # the rest of epoch 1 from the batch after the backup, then 2 and 3
        assert worker["attempt"] == 1 and worker["steps"] == [[1, 2], [1, 3]] + [[e, b] for e in (2, 3) for b in range(4)]
        assert worker["loss"][-1] < worker["loss"][0]
    for first, second in zip(workers[0]["weights"], workers[1]["weights"]):
        np.testing.assert_array_equal(first, second)
    for got, want in zip(workers[0]["weights"], uninterrupted_weights(epochs=4)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The workers' only way to each other is the veth link: it carried their collectives.
    assert traffic > 3 * launcher_bytes, (traffic, launcher_bytes)


def common_result(out_dir, rank):
    return json.loads((out_dir / f"worker{rank}.json").read_text())


def test_sigkill_on_node_1_stops_node_0_naming_node_1(hosts, tmp_path):
    results, _ = run_on_hosts(hosts, fault_job(tmp_path))
    stopped_at = time.time()
    assert [r.returncode for r in results] == [137, 137], [r.output[-3000:] for r in results]
    assert "tfdist run [node 0/2]: worker 1 on node 1 was killed by SIGKILL; stopped all workers on 2 nodes" \
        in results[0].output
    assert stopped_at - float((tmp_path / "killed_at").read_text()) < 30
    assert not list(tmp_path.glob("worker*.json")) and nothing_left_running(hosts)


# SLURM ---------------------------------------------------------------------------------

def sbatch(hosts, script, *args, timeout=150):
    """Runs an sbatch script on the first node with the variables sbatch sets (from its #SBATCH lines)."""
    text = (REPO / "examples" / "slurm" / script).read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    nodelist = "node[01-02]"
    nodes, per_node = int(directives["nodes"]), int(directives["ntasks-per-node"])
    assert len(expand_slurm_nodelist(nodelist)) == nodes
    env = job_env({
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_SUBMIT_DIR": str(REPO),
        "FAKE_SLURM_NETNS": ",".join(f"{name}={h.namespace}" for name, h in zip(NODE_NAMES, hosts)),
        "PATH": os.pathsep.join([str(REPO / "tests" / "slurm"), os.path.dirname(sys.executable),
                                 os.environ["PATH"]])})
    env.pop("TFDIST_TOKEN", None)
    return subprocess.run(hosts[0].command(["bash", str(REPO / "examples" / "slurm" / script), *args]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_srun_sbatch_trains_on_2_nodes_x_2_tasks_from_slurms_variables(hosts, tmp_path):
    result = sbatch(hosts, "srun.sbatch", "tests/workers/slurm_job.py", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = [common_result(tmp_path, rank) for rank in range(4)]
    assert [w["rank"] for w in workers] == [0, 1, 2, 3] and all(w["source"] == "slurm" for w in workers)
    assert workers[0]["addresses"] == ["node01:23456", "node01:23457", "node02:23456", "node02:23457"]
    assert [(w["local_rank"], w["local_size"]) for w in workers] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert workers[3]["resolved"] == {"node01": hosts[0].address, "node02": hosts[1].address}
    assert all(w["replicas"] == 4 for w in workers)
    reference = common.train_equivalence()
    for worker in workers:
        for got, want in zip(worker["weights"], reference):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_nnodes_sbatch_starts_one_launcher_per_node(hosts, tmp_path):
    result = sbatch(hosts, "nnodes.sbatch", "tests/workers/toy_worker.py", str(tmp_path), "echo")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tfdist run [master]: all 2 nodes arrived; starting 4 workers" in result.stdout
    assert result.stdout.count("all workers finished on 2 nodes") == 2
    configs = [json.loads(common_result(tmp_path, rank)["TF_CONFIG"]) for rank in range(4)]
    hosts_of = [a.rsplit(":", 1)[0] for a in configs[0]["cluster"]["worker"]]
    assert hosts_of == [hosts[0].address] * 2 + [hosts[1].address] * 2


def test_the_timeline_of_two_nodes_aligns_their_clocks_within_the_bound_it_states(hosts, tmp_path):
    trace_path = tmp_path / "trace.json"
    worker = [sys.executable, str(WORKERS / "straggler_job.py"), str(tmp_path), "balanced"]
    results, _ = run_on_hosts(hosts, worker, "--timeline", str(trace_path))
    assert [r.returncode for r in results] == [0, 0], [r.output[-3000:] for r in results]
    trace = json.loads(trace_path.read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    bound, offsets = trace["otherData"]["clock_bound_ms"], trace["otherData"]["clock_offsets_ms"]
    assert 0 < bound < 20 and offsets["0"] == 0
    assert abs(offsets["1"]) <= bound  # one kernel's clock: the true offset is 0
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("step ")]
    assert len(steps) == 2 * 24


def test_namespaces_links_and_their_processes_are_removed_even_after_a_failure(hosts):
    """(Uses the module's hosts only to know namespaces work; makes a second pair of its own.)"""
    with pytest.raises(RuntimeError, match="the test failed"):
        with netns.hosts() as (first, _):
            sleeper = subprocess.Popen(first.command(["sleep", "60"]))
            made = [first.namespace, first.device]
            deadline = time.monotonic() + 10
            while str(sleeper.pid) not in subprocess.run(["ip", "netns", "pids", first.namespace], capture_output=True,
                                                         text=True).stdout.split() and time.monotonic() < deadline:
                time.sleep(0.05)  # until it runs inside the namespace
            raise RuntimeError("the test failed")
    try:
        assert sleeper.wait(timeout=10) == -9
    finally:
        sleeper.kill()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert made[0] not in listed and made[1] not in links and not os.path.exists(f"/etc/netns/{made[0]}")


def test_doctor_finds_this_hosts_addresses_and_warns_of_an_exposed_one_machine_job(hosts):
    code = ("import socket, tfdist.doctor as d, tfdist.cluster as c\n"
            "s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen()\n"
            "a = [f'127.0.0.1:{s.getsockname()[1]}', '127.0.0.1:1']\n"
            "r = d.diagnose({'TF_CONFIG': c.make_tf_config(a, 0)}, port_timeout=1, with_tensorflow=False)\n"
            "print(d.local_addresses()); print(r.warnings)")
    result = subprocess.run(hosts[0].command([sys.executable, "-c", code]), env=job_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found, warnings = result.stdout.splitlines()
    assert found == f"['{hosts[0].address}']"
    assert f"on {hosts[0].address} answer on a non-loopback address, in a one-machine job" in warnings
