"""The agreed stop: every worker of a job stops after the same step, whoever asked.

A stop is asked for by a signal (``TFDIST_STOP_SIGNALS``, default SIGTERM and SIGUSR1) to any
worker while it trains, or by ``request`` (tfdist's Keras fix asks when a callback sets
``model.stop_training`` mid-epoch on one worker). The asking worker writes a request to the
coordination service's key-value store (``tfdist.kvstore``); a daemon thread per worker reads it
there once a second. On learning of a request, each worker's thread publishes the steps its
main thread has completed; at its next step end the main thread waits for every worker's
report and stops after step ``max(reports) + 1``: no worker can be past it, since a step's
collectives need every worker. A signal makes it a preemption: every worker saves and exits
``EXIT_PREEMPTED`` (85). Per step, when nothing happens, the cost is one Python int compare.

Keras' ``fit`` uses it through ``tfdist.keras_fixes.preemption``; custom loops call
``should_stop(step)`` after each step and ``exit_if_preempted()`` after saving::

    for step in range(start, total):
        train_step(next(iterator))
        if tfdist.should_stop(step + 1):
            manager.save(step + 1)
            break
    tfdist.exit_if_preempted()

One worker (no store) stops at its own next step end. A signal outside training (before the
first step, after the last) does what it did before: the default action.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Mapping

from tfdist import cluster, kvstore

EXIT_PREEMPTED = cluster.EXIT_PREEMPTED
ENV_SIGNALS = cluster.ENV_STOP_SIGNALS
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
_PREFIX = "tfdist/stop/"
_REQUEST = _PREFIX + "request"
POLL_SECONDS = 1.0
REPORT_TIMEOUT_S = 120.0
LEAVE_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """The stop every worker agreed on: after ``step``; ``preempt``: save and exit EXIT_PREEMPTED."""

    step: int
    preempt: bool
    why: str


class _State:
    rank, size, started = 0, 1, False
    training: str | None = None  # "fit" (Keras) or "loop" (should_stop was called): a signal now asks for a stop
    completed = 0          # steps the main thread completed
    check_at = sys.maxsize  # the main thread looks at the request once ``completed`` reaches it
    round = 0              # stops agreed so far in this process (a later fit may stop again)
    requested = False      # this worker knows of this round's request
    signalled: str | None = None
    why = ""
    decision: Decision | None = None
    lock = threading.RLock()  # the signal handler may run in the main thread while it holds it


def signals_from_env(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """The stop signals ``TFDIST_STOP_SIGNALS`` names (default SIGTERM,SIGUSR1; "" none).

    Raises:
        ValueError: a name that is not a signal.
    """
    raw = (os.environ if environ is None else environ).get(ENV_SIGNALS, DEFAULT_SIGNALS)
    found = []
    for name in filter(None, (part.strip().upper() for part in raw.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{ENV_SIGNALS}={raw!r}: {name} is not a signal a process can catch; give names "
                             f"such as {DEFAULT_SIGNALS} (the default), or '' to keep each signal's default action.")
        found.append(signal.Signals[name])
    return tuple(found)


def start(rank: int, size: int) -> bool:
    """Arms the agreed stop in this process (once): the signal handlers and, with several workers, the thread.

    Returns whether signals are handled (not outside the main thread, nor with no stop signals).
    """
    if _State.started:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    stop_signals = signals_from_env()
    if not stop_signals:
        return False
    _State.rank, _State.size, _State.started = rank, size, True
    for sig in stop_signals:
        signal.signal(sig, _on_signal)
    if size > 1 and kvstore.available():
        if rank == 0:
            kvstore.put(_REQUEST, "")  # exists from the start: reading it never leaves a call pending
        threading.Thread(target=_listen, name="tfdist-stop-listener", daemon=True).start()
    return True


def training(on: bool) -> None:
    """Notes that Keras' fit runs (signals ask for a stop) or ended (signals do what they did before)."""
    _State.training = "fit" if on else None


def in_fit() -> bool:
    """Whether Keras' fit runs (it counts the steps itself; ``should_stop`` is for custom loops)."""
    return _State.training == "fit"


