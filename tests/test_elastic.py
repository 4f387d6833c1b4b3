"""Elastic multi-node jobs (`tfdist run --nnodes MIN:MAX`) on this machine: launchers on 127.0.0.1, toy workers.

A node's death is its launcher's SIGKILL (its workers die with it: launch/lifeline.py).
tests/test_elastic_netns.py runs TensorFlow workers on separate network hosts.
"""

import json
import os
import signal
import sys
import time

import numpy as np

from tests.jobs import WORKERS
from tests.nodes_jobs import finish, node_command, start_node, wait_for
from tests.test_nodes import master_address

STEPS = 50


def elastic(tmp_path, spec, master, *args):
    worker = [sys.executable, str(WORKERS / "elastic_toy.py"), str(tmp_path), str(STEPS)]
    return node_command(None, spec, master, worker, *args, timeout=240)


def steps(tmp_path):
    """(step, world size) of every step worker 0 finished."""
    path = tmp_path / "steps"
    return [tuple(map(int, line.split())) for line in path.read_text().split("\n") if line] if path.exists() else []


def rounds(tmp_path):
    return [json.loads(line) for line in (tmp_path / "rounds").read_text().split("\n") if line]


def sizes(tmp_path):
    """The world sizes in the order they trained, each run of steps once: [2, 3, 2]."""
    seen = [size for _, size in steps(tmp_path)]
    return [size for i, size in enumerate(seen) if i == 0 or seen[i - 1] != size]


def trained_with(tmp_path, size, more):
    """``more`` steps done with ``size`` workers since the last change."""
    seen = sizes(tmp_path)
    return bool(seen) and seen[-1] == size and sum(1 for _ in reversed(steps(tmp_path)) if _[1] == size) >= more


def nothing_left(tmp_path):
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    return all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
               for pid in pids)


def assert_every_step_once(tmp_path):
    assert [step for step, _ in steps(tmp_path)] == list(range(1, STEPS + 1))


def test_a_node_joins_a_running_job_and_a_dying_one_leaves_it(tmp_path):
    """--nnodes 2:3: 2 nodes, a third joins (3 workers), node 1 dies (2 workers: node 2 becomes node 1)."""
    master = master_address()
    command = elastic(tmp_path, "2:3", master, "--rdzv-wait", "0")
    nodes = [start_node(command), start_node(command)]
    try:
        wait_for(lambda: trained_with(tmp_path, 2, 5), "5 steps on 2 nodes")
        nodes.append(start_node(command))
        wait_for(lambda: trained_with(tmp_path, 3, 5), "5 steps on 3 nodes")
        second = next(r for r in rounds(tmp_path) if r["attempt"] == 1 and r["node"] == 1)
        victim = next(n for n in nodes if n.pid == second["launcher"])
        victim.send_signal(signal.SIGKILL)
    finally:
        results = finish(nodes, timeout=200)
    survivors = [r for n, r in zip(nodes, results) if n is not victim]
    assert [r.returncode for r in survivors] == [0, 0], [r.output[-3000:] for r in results]
    assert sizes(tmp_path) == [2, 3, 2]
    assert_every_step_once(tmp_path)
    by_attempt = {}
    for r in rounds(tmp_path):
        by_attempt.setdefault(r["attempt"], []).append(r)
    assert {a: len(rs) for a, rs in by_attempt.items()} == {0: 2, 1: 3, 2: 2}
    # rank 0 (always on node 0) keeps one job directory across rounds: hvd.elastic's commits live there
    assert len({r["job_dir"] for r in rounds(tmp_path) if r["rank"] == 0}) == 1
    for attempt, rs in by_attempt.items():
        assert sorted(r["rank"] for r in rs) == list(range(len(rs))) == sorted(r["node"] for r in rs)
        assert all(r["size"] == r["workers"] == r["nodes"] == len(rs) for r in rs)
    [master_output] = [r.output for r in survivors if "tfdist run [master]" in r.output]
    assert "tfdist run [master]: 2 nodes arrived (--nnodes 2:3); starting 2 workers" in master_output
    assert "joined; restarting every node's workers with 3 nodes" in master_output
    assert "lost its launcher" in master_output and "left; restarting every node's workers with 2 nodes" in master_output
    for result in survivors:
        assert "all workers finished on 2 nodes\n" in result.output or "all workers finished on 2 nodes (" in result.output
    assert nothing_left(tmp_path)


def test_without_node_rank_the_node_on_the_master_address_is_node_0(tmp_path):
    """--nnodes 2 with no --node-rank on either node: the one that can listen on --master serves it."""
    master = master_address()
    worker = [sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), "echo"]
    results = finish([start_node(node_command(None, 2, master, worker)) for _ in range(2)], timeout=120)
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    [served] = [r.output for r in results if "tfdist run [master]: all 2 nodes arrived; starting 2 workers" in r.output]
    assert "tfdist run [node 0/2]: all workers finished on 2 nodes" in served
    [joined] = [r.output for r in results if r.output != served]
    assert "tfdist run [node 1/2]: all workers finished on 2 nodes" in joined
    configs = [json.loads(json.loads((tmp_path / f"worker{rank}.json").read_text())["TF_CONFIG"]) for rank in (0, 1)]
    assert [c["task"]["index"] for c in configs] == [0, 1]


