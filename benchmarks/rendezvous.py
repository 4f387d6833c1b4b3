"""The multi-node rendezvous at scale: N simulated nodes join one master and beat; one dies.

    PYTHONPATH=. python benchmarks/rendezvous.py --nodes 512 --processes 8

The master (``tfdist.launch.master.Master``, as node 0's launcher runs it) listens on
127.0.0.1. Each simulated node is the real node-side launcher (``launch/nodes.py``'s
``_Node``: the signed handshake, retries when the master turns it away, pings) in a thread,
``--processes`` processes sharing them; it starts no workers: on the plan it only beats, and
on a stop it reports its (absent) workers stopped, as a node does. Measured, in one run per
kind of death:

* join: from the first node's start to the last node holding the plan (all N joined);
* a node whose process dies (its connection closes): from its death to every other node
  holding the master's stop;
* a node that goes silent (a host cut off: no FIN, no more pings): the same; the master
  notices after ``SILENCE_SECONDS`` without a message.

A fixed-size job (``--nnodes N``): a lost node stops every node. Prints a frozen result per
run. Standard library and tfdist only (no TensorFlow).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import multiprocessing
import os
import pathlib
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tfdist.launch import local, master as master_lib, nodes, supervisor  # noqa: E402

TOKEN = "rendezvous-benchmark"


@dataclasses.dataclass(frozen=True)
class Result:
    nodes: int
    death: str  # "closed" or "silent"
    join_seconds: float
    noticed_seconds: float  # from the death to the last node holding the stop


class _SimulatedNode(nodes._Node):
    """A node's launcher that runs no workers: it reports each stop and records when it came."""

    def __init__(self, master, spec, times, victim):
        super().__init__(["true"], spec, None, master, TOKEN, 1, supervisor.WorkerSettings(), 20000, "127.0.0.1",
                         None, 1.0, 600.0, io.BytesIO())
        self.times, self.victim = times, victim

    def _run_round(self, plan: dict) -> None:
        self.times["plan"] = time.time()
        if self.victim is not None:
            while not self.victim.wait(0.2):  # the benchmark says when; beats until then
                self._ping_if_due()
            self.times["death"] = time.time()
            if self.victim.kind == "closed":
                self.channel.close()
                raise SystemExit
            threading.Event().wait()  # silent: no more pings, the connection left open
        while True:
            message = self._next()
            if message.get("type") in ("stop", "end"):
                self.times["stop"] = time.time()
                self._report_over(None)
                if message["type"] == "end":
                    self.inbox.put(message)
                return


class _Victim(threading.Event):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind


def _simulate(master, spec, count, first, queue, kill_after, kind):
    """Runs ``count`` simulated nodes in threads; node ``first`` == 0 of process 0 is the victim."""
    times = [{} for _ in range(count)]
    victim = _Victim(kind) if first == 0 else None
    threads = []
    for i in range(count):
        node = _SimulatedNode(master, spec, times[i], victim if i == 0 else None)
        threads.append(threading.Thread(target=lambda n=node: _quiet(n.run), daemon=True))
        threads[-1].start()
    if victim is not None:
        while "plan" not in times[0]:
            time.sleep(0.05)
        queue.put(("planned", first))
        time.sleep(kill_after)
        victim.set()
    for thread in threads[1:] if victim is not None else threads:
        thread.join(timeout=300)
    queue.put(("times", first, times))


def _quiet(run):
    try:
        run()
    except SystemExit:
        pass


def measure(num_nodes: int, processes: int, kind: str, kill_after: float) -> Result:
    address = ("127.0.0.1", local.free_ports(1)[0])
    master = master_lib.Master(address, num_nodes, TOKEN, start_timeout=600, max_restarts=0, fixed_ports=True,
                               grace_period=1.0, say=lambda line: None)
    master.start()
    queue = multiprocessing.Queue()
    share = [num_nodes // processes + (1 if p < num_nodes % processes else 0) for p in range(processes)]
    began = time.time()
    workers = [multiprocessing.Process(target=_simulate, args=(address, num_nodes, count, sum(share[:p]), queue,
                                                                kill_after, kind))
               for p, count in enumerate(share)]
    for worker in workers:
        worker.start()
    times = []
    while len(times) < num_nodes:
        message = queue.get(timeout=900)
        if message[0] == "times":
            times += message[2]
    for worker in workers:
        worker.join(timeout=60)
    master.close(timeout=5)
    death = next(t["death"] for t in times if "death" in t)
    return Result(num_nodes, kind, max(t["plan"] for t in times) - began,
                  max(t["stop"] for t in times if "stop" in t) - death)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--processes", type=int, default=8, help="processes the simulated nodes share")
    parser.add_argument("--deaths", default="closed,silent", help="kinds of death to measure, one run each")
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds of beats before the death")
    args = parser.parse_args()
    for kind in args.deaths.split(","):
        result = measure(args.nodes, args.processes, kind, args.kill_after)
        print(result, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TFDIST_TOKEN", TOKEN)
    main()
