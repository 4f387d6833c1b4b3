"""Multi-node `tfdist run --nnodes` on this machine (the nodes' launchers meet on 127.0.0.1; toy workers).

tests/test_nodes_netns.py runs the same launcher on separate network hosts with TensorFlow workers.
"""

import json
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.jobs import WORKERS, job_env
from tests.nodes_jobs import node_command, run_nodes, wait_for
from tests.test_launcher import alive, all_gone, wait_for_pids, worker_pids
from tfdist.launch import local


def toy(tmp_path, mode):
    return [sys.executable, str(WORKERS / "toy_worker.py"), str(tmp_path), mode]


def master_address():
    """127.0.0.1 and a free port below the kernel's ephemeral range, which no outgoing connection takes.

    A port from ``free_ports`` (the ephemeral range) can become some connection's local port
    before the master binds it; nodes without --node-rank then all find the address in use and
    wait for a master that never listens.
    """
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return f"127.0.0.1:{port}"
    return f"127.0.0.1:{local.free_ports(1)[0]}"


def two_nodes(tmp_path, mode, *launcher_args, num_workers=1, **run_args):
    master = master_address()
    return run_nodes([node_command(rank, 2, master, toy(tmp_path, mode), *launcher_args, num_workers=num_workers)
                      for rank in (0, 1)], **run_args)


def test_two_nodes_agree_on_every_worker_and_rank(tmp_path):
    results = two_nodes(tmp_path, "echo", num_workers=2)
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    for result in results:
        assert "all workers finished on 2 nodes" in result.output
    assert "[0] hello from 0" in results[0].output and "[3] hello from 3" in results[1].output
    envs = [json.loads((tmp_path / f"worker{rank}.json").read_text()) for rank in range(4)]
    configs = [json.loads(env["TF_CONFIG"]) for env in envs]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs) and len(set(configs[0]["cluster"]["worker"])) == 4
    assert [c["task"]["index"] for c in configs] == [0, 1, 2, 3]
    assert [env["TFDIST_WORKER_INDEX"] for env in envs] == ["0", "1", "2", "3"]
    assert [env["TFDIST_LOCAL_RANK"] for env in envs] == ["0", "1", "0", "1"]
    assert all(env["TFDIST_NUM_WORKERS"] == "4" and env["TFDIST_LOCAL_SIZE"] == "2" for env in envs)
    assert {env["TFDIST_GRACE_PERIOD"] for env in envs} == {"2"}  # node_command's --grace-period


def test_host_address_picks_where_a_nodes_workers_are_reached(tmp_path):
    master = master_address()
    results = run_nodes([node_command(0, 2, master, toy(tmp_path, "echo")),
                         node_command(1, 2, master, toy(tmp_path, "echo"), "--host-address", "127.0.0.2")])
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    assert "this node's workers listen on 127.0.0.2" in results[1].output
    config = json.loads(json.loads((tmp_path / "worker0.json").read_text())["TF_CONFIG"])
    assert [a.rsplit(":", 1)[0] for a in config["cluster"]["worker"]] == ["127.0.0.1", "127.0.0.2"]


def test_a_worker_failing_on_one_node_stops_every_node_naming_it(tmp_path):
    started = time.monotonic()
    results = two_nodes(tmp_path, "fail1")
    assert [r.returncode for r in results] == [3, 3], [r.output for r in results]
    for result in results:
        assert "worker 1 on node 1 exited with code 3; stopped all workers on 2 nodes" in result.output
    assert "exit codes [SIGTERM]" in results[0].output  # node 0's worker, stopped by the launcher
    assert time.monotonic() - started < 30
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_max_restarts_restarts_every_node_together(tmp_path):
    results = two_nodes(tmp_path, "fail_first_attempt", "--max-restarts", "1")
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    for result in results:
        assert "worker 1 on node 1 exited with code 5" in result.output
        assert "restarting all workers on 2 nodes (1/1)" in result.output
        assert "all workers finished on 2 nodes after 1 restart(s)" in result.output
    assert {"pid1.0", "pid0.1", "pid1.1"} <= {p.name for p in tmp_path.glob("pid*")}


