"""Elastic and larger multi-node jobs on separate network hosts: namespaces on one bridge (tests/netns.py).

A host's death is ``Host.kill_all``: every process on it SIGKILLed at once. No --node-rank
anywhere: the launcher on the --master address serves it, the master numbers the others.
The 16-worker job runs only with TFDIST_SCALE_TESTS=1 (minutes on 2 cores; see benchmarks/RESULTS.md);
the 8-worker one always.
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
from tests.jobs import WORKERS
from tests.nodes_jobs import finish, node_command, start_node, wait_for
from tests.workers import common
from tfdist import sharding

MASTER_PORT = 29400
EPOCHS = 10


@pytest.fixture(scope="module")
def hosts():
    with netns.bridged_or_skip(4) as made:
        yield made


def epochs(out_dir):
    """(epoch, workers) of every epoch worker 0 finished, in order."""
    path = out_dir / "epochs"
    return [tuple(map(int, line.split())) for line in path.read_text().split("\n") if line] if path.exists() else []


def run_of(out_dir, workers):
    """Epochs finished with ``workers`` workers since the last change of size."""
    done = epochs(out_dir)
    count = 0
    for _, size in reversed(done):
        if size != workers:
            break
        count += 1
    return count


def single_device_weights(num_epochs, optimizer="sgd"):
    import keras
    import tensorflow as tf

    model = common.equivalence_model()
    if optimizer == "adam":
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")  # as elastic_fit_job.py's
    x, y = common.regression_data(48)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(12), epochs=num_epochs, verbose=0)
    return model.get_weights()


def test_fit_goes_from_2_to_3_nodes_and_back_to_2_with_every_epoch_once(hosts, tmp_path):
    """--nnodes 2:3: a third host joins after 2 epochs, the second host dies 2 epochs later."""
    master = f"{hosts[0].address}:{MASTER_PORT}"
    worker = [sys.executable, str(WORKERS / "elastic_fit_job.py"), str(tmp_path), str(EPOCHS)]
    command = node_command(None, "2:3", master, worker, "--rdzv-wait", "0", timeout=400)
    nodes = [start_node(hosts[i].command(command)) for i in (0, 1)]
    try:
        wait_for(lambda: run_of(tmp_path, 2) >= 2, "2 epochs on 2 workers", timeout=240)
        nodes.append(start_node(hosts[2].command(command)))
        wait_for(lambda: run_of(tmp_path, 3) >= 2, "2 epochs on 3 workers", timeout=240)
        hosts[1].kill_all()
    finally:
        results = finish(nodes, timeout=400)
    assert [results[0].returncode, results[2].returncode] == [0, 0], [r.output[-4000:] for r in results]
    done = epochs(tmp_path)
    assert [e for e, _ in done] == list(range(EPOCHS)), done
    sizes = [s for _, s in done]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [2, 3, 2], done
    survivors = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in (0, 1)]
    assert all(w["workers"] == 2 and w["attempt"] == 2 for w in survivors)
    for first, second in zip(*(w["weights"] for w in survivors)):
        np.testing.assert_array_equal(first, second)
    for got, want in zip(survivors[0]["weights"], single_device_weights(EPOCHS)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    master_output = results[0].output
    assert "joined; restarting every node's workers with 3 nodes" in master_output
    assert "left; restarting every node's workers with 2 nodes" in master_output
    assert "all workers finished on 2 nodes" in master_output and "restart(s)" not in master_output
    assert all(not host.pids() for host in hosts)


def test_sharded_adam_state_backed_up_by_2_workers_is_restored_by_3_exactly(hosts, tmp_path):
    """--nnodes 2:3, an unchanged script with TFDIST_SHARD_OPTIMIZER_STATE=1 and Adam: Keras' BackupAndRestore
    of 2 sharded workers (each slot gathered whole) is restored by 3 (each keeping its third of every slot)."""
    total = 8
    master = f"{hosts[0].address}:{MASTER_PORT}"
    worker = [sys.executable, str(WORKERS / "elastic_fit_job.py"), str(tmp_path), str(total), "adam"]
    command = node_command(None, "2:3", master, worker, "--rdzv-wait", "0", timeout=400)
    env = {sharding.ENV: "1"}
    nodes = [start_node(hosts[i].command(command), env) for i in (0, 1)]
    try:
        wait_for(lambda: run_of(tmp_path, 2) >= 2, "2 epochs on 2 workers", timeout=240)
        nodes.append(start_node(hosts[2].command(command), env))
        wait_for(lambda: run_of(tmp_path, 3) >= 1, "an epoch on 3 workers", timeout=240)
    finally:
        results = finish(nodes, timeout=400)
    assert [r.returncode for r in results] == [0, 0, 0], [r.output[-4000:] for r in results]
    done = epochs(tmp_path)
    assert [e for e, _ in done] == list(range(total)), done
    sizes = [s for _, s in done]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [2, 3], done
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in range(3)]
    assert all(w["workers"] == 3 and w["attempt"] == 1 and w["sharded"] for w in workers), workers
    for other in workers[1:]:
        for first, second in zip(workers[0]["weights"], other["weights"]):
            np.testing.assert_array_equal(first, second)
    for got, want in zip(workers[0]["weights"], single_device_weights(total, "adam")):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(not host.pids() for host in hosts)


@pytest.mark.parametrize("per_host", [
    2, pytest.param(4, marks=pytest.mark.skipif(os.environ.get("TFDIST_SCALE_TESTS") != "1",
                                                reason="a benchmark: TFDIST_SCALE_TESTS=1 runs it"))])
def test_8_and_16_workers_on_4_hosts_train_bit_equal(hosts, tmp_path, per_host):
    count = 4 * per_host
    master = f"{hosts[0].address}:{MASTER_PORT}"
    worker = [sys.executable, str(WORKERS / "slurm_job.py"), str(tmp_path)]
    command = node_command(None, 4, master, worker, "--start-timeout", "600", num_workers=per_host, timeout=900)
    started = time.monotonic()
    nodes = [start_node(host.command(command)) for host in hosts]
    results = finish(nodes, timeout=960)
    print(f"{count} workers on 4 hosts: {time.monotonic() - started:.1f}s from the first launcher to the last exit")
    assert [r.returncode for r in results] == [0] * 4, [r.output[-3000:] for r in results]
    workers = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in range(count)]
    assert all(w["replicas"] == count for w in workers)
    placed = [a.rsplit(":", 1)[0] for a in workers[0]["addresses"]]  # node 0 first, the others as they arrived
    assert placed[:per_host] == [hosts[0].address] * per_host
    assert all(len(set(placed[i:i + per_host])) == 1 for i in range(0, count, per_host))
    assert sorted(set(placed)) == sorted(h.address for h in hosts)
    for other in workers[1:]:
        for first, second in zip(workers[0]["weights"], other["weights"]):
            np.testing.assert_array_equal(first, second)
    for got, want in zip(workers[0]["weights"], common.train_equivalence()):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_host_that_goes_silent_stops_a_fixed_size_job_within_60_s(hosts, tmp_path):
    """--nnodes 2: the second host's link goes down mid-training (no FIN, no reset: a machine gone); the job
    stops within 60 s naming it; nothing is left on the first host."""
    master = f"{hosts[0].address}:{MASTER_PORT}"
    worker = [sys.executable, str(WORKERS / "elastic_fit_job.py"), str(tmp_path), "1000"]
    command = node_command(None, 2, master, worker, timeout=400)
    nodes = [start_node(hosts[i].command(command)) for i in (0, 1)]
    link = ["ip", "-n", hosts[1].namespace, "link", "set", "dev", hosts[1].device]
    try:
        wait_for(lambda: run_of(tmp_path, 2) >= 1, "an epoch on 2 workers", timeout=240)
        subprocess.run([*link, "down"], check=True, timeout=netns.IP_TIMEOUT)
        silent_at = time.monotonic()
        output = nodes[0].communicate(timeout=120)[0]
        stopped_after = time.monotonic() - silent_at
    finally:
        hosts[1].kill_all()
        for node in nodes:
            node.kill()
            node.wait()
        subprocess.run([*link, "up"], check=True, timeout=netns.IP_TIMEOUT)
    assert nodes[0].returncode not in (0, None), output[-3000:]
    # whichever notices first names the gone host: the master (node 1's launcher silent for SILENCE_SECONDS),
    # or TensorFlow's coordination service in worker 0's error (worker 1's heartbeats stopped)
    named = "lost node 1's launcher" in output or re.search(r"task:1: The following tasks are unhealthy", output)
    assert named and "stopped all workers on 2 nodes" in output, output[-3000:]
    assert stopped_after < 60, f"the job stopped {stopped_after:.0f}s after the host went silent"
    assert not hosts[0].pids() and not hosts[1].pids()
