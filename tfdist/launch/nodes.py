"""Multi-node ``tfdist run``: the same command on every node; the nodes meet at node 0.

    export TFDIST_TOKEN=...        # the same secret on every node
    tfdist run --nnodes 2 --node-rank K --master 10.0.0.1:29400 -n 2 -- python train.py
    tfdist run --nnodes 2:4 --master 10.0.0.1:29400 -n 2 -- python train.py   # elastic, ranks by arrival

Every node's launcher connects to the master (``launch/master.py``, run by node 0's
launcher at the ``--master`` address) and proves it knows the token (``launch/wire.py``).
It says where its workers will listen: ``--host-address``, else the address this node
reaches the master from, and free ports (``--port P``: P, P+1, ...). Once every node has
arrived, the master sends the plan (every worker's address, in node-rank order) and each
node starts its share through ``local.run_here``: TF_CONFIG for its global rank, its
local rank and size, ``TFDIST_NODE_RANK``/``TFDIST_NUM_NODES``. A worker that fails is
reported to the master at once; the master stops every node, and restarts them all
together or ends the job with one message that every node prints. Without ``--node-rank``,
the launcher that can listen at ``--master`` serves it as node 0 and the master numbers the
others; each plan tells a node its rank and the node count (an elastic job's change between
rounds). Never imports TensorFlow.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import socket
import sys
import threading
import time
from typing import IO, Sequence

from tfdist import cluster
from tfdist.errors import NodeError
from tfdist.launch import lifeline, local, master as master_lib, output, policy, supervisor, wire

ENV_TOKEN = "TFDIST_TOKEN"
DEFAULT_RDZV_WAIT = 5.0  # seconds an elastic job waits for more nodes once MIN arrived
_CONNECT_RETRY_SECONDS = 0.5
_RETRY_SAY_SECONDS = 15.0


class _MasterSaid(Exception):
    """The master stopped or ended the round while this node's workers ran."""

    def __init__(self, message: dict):
        super().__init__(message.get("reason") or message.get("message"))
        self.message = message


def launch(command: Sequence[str], *, nnodes: int | tuple[int, int], node_rank: int | None, master: tuple[str, int],
           token: str, rdzv_wait: float = DEFAULT_RDZV_WAIT,
           num_workers: int = 1, settings: supervisor.WorkerSettings = supervisor.WorkerSettings(), base_port: int | None = None,
           host_address: str | None = None, timeout: float | None = None, max_restarts: int = 0,
           grace_period: float = cluster.DEFAULT_GRACE_SECONDS, start_timeout: float = supervisor.DEFAULT_START_TIMEOUT,
           out: IO[bytes] | None = None, serve_master: bool = True) -> int:
    """Runs this node's share of a multi-node job (and, on node 0, the master); returns the exit code.

    ``nnodes``: N, or (MIN, MAX) for an elastic job. ``node_rank=None``: node 0 if this node can
    listen at ``master`` (it serves the master), else whatever rank the master gives it.
    ``serve_master=False``: the master runs elsewhere (``tfdist run -H``'s own launcher, ``launch/ssh.py``).
    """
    out = out or sys.stdout.buffer
    settings, made_job_dir = supervisor.job_settings(settings, grace_period)  # node 0's: rank 0's hvd.elastic commits
    previous_handlers = lifeline.stop_on_signals()
    coordinator, exit_code, reason = None, 1, "node 0's launcher stopped"
    node = _Node(command, nnodes, node_rank, master, token, num_workers, settings, base_port, host_address,
                 timeout, grace_period, start_timeout, out)
    try:
        if node_rank in (0, None) and serve_master:
            coordinator = master_lib.Master(
                master, nnodes, token, start_timeout=start_timeout, max_restarts=max_restarts,
                fixed_ports=base_port is not None, grace_period=grace_period, rdzv_wait=rdzv_wait,
                say=functools.partial(output.say, out, who="tfdist run [master]"))
            if coordinator.start(only_if_here=node_rank is None):
                node.node_rank = 0
            else:
                coordinator = None
        exit_code = node.run()
        reason = node.last_words or reason
        return exit_code
    except (NodeError, master_lib.MasterError) as err:
        node.say(str(err))
        exit_code, reason = getattr(err, "exit_code", master_lib.EXIT_BAD_SETUP), str(err)
        return exit_code
    finally:
        if coordinator is not None:  # a no-op when the job has ended; else the other nodes learn why
            coordinator.stop(exit_code, f"{reason}; stopped all workers on {coordinator.nnodes} nodes")
            coordinator.close(timeout=grace_period + master_lib.SILENCE_SECONDS)
        lifeline.restore(previous_handlers)
        if made_job_dir:
            shutil.rmtree(made_job_dir, ignore_errors=True)