def test_a_port_clash_on_one_node_retries_every_node_on_fresh_ports(tmp_path):
    """Worker 1 marks "port-clash" (as tfdist does when TensorFlow cannot listen on its TF_CONFIG port): its node
    tells the master, which starts every node again on fresh ports, not counted against --max-restarts (0)."""
    results = two_nodes(tmp_path, "port_clash")
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    address = json.loads(json.loads((tmp_path / "worker1.json").read_text())["TF_CONFIG"])["cluster"]["worker"][1]
    for result in results:  # worker1.json is the second attempt's: the first attempt's address differs
        assert ("worker 1 on node 1 exited with code 1: port 127.0.0.1:" in result.output
                and " was taken by another process before tfdist's worker could listen there; retrying on fresh "
                    "ports (1/3)" in result.output), result.output
        assert f"port {address} was taken" not in result.output
        assert "all workers finished on 2 nodes\n" in result.output or "all workers finished on 2 nodes (" in result.output
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "0", "1", "1"]


def test_a_port_clash_on_fixed_ports_ends_the_job_naming_the_port(tmp_path):
    port = local.free_ports(1)[0]
    results = two_nodes(tmp_path, "port_clash", "--port", str(port), "--max-restarts", "1")
    assert [r.returncode for r in results] == [1, 1], [r.output for r in results]
    for result in results:
        assert (f"worker 1 on node 1 exited with code 1: port 127.0.0.1:{port} was taken by another process before "
                "tfdist's worker could listen there (free it, or give another --port); stopped all workers on 2 "
                "nodes") in result.output, result.output
    assert sorted((tmp_path / "starts").read_text().split()) == ["0", "1"]  # no restart on the same ports


def test_a_stray_connection_cannot_join(tmp_path):
    """A client that does not know the token is refused; the job runs as if it never came."""
    master = master_address()
    host, port = master.split(":")

    def stray(i):
        if i == 1:  # after node 0 started listening
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    with socket.create_connection((host, int(port)), timeout=2) as sock:
                        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                        sock.recv(1024)
                        break
                except OSError:
                    time.sleep(0.2)

    results = run_nodes([node_command(rank, 2, master, toy(tmp_path, "echo")) for rank in (0, 1)], between=stray)
    assert [r.returncode for r in results] == [0, 0], [r.output for r in results]
    assert ("tfdist run [master]: refused a connection from 127.0.0.1: a frame of 1195725856 bytes is not this "
            "protocol") in results[0].output
    assert "all workers finished on 2 nodes" in results[1].output


# Bad inputs: each a clear error on every node, and no worker started anywhere ---------------

def assert_no_worker_started(tmp_path):
    assert not list(tmp_path.glob("pid*"))


def test_two_nodes_with_the_same_rank_stop_the_job(tmp_path):
    master = master_address()
    results = run_nodes([node_command(rank, 3, master, toy(tmp_path, "echo")) for rank in (0, 1, 1)], stagger=0.3)
    assert [r.returncode for r in results] == [2, 2, 2], [r.output for r in results]
    for result in results:
        assert "two nodes claim --node-rank 1: " in result.output
        assert "give each node its own --node-rank in 0..2" in result.output
    assert_no_worker_started(tmp_path)


def test_a_wrong_token_is_refused(tmp_path):
    master = master_address()
    results = run_nodes([node_command(rank, 2, master, toy(tmp_path, "echo"), "--start-timeout", "4")
                         for rank in (0, 1)], tokens=["right-token", "wrong-token"], stagger=0.3)
    assert results[1].returncode == 2, results[1].output
    assert (f"node 0 (the master at {master}) refused this node: wrong token: this node's token differs from "
            "node 0's. Give every node the same token (TFDIST_TOKEN or --token).") in results[1].output
    assert results[0].returncode == 124, results[0].output
    assert (f"node(s) [1] did not arrive at the master {master} within --start-timeout 4s; refused 1 "
            "connection(s): 127.0.0.1 (wrong token)") in results[0].output
    assert_no_worker_started(tmp_path)


def test_a_master_that_never_answers(tmp_path):
    master = master_address()
    started = time.monotonic()
    [result] = run_nodes([node_command(1, 2, master, toy(tmp_path, "echo"), "--start-timeout", "2")])
    assert result.returncode == 124
    assert (f"the master {master} did not answer within --start-timeout 2s (Connection refused): start node 0 with "
            "the same --master") in result.output
    assert time.monotonic() - started < 20
    assert_no_worker_started(tmp_path)


