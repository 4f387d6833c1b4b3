"""Node 0's coordinator of a multi-node job: the rendezvous, and one verdict for all nodes.

Node 0's launcher runs it in background threads beside its own node's share of the job;
that share connects to it over TCP like every other node. It listens on the ``--master``
address only, and only for tfdist launchers that prove they know the job's token
(``wire``). What each side says (every message signed):

* node -> master: the hello (its node rank or none, the node count, its address and worker ports);
  ``ports`` (fresh ports after a restart); ``failed`` (a worker failed, sent before the
  node stops its other workers); ``over`` (this node's workers have all exited, and why);
  ``ping``.
* master -> node: ``plan`` (every worker's address, this node's rank and first worker rank, the node count);
  ``stop``; ``restart``; ``end`` (the exit code and the message every node prints);
  ``ping``.

Ranks follow node ranks: node 0's workers first. A node without a rank of its own is
numbered in arrival order after those that have one (the master's own node is 0). A worker
that fails anywhere stops the job everywhere; once every node's workers stopped, the master
asks ``launch.policy`` (as ``supervisor.launch`` does) whether to restart, on fresh ports (a
node's "over" names the addresses where a worker's TensorFlow server could not listen), or to
end the job, for all nodes together.

An elastic job (``--nnodes MIN:MAX``) starts once MIN nodes are there (after ``rdzv_wait``
seconds for more, up to MAX). Its membership changes between rounds: a node that arrives
while the workers run, or one that is lost or leaves, makes the master stop every node's
workers (SIGTERM: they save and exit) and start a new round with the new set of nodes,
renumbered. Such a change does not count against ``max_restarts``; a worker's failure in a
round without one does. With fewer than MIN nodes left the master waits ``start_timeout``
for more, then ends the job. A node that arrives when MAX nodes are there waits (standby)
until one leaves; the master reads its connection meanwhile, as every connection it holds
(its pings, or its loss: a standby node that dies is dropped, and said so).

Whoever else connects cannot stall it: at most ``MAX_HANDSHAKES`` connections wait for
their handshake at once (``HANDSHAKE_SECONDS`` each, in all; more are closed at once),
running out of file descriptors only pauses accepting, and refusals are logged as a
count. Never imports TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import ipaddress
import queue
import socket
import threading
import time
from typing import Callable

from tfdist.errors import MasterError
from tfdist.launch import policy, wire

EXIT_BAD_SETUP = 2
PING_SECONDS = 2.0
SILENCE_SECONDS = 30.0  # a launcher that sends nothing (not even a ping) this long is lost
_ACK_SECONDS = 30.0  # beyond the grace period, for a node to report its workers stopped
MAX_HANDSHAKES = 32  # connections waiting for their handshake at once
HANDSHAKE_SECONDS = 5.0  # for a connection to prove it knows the token
_REFUSALS_SECONDS = 10.0  # at most one line about refused connections this often
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclasses.dataclass
class _Node:
    rank: int | None  # asked for in its hello (None: any); once planned, its rank in the job
    channel: wire.Channel
    host: str
    hostname: str
    ports: list[int] | None
    over: bool = False
    lost: bool = False
    asked: int | None = None  # the node rank its hello asked for

    def describe(self) -> str:
        return f"{self.hostname} ({self.host})" if self.hostname != self.host else self.host

    def name(self) -> str:
        return f"node {self.rank} ({self.describe()})" if self.rank is not None else f"a node at {self.describe()}"


class Master:
    """Coordinates the nodes of one job; ``start`` listens, ``close`` waits for the verdict to go out."""

    def __init__(self, address: tuple[str, int], nnodes: int | tuple[int, int], token: str, *, start_timeout: float,
                 max_restarts: int, fixed_ports: bool, grace_period: float, say: Callable[[str], None],
                 rdzv_wait: float = 0.0):
        """``nnodes``: N (a fixed size), or (MIN, MAX) for an elastic job."""
        self.elastic = isinstance(nnodes, tuple)
        self.min_nodes, self.max_nodes = nnodes if self.elastic else (nnodes, nnodes)
        self.spec = f"{self.min_nodes}:{self.max_nodes}" if self.elastic else str(nnodes)
        self.nnodes = self.max_nodes  # the node count of the current (or next) round
        self.address, self.token, self.rdzv_wait = address, token, rdzv_wait
        self.arrivals = 0  # keys self.nodes and self.standby: one per launcher that proved it knows the token
        self.change: str | None = None  # why the membership changes at the end of this round
        self.quorum_at: float | None = None  # when MIN nodes were first there (elastic)
        self.start_timeout, self.grace_period, self.say = start_timeout, grace_period, say
        self.policy = policy.RestartPolicy(max_restarts, fixed_ports)
        self.events: queue.Queue = queue.Queue()
        self.nodes: dict[int, _Node] = {}
        self.refusals: collections.Counter = collections.Counter()  # (peer, reason) -> count
        self.refusals_said, self.refusals_said_at = 0, 0.0
        self.handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.closing = False
        self.attempt = 0
        self.phase = "gather"  # gather -> running -> stopping -> (gather | ended)
        self.deadline = 0.0
        self.failure: policy.Failure | None = None
        self.port_clash: list[str] = []  # this round's addresses where a worker's TensorFlow server could not listen
        self.round_began = 0.0
        self.listener: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.turned_away: list[wire.Channel] = []  # told to go (half-closed); closed with the master
        # (key, channel, hello, peer) of the nodes that wait at MAX (elastic), admitted as nodes leave
        self.standby: list[tuple[int, wire.Channel, dict, str]] = []
        self.verdict: dict | None = None  # the "end" message, once the job has ended
        self.finished = False  # the coordinator has left: handshake threads answer late nodes themselves
        self.finishing = threading.Lock()

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def start(self, only_if_here: bool = False) -> bool:
        """Listens on the master address and starts coordinating; MasterError when it cannot listen.

        ``only_if_here``: returns False (and does nothing) when the address is not this machine's,
        or a master listens there already: this node joins it rather than serving it.
        """
        listener = socket.socket(socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(self.address)
            # Another launcher may have bound it too (SO_REUSEADDR) and listened first: then listen fails
            listener.listen(max(128, 2 * self.max_nodes + 8))
        except OSError as err:
            listener.close()
            if only_if_here and err.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                return False
            raise MasterError(
                f"node 0 cannot listen on --master {self.where} ({err.strerror}): --master must be an address "
                "of node 0 (the one other nodes reach it at) and a port free there.") from None
        self.listener = listener
        bound, host = listener.getsockname()[0], self.address[0]
        if ipaddress.ip_address(bound).is_loopback and not (_is_ip(host) and ipaddress.ip_address(host).is_loopback):
            self.say(f"note: --master {self.where} is {bound} on this node, a loopback address: only nodes on this "
                     "machine can reach it; give node 0's network address")
        self.deadline = self.round_began = time.monotonic()
        self.deadline += self.start_timeout
        threading.Thread(target=self._accept, daemon=True, name="tfdist-master-accept").start()
        self.thread = threading.Thread(target=self._coordinate, daemon=True, name="tfdist-master")
        self.thread.start()
        return True

    def stop(self, exit_code: int, message: str) -> None:
        """Ends the job on every node with ``message``, unless it has ended already."""
        self.events.put(("abort", exit_code, message))

    def close(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the verdict to reach every node, then stops listening."""
        if self.thread is not None:
            self.thread.join(timeout)
        self.closing = True
        if self.listener is not None:
            self.listener.close()
        for channel in [node.channel for node in self.nodes.values()] + self.turned_away + \
                [waiting[1] for waiting in self.standby]:
            channel.close()

    # Threads feeding self.events -------------------------------------------------------

    def _accept(self) -> None:
        pause = 0.0
        while not self.closing:
            try:
                sock, peer = self.listener.accept()
            except OSError as err:
                if self.closing or err.errno == errno.EBADF:
                    return
                if err.errno in _OUT_OF_RESOURCES:  # the connection waits in the backlog meanwhile
                    self.events.put(("refused", "a client", f"out of resources to accept it ({err.strerror})"))
                    pause = min(1.0, max(0.05, 2 * pause))
                    time.sleep(pause)
                continue
            pause = 0.0
            if not self.handshakes.acquire(blocking=False):
                sock.close()
                self.events.put(("refused", peer[0], f"over {MAX_HANDSHAKES} connections waiting for their handshake"))
                continue
            try:
                threading.Thread(target=self._handshake, args=(sock, peer[0]), daemon=True).start()
            except RuntimeError:  # no thread to be had
                self.handshakes.release()
                sock.close()
                self.events.put(("refused", peer[0], "no thread to handle it"))

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        try:
            channel, hello = wire.accept(sock, self.token, peer, HANDSHAKE_SECONDS)
        except Exception as err:  # WireError, or anything a malformed hello could raise: refuse, never die
            self.events.put(("refused", peer, str(err) if isinstance(err, wire.WireError) else
                             f"a malformed hello ({type(err).__name__})"))
            sock.close()
            return
        finally:
            self.handshakes.release()
        with self.finishing:
            if not self.finished:
                self.events.put(("hello", channel, hello, peer))
                return
        self._tell_the_verdict(channel)  # a node arriving after the end learns it too

    def _read(self, key: int, channel: wire.Channel) -> None:
        while True:
            try:
                message = channel.recv(timeout=SILENCE_SECONDS)
            except wire.WireError as err:
                self.events.put(("lost", key, channel, str(err)))
                return
            self.events.put(("message", key, channel, message))

    # The coordinator ---------------------------------------------------------------------

    def _coordinate(self) -> None:
        last_ping = time.monotonic()
        while self.phase != "ended":
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    getattr(self, f"_on_{event[0]}")(*event[1:])
            except Exception as err:  # a bug here must not leave every node waiting
                self._end(1, f"node 0's coordinator failed ({type(err).__name__}: {err}); stopped all workers")
                break
            if time.monotonic() - last_ping > PING_SECONDS:
                last_ping = time.monotonic()
                self._broadcast({"type": "ping"})
                for waiting in self.standby:
                    self._send(waiting[1], {"type": "ping"})
            if self.phase == "gather":
                self._plan_if_ready()
            self._check_deadline()
            self._say_refusals()
        self._wait_for_goodbyes()

    def _on_abort(self, exit_code: int, message: str) -> None:
        self._end(exit_code, message)

    def _on_refused(self, peer: str, reason: str) -> None:
        self.refusals[(peer, reason)] += 1
        if not self.refusals_said:
            self.refusals_said, self.refusals_said_at = 1, time.monotonic()
            self.say(f"refused a connection from {peer}: {reason}")

    def _say_refusals(self) -> None:
        """At most every _REFUSALS_SECONDS: how many connections were refused since the last word."""
        total = sum(self.refusals.values())
        if total > self.refusals_said and time.monotonic() - self.refusals_said_at > _REFUSALS_SECONDS:
            self.say(f"refused {total - self.refusals_said} more connection(s); {total} in all: {self._refused()}")
            self.refusals_said, self.refusals_said_at = total, time.monotonic()

    def _refused(self) -> str:
        """'127.0.0.1 (wrong token)', or the most frequent three with their counts."""
        common = [f"{peer} ({reason})" + (f" x{count}" if count > 1 else "")
                  for (peer, reason), count in self.refusals.most_common(3)]
        return ", ".join(common) + (f", and {len(self.refusals) - 3} other kind(s)" if len(self.refusals) > 3 else "")

    def _on_hello(self, channel: wire.Channel, hello: dict, peer: str) -> None:
        """A launcher that proved it knows the token: read from now on, as every connection held; then admitted."""
        if self.verdict is not None:
            self._tell_the_verdict(channel)
            return
        key, self.arrivals = self.arrivals, self.arrivals + 1
        threading.Thread(target=self._read, args=(key, channel), daemon=True).start()
        self._admit(key, channel, hello, peer)

    def _admit(self, key: int, channel: wire.Channel, hello: dict, peer: str) -> None:
        """Takes the node in as ``self.nodes[key]``, or keeps it waiting (standby), or turns it away."""
        rank, nnodes = hello.get("node_rank"), hello.get("nnodes")
        hostname, host = str(hello.get("hostname", peer)), str(hello.get("host", peer))
        nnodes = f"{nnodes[0]}:{nnodes[1]}" if isinstance(nnodes, list) and len(nnodes) == 2 else str(nnodes)
        started = self.phase != "gather" or self.attempt > 0
        if started and self.elastic and len(self.nodes) >= self.max_nodes:
            self.standby.append((key, channel, hello, peer))  # a recreated node whose old self is not gone yet
            self.say(f"a node at {host} waits: the job runs on its most nodes, {self.max_nodes} (--nnodes "
                     f"{self.spec}); it joins when one leaves")
            self._send(channel, {"type": "wait", "reason": f"the job runs on its most nodes, {self.max_nodes} "
                                                           f"(--nnodes {self.spec}): waiting for one to leave"})
            return
        if started and not self.elastic:
            holder = next((n for n in self.nodes.values() if n.rank == rank), None) if isinstance(rank, int) else None
            self._turn_away_with(channel, EXIT_BAD_SETUP, f"this job is already running on all {self.nnodes} nodes"
                                 + (f"; node rank {rank} is {holder.describe()}" if holder else "")
                                 + ": start a new job, or stop this one first")
            return
        fits = rank is None or (isinstance(rank, int) and 0 <= rank < self.max_nodes)
        if nnodes != self.spec or not fits:
            message = (f"{hostname} ({peer}) was started with --nnodes {nnodes} --node-rank {rank}, node 0 with "
                       f"--nnodes {self.spec}: start every node with the same --nnodes, and a --node-rank "
                       f"in 0..{self.max_nodes - 1} (or none)")
            if started:
                self._turn_away_with(channel, EXIT_BAD_SETUP, message)
            else:
                self._abort(message, extra=[channel])
            return
        holder = next((n for n in self.nodes.values() if rank is not None and n.asked == rank), None)
        if holder is not None and not self.elastic:  # elastic: a recreated node may come back with its old rank
            self._abort(f"two nodes claim --node-rank {rank}: {holder.describe()} and "
                        f"{_Node(rank, channel, host, hostname, None).describe()}; give each node its own "
                        f"--node-rank in 0..{self.nnodes - 1}", extra=[channel])
            return
        node = self.nodes[key] = _Node(rank, channel, host, hostname, [int(p) for p in hello.get("ports", [])],
                                       asked=rank, over=self.phase != "gather")  # no workers in this round
        self.say(f"{node.name()} arrived ({len(self.nodes)}/{self.spec} nodes)")
        if self.elastic and len(self.nodes) >= self.min_nodes and self.quorum_at is None:
            self.quorum_at = time.monotonic()
        if self.phase == "running":
            self._change(f"{node.name()} joined; restarting every node's workers with {_nodes(len(self.nodes))}")
        elif self.phase == "stopping":
            self.change = self.change or f"{node.name()} joined"

    def _turn_away_with(self, channel: wire.Channel, exit_code: int, message: str) -> None:
        self._send(channel, {"type": "end", "exit_code": exit_code, "message": message})
        self._turn_away(channel)

    def _on_message(self, key: int, channel: wire.Channel, message: dict) -> None:
        node = self.nodes.get(key)
        if node is None or node.channel is not channel or message.get("attempt", self.attempt) != self.attempt:
            return  # from an earlier attempt or a node that left
        kind = message.get("type")
        if kind == "ports" and self.phase == "gather":
            node.ports = [int(p) for p in message["ports"]]
        elif kind == "failed":
            self._fail(policy.Failure(message["message"], int(message["exit_code"]), bool(message["restartable"])))
        elif kind == "over" and self.elastic and message.get("leaving"):
            self._leave(key, (message.get("failure") or {}).get("message", "it left"))
        elif kind == "over" and self.phase in ("running", "stopping"):
            node.over = True
            if isinstance(message.get("port_clash"), list):
                self.port_clash += [str(address) for address in message["port_clash"]]
            if message.get("failure"):
                failure = message["failure"]
                self._fail(policy.Failure(failure["message"], int(failure["exit_code"]), bool(failure["restartable"])))
            self._finish_round_if_over()

    def _on_lost(self, key: int, channel: wire.Channel, reason: str) -> None:
        waiting = next((w for w in self.standby if w[0] == key), None)
        if waiting is not None:
            self.standby.remove(waiting)
            self.say(f"a node at {waiting[2].get('host', waiting[3])} that waited to join is gone ({reason})")
            return
        node = self.nodes.get(key)
        if node is None or node.channel is not channel:
            return
        node.lost = True
        if self.phase == "gather" and self.attempt == 0:
            del self.nodes[key]  # it may come back before the start timeout
            self.say(f"{node.name()} left before the job started: {reason}")
            return
        if self.elastic:
            self._leave(key, f"lost its launcher ({reason})")
            return
        lost = policy.Failure(f"lost node {node.rank}'s launcher ({node.describe()}: {reason})", 1, False)
        if self.phase == "gather":  # between attempts: no workers run anywhere
            self._end(lost.exit_code, f"{lost.message}; stopped all workers on {self.nnodes} nodes")
            return
        if not node.over:
            node.over = True
            self._fail(lost)
        self._finish_round_if_over()

    def _leave(self, key: int, reason: str) -> None:
        """An elastic job goes on without node ``key``: a new round once every other node's workers stopped."""
        node = self.nodes.pop(key)
        node.lost = True
        self.say(f"{node.name()} {reason}; {len(self.nodes)} node(s) left (--nnodes {self.spec})")
        if self.phase in ("running", "stopping"):
            self._change(f"{node.name()} left; restarting every node's workers with {_nodes(len(self.nodes))}")
            self._finish_round_if_over()
        if self.standby and self.verdict is None:
            self._admit(*self.standby.pop(0))

    def _change(self, reason: str) -> None:
        """Stops the round for a change of members (not a failure: no restart is counted)."""
        if self.change is None:
            self.change = reason
        if self.phase == "running":
            self.phase = "stopping"
            self.deadline = time.monotonic() + self.grace_period + _ACK_SECONDS
            self._broadcast({"type": "stop", "attempt": self.attempt, "reason": reason})

    def _plan_if_ready(self) -> None:
        count = len(self.nodes)
        if count < self.min_nodes or any(n.ports is None for n in self.nodes.values()):
            return
        if self.elastic and count < self.max_nodes and self.attempt == 0 and \
                time.monotonic() < (self.quorum_at or 0.0) + self.rdzv_wait:
            return  # --rdzv-wait: more nodes may come before the first start
        addresses, first = [], {}
        order = sorted(self.nodes, key=lambda key: (self.nodes[key].asked is None, self.nodes[key].asked or 0, key))
        for rank, key in enumerate(order):
            node = self.nodes[key]
            node.rank, first[key] = rank, len(addresses)
            addresses += [f"{_bracket(node.host)}:{port}" for port in node.ports]
        self.nnodes = count
        for key, node in self.nodes.items():
            self._send(node.channel, {"type": "plan", "attempt": self.attempt, "addresses": addresses,
                                      "first_rank": first[key], "node_rank": node.rank, "nnodes": count})
        if self.attempt == 0:
            self.say(f"all {count} nodes arrived; starting {len(addresses)} workers" if not self.elastic else
                     f"{count} nodes arrived (--nnodes {self.spec}); starting {len(addresses)} workers")
        elif self.elastic:
            self.say(f"starting {len(addresses)} workers on {count} nodes")
        self.phase, self.round_began = "running", time.monotonic()

    def _fail(self, failure: policy.Failure) -> None:
        if self.failure is not None or self.phase not in ("running", "stopping"):
            return
        self.failure, self.phase = failure, "stopping"
        self.deadline = time.monotonic() + self.grace_period + _ACK_SECONDS
        self._broadcast({"type": "stop", "attempt": self.attempt, "reason": failure.message})

    def _finish_round_if_over(self) -> None:
        if not all(node.over for node in self.nodes.values()):
            return
        verdict = self.policy.decide(policy.Outcome(
            self.failure, time.monotonic() - self.round_began, self.port_clash, self.change,
            nodes_lost=any(node.lost for node in self.nodes.values())), where=f" on {self.nnodes} nodes")
        if verdict.exit_code is None:
            self._restart(verdict.message)
        else:
            self._end(verdict.exit_code, verdict.message)

    def _restart(self, reason: str) -> None:
        self.attempt += 1
        self.failure, self.change, self.port_clash, self.phase = None, None, [], "gather"
        self.deadline = time.monotonic() + self.start_timeout
        for node in self.nodes.values():
            node.over, node.ports = False, None
        self._broadcast({"type": "restart", "attempt": self.attempt, "reason": reason})
        if len(self.nodes) < self.min_nodes:  # after a change of members
            self.say(f"{len(self.nodes)} node(s) left, fewer than --nnodes {self.spec} allows: waiting up to "
                     f"--start-timeout {self.start_timeout:g}s for {self.min_nodes - len(self.nodes)} more")

    def _check_deadline(self) -> None:
        if self.phase not in ("gather", "stopping") or time.monotonic() < self.deadline:
            return
        if self.phase == "stopping":
            late = sorted(node.rank for node in self.nodes.values() if not node.over)
            why = self.failure or policy.Failure(self.change, 1, False)
            self._end(why.exit_code, f"{why.message}; node(s) {late} did not report their "
                      f"workers stopped within {self.grace_period + _ACK_SECONDS:g}s")
            return
        refused = f"; refused {sum(self.refusals.values())} connection(s): {self._refused()}" if self.refusals else ""
        if self.elastic and len(self.nodes) < self.min_nodes:
            self._end(policy.EXIT_TIMEOUT, f"only {len(self.nodes)} node(s) within --start-timeout "
                      f"{self.start_timeout:g}s, fewer than --nnodes {self.spec} needs{refused}; stopped all workers "
                      f"(start more nodes with the same --master and token, or lower MIN)")
            return
        if self.attempt > 0:
            missing = sorted(n.rank for n in self.nodes.values() if n.ports is None)
            self._end(policy.EXIT_TIMEOUT,
                      f"node(s) {missing} did not restart within --start-timeout {self.start_timeout:g}s")
            return
        asked = {n.asked for n in self.nodes.values()}
        missing = sorted(set(range(self.nnodes)) - asked) if None not in asked else \
            f"{self.nnodes - len(self.nodes)} of {self.nnodes}"
        self._end(policy.EXIT_TIMEOUT, f"node(s) {missing} did not arrive at the master {self.where} within "
                  f"--start-timeout {self.start_timeout:g}s{refused} (start the same tfdist run command on every node, "
                  f"each with its own --node-rank, and the same token)")

    def _abort(self, message: str, extra: list[wire.Channel]) -> None:
        for channel in extra:
            self._send(channel, {"type": "end", "exit_code": EXIT_BAD_SETUP, "message": message})
            self._turn_away(channel)
        self._end(EXIT_BAD_SETUP, message)

    def _turn_away(self, channel: wire.Channel) -> None:
        channel.finish()  # closing now could reset the connection before the node reads why
        self.turned_away.append(channel)

    def _end(self, exit_code: int, message: str) -> None:
        self.phase = "ended"
        self.verdict = {"type": "end", "exit_code": exit_code, "message": message}
        self._broadcast(self.verdict)
        for waiting in self.standby:
            self._tell_the_verdict(waiting[1])

    def _tell_the_verdict(self, channel: wire.Channel) -> None:
        self._send(channel, self.verdict)
        self._turn_away(channel)

    def _wait_for_goodbyes(self) -> None:
        """Lets every node read the verdict and hang up before node 0's launcher exits."""
        until = time.monotonic() + 5.0
        open_nodes = {rank for rank, node in self.nodes.items() if not node.lost}
        while open_nodes and time.monotonic() < until:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if event[0] == "lost":
                open_nodes.discard(event[1])
            elif event[0] == "hello":
                self._tell_the_verdict(event[1])
        with self.finishing:
            self.finished = True
        while not self.events.empty():
            event = self.events.get()
            if event[0] == "hello":
                self._tell_the_verdict(event[1])

    def _broadcast(self, message: dict) -> None:
        for node in list(self.nodes.values()):
            if not node.lost:
                self._send(node.channel, message)

    @staticmethod
    def _send(channel: wire.Channel, message: dict) -> None:
        try:
            channel.send(message)
        except wire.WireError:
            pass  # its reader reports the loss


def _nodes(count: int) -> str:
    return "1 node" if count == 1 else f"{count} nodes"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
