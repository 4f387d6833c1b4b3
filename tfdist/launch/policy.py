"""How a job ends or goes on after each attempt: the one restart policy of every launcher.

``supervisor.launch`` (the workers of this machine, or Ray's) and node 0's master (``master.py``,
every node of a multi-node job) tell ``RestartPolicy.decide`` how an attempt ended and act on
its ``Verdict``, in this order:

* a change of members (an elastic job: a node joined or left) starts every worker again, not
  counted against ``max_restarts``, unless it came with a failure no restart mends;
* every worker finished: the job ends with 0;
* a failure no restart mends (a node's launcher lost, a node past ``--timeout``) ends the job;
* a worker whose TensorFlow server could not listen on its port (the worker marks it
  ``port-clash``: ``tfdist.runtime_hooks``) is retried on fresh ports, up to
  ``PORT_CLASH_RETRIES`` times, not counted; on fixed ports (``--port``) the job ends naming them;
* any other failure: a restart while ``max_restarts`` allows, else the end, with the failed
  worker's exit code (a preempted job that saved says how to resume).

Standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tfdist import cluster

EXIT_TIMEOUT = 124  # the job ran past --timeout, or did not start within --start-timeout
PORT_CLASH_RETRIES = 3


@dataclasses.dataclass(frozen=True)
class Failure:
    """What ended an attempt early, said as ``message``; ``exit_code`` is the job's if it ends on it."""

    message: str
    exit_code: int
    restartable: bool = True  # False: no restart mends it (a node's launcher lost, a node past --timeout)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one attempt of the job ended."""

    failure: Failure | None  # its first failure; None: every worker finished
    seconds: float = 0.0  # how long it ran
    port_clash: Sequence[str] = ()  # the addresses where a worker's TensorFlow server could not listen
    change: str | None = None  # why the members change (an elastic job): the restart's reason
    nodes_lost: bool = False  # a node's launcher was lost during the attempt


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Start every worker again (``exit_code`` None) or end the job with ``exit_code``; ``message`` says why."""

    message: str
    exit_code: int | None = None


class RestartPolicy:
    """Decides after every attempt of one job; counts its restarts and its retries on fresh ports."""

    def __init__(self, max_restarts: int, fixed_ports: bool):
        self.max_restarts, self.fixed_ports = max_restarts, fixed_ports
        self.restarts = self.port_retries = 0

    def decide(self, outcome: Outcome, where: str = "") -> Verdict:
        """The verdict on ``outcome``; ``where`` places the workers in the message (" on 2 nodes")."""
        failure = outcome.failure
        if outcome.change is not None and (failure is None or failure.restartable):
            return Verdict(outcome.change)  # a failure in this round came with the change of members
        if failure is None:
            return Verdict(f"all workers finished{where}{self._after_restarts()}", 0)
        if not failure.restartable or outcome.nodes_lost:
            return self._end(failure, where)
        clash = list(outcome.port_clash)
        if clash and self.fixed_ports:
            return self._end(failure, where, f": {_taken(clash)} (free {'it' if len(clash) == 1 else 'them'}, or "
                                             "give another --port)")
        if clash and self.port_retries < PORT_CLASH_RETRIES:
            self.port_retries += 1
            return Verdict(f"{failure.message}: {_taken(clash)}; retrying on fresh ports "
                           f"({self.port_retries}/{PORT_CLASH_RETRIES})")
        if self.restarts < self.max_restarts:
            self.restarts += 1
            return Verdict(f"{failure.message} after {outcome.seconds:.1f}s; restarting all workers{where} "
                           f"({self.restarts}/{self.max_restarts})")
        if failure.exit_code == cluster.EXIT_PREEMPTED:
            return Verdict(f"{failure.message}; the job was preempted and saved (exit code {cluster.EXIT_PREEMPTED}): "
                           "run the same command to resume it", failure.exit_code)
        return self._end(failure, where)

    def _end(self, failure: Failure, where: str, why: str = "") -> Verdict:
        return Verdict(f"{failure.message}{why}; stopped all workers{where}{self._after_restarts()}", failure.exit_code)

    def _after_restarts(self) -> str:
        return f" after {self.restarts} restart(s)" if self.restarts else ""


def _taken(addresses: list[str]) -> str:
    """'port A was taken by another process before tfdist's worker could listen there' (or ports, workers)."""
    one = len(addresses) == 1
    return (f"port{'' if one else 's'} {', '.join(addresses)} {'was' if one else 'were'} taken by another process "
            f"before tfdist's worker{'' if one else 's'} could listen there")