def test_a_node_killed_and_started_again_rejoins_a_2_of_2_job(tmp_path):
    """--nnodes 2:2: a node dies (a pod the scheduler recreates); its replacement rejoins and the job finishes."""
    master = master_address()
    command = elastic(tmp_path, "2:2", master)
    nodes = [start_node(command), start_node(command)]
    try:
        wait_for(lambda: trained_with(tmp_path, 2, 5), "5 steps on 2 nodes")
        victim = next(n for n in nodes if n.pid == next(r for r in rounds(tmp_path) if r["node"] == 1)["launcher"])
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        nodes.append(start_node(command))
    finally:
        results = finish(nodes, timeout=200)
    survivors = [r for n, r in zip(nodes, results) if n is not victim]
    assert [r.returncode for r in survivors] == [0, 0], [r.output[-3000:] for r in results]
    assert_every_step_once(tmp_path)
    assert sorted((r["attempt"], r["rank"]) for r in rounds(tmp_path)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    [master_output] = [r.output for r in survivors if "tfdist run [master]" in r.output]
    # the master waits for a replacement ("fewer than --nnodes 2:2 allows") unless it arrived before the survivors stopped
    assert "lost its launcher" in master_output and "1 node(s) left (--nnodes 2:2)" in master_output
    assert "starting 2 workers on 2 nodes" in master_output and "all workers finished on 2 nodes" in master_output
    assert nothing_left(tmp_path)


def test_fewer_than_min_nodes_left_stop_the_job_with_a_clear_error(tmp_path):
    """--nnodes 2:3: node 1's launcher is stopped (SIGTERM, as Kubernetes deletes a pod) and no node replaces it."""
    master = master_address()
    command = elastic(tmp_path, "2:3", master, "--rdzv-wait", "0", "--start-timeout", "3")
    nodes = [start_node(command), start_node(command)]
    try:
        wait_for(lambda: trained_with(tmp_path, 2, 3), "3 steps on 2 nodes")
        leaving = next(n for n in nodes if n.pid == next(r for r in rounds(tmp_path) if r["node"] == 1)["launcher"])
        leaving.send_signal(signal.SIGTERM)
    finally:
        results = finish(nodes, timeout=120)
    [stayed] = [r for n, r in zip(nodes, results) if n is not leaving]
    [left] = [r for n, r in zip(nodes, results) if n is leaving]
    # its workers saved at the agreed step and exited 85 (tfdist.preemption), so its launcher exits 85
    assert left.returncode == 85 and "received SIGTERM: every worker saved at the step" in left.output, left.output
    assert stayed.returncode == 124, stayed.output
    assert "left; restarting every node's workers with 1 node\n" in stayed.output
    assert ("only 1 node(s) within --start-timeout 3s, fewer than --nnodes 2:3 needs; stopped all workers (start "
            "more nodes with the same --master and token, or lower MIN)") in stayed.output
    assert nothing_left(tmp_path)


def test_hvd_elastic_resumes_from_its_last_commit_when_a_node_joins(tmp_path):
    """--nnodes 1:2 with hvd.elastic.run: a second node joins; the commit on node 0 carries the state over."""
    master = master_address()
    worker = [sys.executable, str(WORKERS / "hvd_elastic_job.py"), str(tmp_path), "30"]
    command = node_command(None, "1:2", master, worker, "--rdzv-wait", "0", "--horovod", timeout=300)
    nodes = [start_node(command)]
    try:
        wait_for(lambda: len(steps(tmp_path)) >= 3, "3 steps on 1 node", timeout=180)
        nodes.append(start_node(command))
    finally:
        results = finish(nodes, timeout=280)
    assert [r.returncode for r in results] == [0, 0], [r.output[-3000:] for r in results]
    done = [tuple(map(float, line.split())) for line in (tmp_path / "steps").read_text().split("\n") if line]
    assert [int(step) for step, _, _ in done] == list(range(1, 31))
    assert [int(size) for _, size, _ in done] == sorted(int(size) for _, size, _ in done) and done[-1][1] == 2
    assert [value for _, _, value in done] == list(np.cumsum([size for _, size, _ in done]))  # nothing lost or redone
    [reset] = (tmp_path / "resets").read_text().split("\n")[:-1]
    assert reset == f"{sum(1 for _, size, _ in done if size == 1)} 2"  # at the last commit, with the new size


def test_a_replacement_that_comes_before_the_dead_node_is_noticed_waits_then_joins(tmp_path):
    """--nnodes 2:2: node 1's host freezes (SIGSTOP: no FIN, no pings); its replacement waits for the master to
    notice the silence (30 s), then joins, and the job finishes."""
    master = master_address()
    command = elastic(tmp_path, "2:2", master)
    nodes = [start_node(command), start_node(command)]
    frozen = []
    try:
        wait_for(lambda: trained_with(tmp_path, 2, 3), "3 steps on 2 nodes")
        first_round = rounds(tmp_path)
        victim = next(n for n in nodes if n.pid == next(r for r in first_round if r["node"] == 1)["launcher"])
        worker = next(int(p) for p in (tmp_path / "pids").read_text().split() if _parent(int(p)) == victim.pid)
        frozen = [victim.pid, worker]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        nodes.append(start_node(command))
        wait_for(lambda: len({r["attempt"] for r in rounds(tmp_path)}) == 2, "the second round", timeout=120)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
        results = finish(nodes, timeout=200)
    survivors = [r for n, r in zip(nodes, results) if n is not victim]
    assert [r.returncode for r in survivors] == [0, 0], [r.output[-3000:] for r in results]
    assert "the job runs on its most nodes, 2 (--nnodes 2:2): waiting for one to leave" in survivors[1].output
    [master_output] = [r.output for r in survivors if "tfdist run [master]" in r.output]
    assert "waits: the job runs on its most nodes, 2 (--nnodes 2:2); it joins when one leaves" in master_output
    assert "lost its launcher (timed out waiting for the other side)" in master_output
    assert_every_step_once(tmp_path)
    assert nothing_left(tmp_path)


def test_a_waiting_node_is_read_while_it_waits_and_noticed_when_it_dies(tmp_path):
    """--nnodes 2:2 on 2 nodes, and two more that wait for a place. The master reads the waiting nodes' connections
    (no ping of theirs is left unread), says when one of them is killed, and takes the other in after it waited
    longer than SILENCE_SECONDS (30 s), when node 1 leaves: its worker runs and the job finishes."""
    master = master_address()
    # Enough steps that the job cannot finish before node 1 leaves: about 3 + 37.5 s / 0.2 s = 190 steps are done
    # by then at most (a step is a 0.2 s sleep: a loaded machine makes it longer, never shorter); 60 to spare.
    total = 250
    worker = [sys.executable, str(WORKERS / "elastic_toy.py"), str(tmp_path), str(total)]
    command = node_command(None, "2:2", master, worker, timeout=240)
    nodes = [start_node(command), start_node(command)]
    try:
        wait_for(lambda: trained_with(tmp_path, 2, 3), "3 steps on 2 nodes")
        waiting, doomed = start_node(command), start_node(command)
        nodes += [waiting, doomed]
        began = time.monotonic()
        time.sleep(5)  # both have arrived and wait
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        time.sleep(max(0.0, began + 35 - time.monotonic()))
        unread = _unread_at(int(master.rsplit(":", 1)[1]))
        leaving = next(n for n in nodes if n.pid == next(r for r in rounds(tmp_path) if r["node"] == 1)["launcher"])
        assert len(steps(tmp_path)) < total - 20, "the job is nearly done before node 1 leaves: raise the steps"
        leaving.send_signal(signal.SIGTERM)
        wait_for(lambda: any(r["launcher"] == waiting.pid for r in rounds(tmp_path)), "the waiting node's worker")
    finally:
        results = finish(nodes, timeout=200)
    outputs = {n.pid: r for n, r in zip(nodes, results)}
    assert unread == 0  # the waiting node's pings were read (before: about 52 bytes more every 2 s)
    assert [outputs[n.pid].returncode for n in nodes if n not in (leaving, doomed)] == [0, 0], \
        [r.output[-3000:] for r in results]
    [master_output] = [r.output for r in results if "tfdist run [master]" in r.output]
    assert master_output.count("waits: the job runs on its most nodes, 2 (--nnodes 2:2); it joins when one leaves") == 2
    assert "a node at 127.0.0.1 that waited to join is gone (connection closed by the other side)" in master_output
    assert "the job runs on its most nodes, 2 (--nnodes 2:2): waiting for one to leave" in outputs[waiting.pid].output
    assert "all workers finished on 2 nodes" in outputs[waiting.pid].output
    assert not any("signature check" in r.output for r in results)
    assert [step for step, _ in steps(tmp_path)] == list(range(1, total + 1))
    assert nothing_left(tmp_path)


def _unread_at(port):
    """The fewest bytes left unread, over 2 s, in the master's established connections (its side: local ``port``)."""
    least = None
    for _ in range(10):
        unread = 0
        with open("/proc/net/tcp") as table:
            for line in list(table)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    unread = max(unread, int(fields[4].split(":")[1], 16))
        least = unread if least is None else min(least, unread)
        time.sleep(0.2)
    return least


def _parent(pid):
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