class _Node:
    """This node's launcher: joins the master, runs each round's share of workers, reports."""

    def __init__(self, command, nnodes, node_rank, master, token, num_workers, settings, base_port, host_address,
                 timeout, grace_period, start_timeout, out):
        self.spec = list(nnodes) if isinstance(nnodes, tuple) else nnodes  # as the hello says it
        self.nnodes = nnodes[1] if isinstance(nnodes, tuple) else nnodes  # this round's node count, once planned
        self.node_rank, self.command, self.master = node_rank, command, master
        self.token, self.num_workers, self.settings, self.base_port = token, num_workers, settings, base_port
        self.host_address, self.grace_period, self.start_timeout = host_address, grace_period, start_timeout
        self.out = out
        self.began = time.monotonic()
        self.deadline = None if timeout is None else self.began + timeout
        self.inbox: queue.Queue = queue.Queue()
        self.channel: wire.Channel | None = None
        self.workers: list[supervisor.Worker] = []
        self.attempt = 0
        self.last_ping = 0.0
        self.reported = False
        self.planned = False  # a plan came: node_rank and nnodes are this round's
        self.last_words: str | None = None  # why this node left, when the master did not say

    @property
    def where(self) -> str:
        return f"{self.master[0]}:{self.master[1]}"

    def say(self, message: str) -> None:
        rank = "?" if self.node_rank is None else self.node_rank
        count = f"{self.spec[0]}:{self.spec[1]}" if isinstance(self.spec, list) and not self.planned else self.nnodes
        output.say(self.out, message, who=f"tfdist run [node {rank}/{count}]")

    def run(self) -> int:
        try:
            self._join()
            while True:
                message = self._next()
                kind = message.get("type")
                if kind == "plan":
                    self.attempt, self.node_rank = message["attempt"], message.get("node_rank", self.node_rank)
                    self.nnodes, self.planned = message.get("nnodes", self.nnodes), True
                    self._run_round(message)
                elif kind == "restart":
                    self.attempt = message["attempt"]
                    self.say(message["reason"])
                    self._send({"type": "ports", "attempt": self.attempt, "ports": self._ports()})
                elif kind == "wait":
                    self.say(message["reason"])
                elif kind == "end":
                    summary = f" ({supervisor.summary(self.workers, self.began)})" if self.workers else ""
                    self.say(f"{message['message']}{summary}")
                    return int(message["exit_code"])
        except supervisor.Stop as stop:  # a signal between rounds, or while joining
            self.last_words = f"node {self.node_rank}: {stop}"
            self._report_over({"message": self.last_words, "exit_code": stop.exit_code, "restartable": False},
                              leaving=True)
            self.say(f"{stop}; stopped this node's workers")
            return stop.exit_code
        finally:
            if self.channel is not None:
                self.channel.close()

    # Joining ---------------------------------------------------------------------------

    def _join(self) -> None:
        if self.host_address is not None:
            _check_local_address(self.host_address)
        deadline = time.monotonic() + self.start_timeout
        retrying = _Retrying(self, deadline)
        while True:
            sock = self._connect(retrying)
            host = self.host_address or sock.getsockname()[0]
            hello = {"node_rank": self.node_rank, "nnodes": self.spec, "host": host,
                     "hostname": socket.gethostname(), "ports": self._ports()}
            try:
                self.channel = wire.connect(sock, self.token, hello, f"the master at {self.where}")
                break
            except wire.Refused as err:
                sock.close()
                raise NodeError(f"node 0 (the master at {self.where}) refused this node: {err}. Give every node the "
                                f"same token ({ENV_TOKEN} or --token).", master_lib.EXIT_BAD_SETUP) from None
            except wire.Foreign as err:
                sock.close()
                raise NodeError(f"could not join the master at {self.where}: {err}") from None
            except wire.WireError as err:  # closed or silent: a master busy turning others away; try again
                sock.close()
                retrying.failed(f"it did not complete the handshake: {err}")
        threading.Thread(target=self._read, daemon=True, name="tfdist-node-reader").start()
        self.say(f"joined the master at {self.where}; this node's workers listen on {host}")

    def _connect(self, retrying: _Retrying) -> socket.socket:
        """Connects to the master, retrying until ``retrying``'s deadline."""
        while True:
            try:
                return socket.create_connection(self.master, timeout=max(0.1, min(5.0, retrying.left())))
            except OSError as err:
                retrying.failed(err.strerror or str(err))

    def _ports(self) -> list[int]:
        if self.base_port is not None:
            return list(range(self.base_port, self.base_port + self.num_workers))
        return local.free_ports(self.num_workers, host="")  # TensorFlow's servers bind every interface

    # Talking to the master -------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv(timeout=master_lib.SILENCE_SECONDS)
            except wire.WireError as err:
                self.inbox.put({"type": "lost", "reason": str(err)})
                return
            if message.get("type") != "ping":
                self.inbox.put(message)

    def _next(self, block: bool = True) -> dict | None:
        """The master's next message (None when not blocking and there is none); pings while waiting."""
        while True:
            self._ping_if_due()
            try:
                message = self.inbox.get(timeout=master_lib.PING_SECONDS) if block else self.inbox.get_nowait()
            except queue.Empty:
                if not block:
                    return None
                continue
            if message.get("type") == "lost":
                raise NodeError(f"lost the master at {self.where} ({message['reason']}): the job ends with node 0, "
                                "whose launcher serves the master; stopped this node's workers")
            return message

    def _ping_if_due(self) -> None:
        if time.monotonic() - self.last_ping > master_lib.PING_SECONDS:
            self.last_ping = time.monotonic()
            self._send({"type": "ping"})

    def _send(self, message: dict) -> None:
        try:
            self.channel.send(message)
        except wire.WireError:
            pass  # the reader reports the loss

    def _report_over(self, failure: dict | None, port_clash: Sequence[str] = (), leaving: bool = False) -> None:
        """``port_clash``: where this node's workers could not listen; ``leaving``: this node's launcher stops (a
        signal), an elastic job goes on without it."""
        if self.channel is not None:
            self._send({"type": "over", "attempt": self.attempt, "failure": failure, "port_clash": list(port_clash),
                        "leaving": leaving})

    # One round -------------------------------------------------------------------------

    def _run_round(self, plan: dict) -> None:
        first, addresses = plan["first_rank"], plan["addresses"]
        self.ranks = range(first, first + self.num_workers)
        self.workers, self.reported = [], False
        failure = None
        try:
            local.run_here(self.workers, self.command, addresses, self.settings, self.attempt, self.deadline,
                           self.grace_period, self.start_timeout, self.out, node=self)
        except _MasterSaid as said:
            if said.message.get("type") == "end":
                self.inbox.put(said.message)  # handled by run()
        except supervisor.Stop as stop:  # --timeout, the start watchdog, or a signal to this launcher
            if stop.exit_code in (*(128 + sig for sig in lifeline.SIGNALS), cluster.EXIT_PREEMPTED):
                raise  # a signal (its workers saved, or not): run() reports it and leaves
            failure = {"message": f"node {self.node_rank}: {stop}", "exit_code": stop.exit_code, "restartable": False}
        self._report_over(failure, port_clash=supervisor.port_clashes(self.workers, addresses))

    # What local.run_here asks of a node (see its ``node`` argument) ------------------------

    def env(self, local_rank: int) -> dict[str, str]:
        return {cluster.ENV_LOCAL_RANK: str(local_rank), cluster.ENV_LOCAL_SIZE: str(self.num_workers),
                cluster.ENV_NODE_RANK: str(self.node_rank), cluster.ENV_NUM_NODES: str(self.nnodes)}

    def on_poll(self, codes: list[int | None]) -> None:
        for rank, code in zip(self.ranks, codes):
            if code not in (None, 0) and not self.reported:
                self.reported = True  # before this node stops its other workers: the master stops every node
                failure = supervisor.Failure(rank, code)
                self._send({"type": "failed", "attempt": self.attempt, "restartable": True,
                            "message": f"worker {rank} on node {self.node_rank} {supervisor.describe_exit(code)}",
                            "exit_code": failure.exit_code})
        message = self._next(block=False)
        if message is not None and message.get("type") in ("stop", "end"):
            raise _MasterSaid(message)