def _on_signal(signum, frame) -> None:
    if not _State.training:
        signal.signal(signum, signal.SIG_DFL)  # not training: nothing to save; act as if unhandled
        signal.raise_signal(signum)
        return
    if _State.signalled is None:
        _State.signalled = signal.Signals(signum).name
        request(f"{_State.signalled} to worker {_State.rank}")


def request(why: str) -> None:
    """Asks every worker to stop after one agreed step (idempotent within a round)."""
    kvstore.put(_REQUEST, json.dumps({"round": _State.round, "why": why}))
    _learn(why)


def _listen() -> None:
    while True:
        value = kvstore.get(_REQUEST)
        if value:
            asked = json.loads(value)
            if asked["round"] == _State.round:
                _learn(asked["why"])
        time.sleep(POLL_SECONDS)


def _learn(why: str) -> None:
    """Publishes the steps completed so far, after making the next step end look (the order matters)."""
    with _State.lock:
        if _State.requested:
            return
        _State.requested, _State.why = True, why
        _State.check_at = 0
        report = {"step": _State.completed, "preempt": _State.signalled is not None}
        kvstore.put(f"{_PREFIX}{_State.round}/report/{_State.rank}", json.dumps(report))


def step_done() -> Decision | None:
    """Counts a completed step (Keras' batch end); returns the agreed stop once this is its step."""
    _State.completed += 1
    if _State.completed < _State.check_at:
        return None
    return _decide()


def should_stop(step: int) -> bool:
    """Call after each step of a custom loop with the steps completed: True at the step every worker stops after.

    Args:
        step: steps completed so far (the same count on every worker).
    """
    _State.training = _State.training or "loop"
    _State.completed = step
    if step < _State.check_at:
        return False
    return _decide() is not None


def _decide() -> Decision | None:
    if _State.decision is None:
        steps, preempt = [_State.completed], _State.signalled is not None
        if _State.size > 1 and kvstore.available():
            reports = [_report(rank) for rank in range(_State.size)]
            steps = [r["step"] + 1 for r in reports]
            preempt = preempt or any(r["preempt"] for r in reports)
        _State.decision = Decision(max(steps), preempt, _State.why)
        _State.check_at = _State.decision.step
    return _State.decision if _State.completed >= _State.decision.step else None


def _report(rank: int) -> dict:
    end = time.monotonic() + REPORT_TIMEOUT_S
    key = f"{_PREFIX}{_State.round}/report/{rank}"
    while time.monotonic() < end:
        value = kvstore.get(key, 5000)
        if value:
            return json.loads(value)
    raise RuntimeError(f"tfdist: worker {_State.rank} asked every worker to stop ({_State.why}), but worker {rank} "
                       f"did not answer within {REPORT_TIMEOUT_S:g} s (it may have died): stopping without saving.")


def decision() -> Decision | None:
    """The stop agreed in this round, once this worker reached its step."""
    found = _State.decision
    return found if found is not None and _State.completed >= found.step else None


def next_round() -> None:
    """After a stop that ends training without exiting (a callback's): a later request is a new round."""
    with _State.lock:
        _State.round += 1
        _State.requested, _State.decision, _State.check_at, _State.why = False, None, sys.maxsize, ""


def exit_preempted(message: str) -> None:
    """Prints ``message`` (worker 0), waits for every worker to get here, and exits EXIT_PREEMPTED."""
    if _State.rank == 0:
        print(message, file=sys.stderr, flush=True)
    kvstore.leave_together(f"{_PREFIX}{_State.round}/", _State.rank, _State.size, EXIT_PREEMPTED, LEAVE_TIMEOUT_S)


def exit_if_preempted() -> None:
    """In a custom loop, after saving at the step ``should_stop`` returned True for: exits EXIT_PREEMPTED
    (85) when the stop was a preemption (a signal), on every worker together; else returns."""
    found = decision()
    if found is not None and found.preempt:
        exit_preempted(f"tfdist: preempted ({found.why}): every worker stopped after step {found.step}; "
                       f"exiting with code {EXIT_PREEMPTED}")


def armed() -> bool:
    """Whether stop signals are handled in this process (``start`` ran)."""
    return _State.started


def rank() -> int:
    return _State.rank