def test_a_node_that_arrives_after_the_start_timeout(tmp_path):
    master = master_address()
    commands = [node_command(rank, 2, master, toy(tmp_path, "echo"), "--start-timeout", "2") for rank in (0, 1)]
    first = subprocess.Popen(commands[0], env=job_env({"TFDIST_TOKEN": "t"}), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        node0 = first.communicate(timeout=30)[0]
    finally:
        first.kill()
    [late] = run_nodes([commands[1]], tokens=["t"])
    assert first.returncode == 124
    assert f"node(s) [1] did not arrive at the master {master} within --start-timeout 2s" in node0
    assert late.returncode == 124 and f"the master {master} did not answer within --start-timeout 2s" in late.output
    assert_no_worker_started(tmp_path)


def test_nodes_started_with_different_node_counts(tmp_path):
    master = master_address()
    results = run_nodes([node_command(0, 2, master, toy(tmp_path, "echo")),
                         node_command(1, 3, master, toy(tmp_path, "echo"), "--start-timeout", "5")], stagger=0.3)
    assert [r.returncode for r in results] == [2, 2], [r.output for r in results]
    for result in results:
        assert "was started with --nnodes 3 --node-rank 1, node 0 with --nnodes 2: start every node with the same " \
               "--nnodes" in result.output
    assert_no_worker_started(tmp_path)


@pytest.mark.parametrize("args, message", [
    (["--master", "10.255.255.1:29400"], "node 0 cannot listen on --master 10.255.255.1:29400 (Cannot assign "
                                         "requested address): --master must be an address of node 0"),
    (["--master", "127.0.0.1:29400", "--host-address", "10.255.255.1"],
     "--host-address 10.255.255.1 is not an address of this node (Cannot assign requested address)"),
])
def test_addresses_that_are_not_this_nodes(tmp_path, args, message):
    [result] = run_nodes([[sys.executable, "-m", "tfdist.run", "--nnodes", "2", "--node-rank", "0", *args,
                           "--start-timeout", "5", "-n", "1", "--", *toy(tmp_path, "echo")]])
    assert result.returncode == 2, result.output
    assert message in result.output
    assert_no_worker_started(tmp_path)


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2", "--node-rank", "2", "--master", "h:1"], "--node-rank must be in 0..1 for --nnodes 2: received 2."),
    (["--nnodes", "0"], "--nnodes must be at least 1: received 0."),
    (["--nnodes", "0:2", "--master", "h:1"], "--nnodes MIN must be at least 1: received '0:2'; give N (a fixed node "
                                              "count) or MIN:MAX (an elastic job), e.g. --nnodes 2 or --nnodes 2:4."),
    (["--nnodes", "3:2", "--master", "h:1"], "--nnodes MIN:MAX needs MIN <= MAX: received '3:2'; e.g. --nnodes 2:3."),
    (["--nnodes", "two"], "--nnodes must be N or MIN:MAX with whole numbers: received 'two'"),
    (["--nnodes", "2:", "--master", "h:1"], "--nnodes must be N or MIN:MAX with whole numbers: received '2:'"),
    (["--nnodes", "2:x", "--master", "h:1"], "--nnodes must be N or MIN:MAX with whole numbers: received '2:x'"),
    (["--nnodes", "2:3", "--node-rank", "3", "--master", "h:1"],
     "--node-rank must be in 0..2 for --nnodes 2:3: received 3."),
    (["--nnodes", "2", "--rdzv-wait", "5", "--master", "h:1"],
     "--rdzv-wait applies to an elastic job: give --nnodes MIN:MAX (received --nnodes 2)."),
    (["--nnodes", "2:3", "--rdzv-wait", "-1", "--master", "h:1"], "--rdzv-wait must be 0 or more seconds: received -1.0."),
    (["--nnodes", "2:3"], "--nnodes 2:3 needs --master ADDR:PORT"),
    (["--nnodes", "2"], "--nnodes 2 needs --master ADDR:PORT: node 0's address and a free port there"),
    (["--nnodes", "2", "--master", "10.0.0.1"], "--master must be ADDR:PORT with a port in 1..65535, e.g. "
                                                "10.0.0.1:29400: received '10.0.0.1'."),
    (["--nnodes", "2", "--master", "10.0.0.1:29400"], "--nnodes 2 needs a token that every node shares, so that no "
                                                      "one else can join the job: run export TFDIST_TOKEN="),
    (["--nnodes", "2", "--master", "0.0.0.0:29400"], "--master must be the address the other nodes reach node 0 at "
                                                     "(node 0 listens there and nowhere else), not the wildcard 0.0.0.0"),
    (["--master", "10.0.0.1:29400"], "--master only apply to a job on several nodes: add --nnodes M"),
    (["--ray", "--nnodes", "2", "--master", "h:1"], "--ray and --nnodes are two ways to use several machines"),
    (["--gpus-per-worker", "1"], "--cpus-per-worker and --gpus-per-worker are Ray resources: add --ray."),
])
def test_bad_multi_node_arguments_fail_fast(args, message):
    env = job_env()
    env.pop("TFDIST_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "tfdist.run", "-n", "1", *args, "--", "python"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("victim, sig, code, reason", [(0, "SIGINT", 130, "interrupted"),
                                                       (1, "SIGTERM", 143, "received SIGTERM")])
