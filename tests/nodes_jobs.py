"""Runs the launchers of a multi-node job (`tfdist run --nnodes`) for tests, with hard timeouts.

Each node is a `tfdist run` process, on this machine or inside a network namespace
(``tests.netns``); every one is killed if the test gives up on it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from typing import Callable, Sequence

from tests.jobs import job_env

TOKEN = "test-token-0123"


@dataclasses.dataclass
class NodeResult:
    returncode: int
    output: str


def node_command(rank: int | None, nnodes: int | str, master: str, worker: Sequence[str], *launcher_args: str,
                 num_workers: int = 1, timeout: float = 120) -> list[str]:
    """A node's ``tfdist run``; ``rank=None`` leaves --node-rank out (the master numbers the node)."""
    return [sys.executable, "-m", "tfdist.run", "--nnodes", str(nnodes), *([] if rank is None else ["--node-rank", str(rank)]),
            "--master", master, "-n", str(num_workers), "--timeout", str(timeout), "--grace-period", "2",
            *launcher_args, "--", *worker]


def start_node(command: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """One launcher, started now (the caller kills it: see ``stopped``)."""
    return subprocess.Popen(list(command), env=job_env({"TFDIST_TOKEN": TOKEN, **(env or {})}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Polls ``check`` until it holds; fails the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def finish(processes: Sequence[subprocess.Popen], timeout: float = 150) -> list[NodeResult]:
    """Waits for every launcher and returns their results; kills all of them on a timeout.

    Called while an exception is on its way (a ``finally`` after a failed wait) it does not wait:
    it kills the launchers at once and prints what they said (those that had ended too), so the
    test's error shows it. On its own timeout it raises an AssertionError holding each launcher's
    last output.
    """
    failing = sys.exc_info()[0] is not None
    deadline = time.monotonic() + (0 if failing else timeout)
    outputs: list[str] = []

    def tails() -> str:
        return "\n".join(f"--- launcher {i} (pid {p.pid}, exit {p.returncode}) said:\n{out[-4000:]}"
                         for i, (p, out) in enumerate(zip(processes, outputs)))
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(0.1 if failing else 1.0, deadline - time.monotonic()))[0])
        if failing:
            print(tails())
        return [NodeResult(p.returncode, out) for p, out in zip(processes, outputs)]
    except subprocess.TimeoutExpired:
        for process in processes[len(outputs):]:
            process.kill()
            outputs.append(process.communicate()[0] or "")
        if failing:
            print(tails())
            return [NodeResult(p.returncode, out) for p, out in zip(processes, outputs)]
        raise AssertionError(f"the launchers did not finish within {timeout:g}s\n{tails()}") from None
    finally:
        for process in processes:
            process.kill()
            process.wait()


def run_nodes(commands: Sequence[Sequence[str]], env: dict[str, str] | None = None, timeout: float = 150,
              tokens: Sequence[str] | None = None, stagger: float = 0.0,
              between: Callable[[int], None] | None = None) -> list[NodeResult]:
    """Starts one launcher per command (``stagger`` seconds apart), waits for all; kills all on a timeout.

    ``between(i)`` runs before launcher i starts (e.g. to wait for an earlier one to exit).
    """
    processes = []
    try:
        for i, command in enumerate(commands):
            if between is not None:
                between(i)
            elif i and stagger:
                time.sleep(stagger)
            token = tokens[i] if tokens else TOKEN
            processes.append(subprocess.Popen(list(command), env=job_env({"TFDIST_TOKEN": token, **(env or {})}),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    except BaseException:
        for process in processes:
            process.kill()  # a launcher started before the error must not outlive it; finish reaps it
        finish(processes)
        raise
    return finish(processes, timeout)