class _Retrying:
    """Tries to reach the master until a deadline: says so at once, then every _RETRY_SAY_SECONDS."""

    def __init__(self, node: _Node, deadline: float):
        self.node, self.deadline, self.said_at = node, deadline, None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def failed(self, why: str) -> None:
        """Notes a failed try (NodeError past the deadline) and waits before the next."""
        node = self.node
        if self.left() <= 0:
            raise NodeError(
                f"the master {node.where} did not answer within --start-timeout {node.start_timeout:g}s ({why}): "
                "start node 0 with the same --master (it listens there), check that this node can reach that "
                "address, and start every node within --start-timeout of node 0", policy.EXIT_TIMEOUT)
        if self.said_at is None or time.monotonic() - self.said_at > _RETRY_SAY_SECONDS:
            self.said_at = time.monotonic()
            node.say(f"cannot reach the master at {node.where} yet ({why}); retrying for {self.left():.0f}s more "
                     f"(--start-timeout {node.start_timeout:g}s)")
        time.sleep(_CONNECT_RETRY_SECONDS)


def _check_local_address(address: str) -> None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
    except OSError as err:
        raise NodeError(f"--host-address {address} is not an address of this node ({err.strerror}); give one "
                        "of its own addresses, the one the other nodes reach it at.", master_lib.EXIT_BAD_SETUP) from None


def token_from(value: str | None, env: dict[str, str] | None = None) -> str | None:
    """The job's token: ``--token``, else ``TFDIST_TOKEN`` (None when neither is set)."""
    env = os.environ if env is None else env
    return value or env.get(ENV_TOKEN) or None