def test_a_signal_to_one_nodes_launcher_stops_every_node(tmp_path, victim, sig, code, reason):
    import signal

    master = master_address()
    processes = [subprocess.Popen(node_command(rank, 2, master, toy(tmp_path, "sleep")),
                                  env=job_env({"TFDIST_TOKEN": "t"}), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 30
        while len(worker_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        processes[victim].send_signal(getattr(signal, sig))
        outputs = [p.communicate(timeout=60)[0] for p in processes]
    finally:
        for process in processes:
            process.kill()
    assert [p.returncode for p in processes] == [code, code], outputs
    assert f"{reason}; stopped this node's workers" in outputs[victim]
    assert f"node {victim}: {reason}; stopped all workers on 2 nodes" in outputs[1 - victim]
    assert not any(alive(pid) for pid in worker_pids(tmp_path))


def test_the_launcher_imports_neither_tensorflow_nor_ray():
    code = ("import sys, tfdist.run, tfdist.launch.nodes, tfdist.launch.ray, tfdist.doctor; "
            "print([m for m in ('tensorflow', 'keras', 'ray') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("victim, signals", [(0, ["SIGKILL"]), (1, ["SIGKILL"]), (1, ["SIGHUP"]),
                                             (0, ["SIGTERM", "SIGINT"])])
def test_no_worker_of_two_nodes_outlives_a_signalled_launcher(tmp_path, victim, signals):
    """Workers swallow SIGTERM; 2 s between SIGTERM and SIGKILL, 60 s on a node that gets two signals."""
    import signal

    master = master_address()
    processes = [subprocess.Popen(node_command(rank, 2, master, toy(tmp_path, "ignore_term"),
                                               *(["--grace-period", "60"] if rank == victim and len(signals) > 1
                                                 else [])),
                                  env=job_env({"TFDIST_TOKEN": "t"}), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        pids = wait_for_pids(tmp_path, 2)
        for i, name in enumerate(signals):
            if i:
                time.sleep(1)  # the launcher has taken the first signal
            processes[victim].send_signal(getattr(signal, name))
        assert all_gone(pids, within=20)
        outputs = [p.communicate(timeout=60)[0] for p in processes]
    finally:
        for process in processes:
            process.kill()
    assert all(p.returncode != 0 for p in processes), outputs
    assert not any("Traceback" in output for output in outputs), outputs


def test_a_master_survives_a_flood_and_malformed_hellos(tmp_path):
    """Node 0 runs with 128 file descriptors; 300 idle connections and a hello with a non-ASCII mac come first."""
    import resource

    master = master_address()
    host, port = master.split(":")
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))  # noqa: E731
    node0 = subprocess.Popen(node_command(0, 2, master, toy(tmp_path, "echo")), env=job_env({"TFDIST_TOKEN": "t"}),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
    flood = []
    try:
        assert malformed_hello_answer((host, int(port))) == {"refused": "not a tfdist hello (protocol tfdist-nodes/1)"}
        until = time.monotonic() + 10
        while len(flood) < 300 and time.monotonic() < until:
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=0.5))
            except OSError:
                pass
        assert len(flood) >= 100
        [node1] = run_nodes([node_command(1, 2, master, toy(tmp_path, "echo"))], tokens=["t"], timeout=90)
        output = node0.communicate(timeout=120)[0]
    finally:
        node0.kill()
        for sock in flood:
            sock.close()
    assert node1.returncode == 0 and node0.returncode == 0, (node1.output, output)
    assert "all workers finished on 2 nodes" in output
    assert output.count("refused a connection from") == 1, output  # then counts, at most every 10 s
    assert "Traceback" not in output


def malformed_hello_answer(address):
    """What the master answers a hello whose mac is not ASCII (it retries while the master starts)."""
    import json
    import struct

    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(address, timeout=10) as sock:
                read = lambda: sock.recv(struct.unpack(">I", sock.recv(4))[0])  # noqa: E731
                read()  # the master's greeting
                hello = json.dumps({"hello": {"node_rank": 1}, "nonce": "00", "mac": "\u00e9" * 64}).encode()
                sock.sendall(struct.pack(">I", len(hello)) + hello)
                return json.loads(read())
        except (OSError, struct.error):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_node_says_at_once_that_it_cannot_resolve_its_master(tmp_path):
    import signal

    node = subprocess.Popen(node_command(1, 2, "no-such-host.invalid:29400", toy(tmp_path, "echo"),
                                         "--start-timeout", "60"),
                            env=job_env({"TFDIST_TOKEN": "t"}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    started = time.monotonic()
    try:
        line = node.stdout.readline()
        said_after = time.monotonic() - started
        node.send_signal(signal.SIGTERM)
        rest = node.communicate(timeout=30)[0]
    finally:
        node.kill()
    assert line.startswith("tfdist run [node 1/2]: cannot reach the master at no-such-host.invalid:29400 yet (Name "
                           "or service not known); retrying for "), line
    assert said_after < 10
    assert node.returncode == 143 and "received SIGTERM" in rest and "Traceback" not in rest, rest


MASTER_AT_ITS_LIMIT = """
import os, resource, sys
from tfdist.launch import master
coordinator = master.Master(("127.0.0.1", int(sys.argv[1])), 1, "t", start_timeout=60, max_restarts=0,
                            fixed_ports=False, grace_period=1, say=lambda line: print(line, flush=True))
coordinator.start()
spare = len(os.listdir("/proc/self/fd")) + 6  # room for 6 connections, no more
resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print("listening", flush=True)
coordinator.thread.join(90)
"""


def test_a_master_out_of_descriptors_keeps_accepting():
    """40 idle connections to a master with room for 6: accept fails (EMFILE) until they go; then a node joins."""
    from tfdist.launch import wire

    port = local.free_ports(1)[0]
    process = subprocess.Popen([sys.executable, "-c", MASTER_AT_ITS_LIMIT, str(port)], env=job_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    flood, said = [], []
    try:
        assert process.stdout.readline() == "listening\n"

        def read():  # what the master says, line by line as it says it
            for line in process.stdout:
                said.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for _ in range(40):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: any("out of resources to accept it" in line for line in said), "the master to hit its limit",
                 timeout=60)
        for sock in flood:
            sock.close()
        deadline = time.monotonic() + 60
        while True:  # as a node's launcher does: retry what the master cut short
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                channel = wire.connect(sock, "t", {"node_rank": 0, "nnodes": 1, "host": "127.0.0.1",
                                                   "hostname": "test", "ports": [1]}, "the master")
                break
            except wire.WireError:
                sock.close()
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert channel.recv(timeout=30)["type"] == "plan"
        channel.send({"type": "over", "attempt": 0, "failure": None})
        while (message := channel.recv(timeout=30))["type"] == "ping":
            pass
        assert message == {"type": "end", "exit_code": 0, "message": "all workers finished on 1 nodes"}
        process.wait(timeout=30)
        reader.join(30)
        output = "".join(said)
    finally:
        process.kill()
        for sock in flood:
            sock.close()
    assert "refused a connection from a client: out of resources to accept it (Too many open files)" in output, output
    assert "Traceback" not in output


def test_a_launcher_that_loses_the_race_for_the_master_address_joins_instead(monkeypatch):
    """Two launchers without --node-rank start at once: both bind the address (SO_REUSEADDR lets them while
    neither listens), the other listens first, and this one's listen fails with EADDRINUSE. It joins as a node
    (start returns False) instead of dying with "Address already in use" (a test_elastic run did)."""
    from tfdist.launch import master

    port = local.free_ports(1)[0]
    rival = socket.socket()
    rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    rival.bind(("127.0.0.1", port))

    class Racing(socket.socket):
        def bind(self, address):
            super().bind(address)
            rival.listen()  # the other launcher listens between this one's bind and listen

    monkeypatch.setattr(master.socket, "socket", Racing)
    coordinator = master.Master(("127.0.0.1", port), (2, 3), "t", start_timeout=5, max_restarts=0,
                                fixed_ports=False, grace_period=1, say=print)
    try:
        assert coordinator.start(only_if_here=True) is False
    finally:
        rival.close()
