"""The agreed stop: every worker of a job stops after the same step, whoever asked, and only then.

This module is tfdist's one control plane for stopping a training run together: the state
machine below, its one owner per decision, and the resume position of the next ``fit``.
Keras' ``fit`` drives it through ``tfdist.keras_fixes.preemption``; custom loops call
``should_stop(step)`` after each step and ``exit_if_preempted()`` after the loop::

    for step in range(start, total):
        train_step(next(iterator))
        if tfdist.should_stop(step + 1):
            manager.save(step + 1)
            break
    tfdist.exit_if_preempted()

Sessions. Every stop belongs to a session: one ``fit`` (opened as it starts, closed when its
steps end or it fails), one custom loop (opened by its first ``should_stop``, closed by
``exit_if_preempted``, a ``fit`` or the end of an ``hvd.elastic.run``). Sessions are numbered in
the order a process opens them, which is the same on every worker (every worker runs the same
script), and every key in the coordination service's store (``tfdist.kvstore``) carries that
number: nothing of one session is read in another.

A round, in session n (each transition names the thread that takes it):

1. asked [main thread or listener]: a callback's ``model.stop_training`` on one worker of several
   (``request``), or a stop signal (``TFDIST_STOP_SIGNALS``, default SIGTERM,SIGUSR1). The signal
   handler only notes the signal and wakes the listener thread; the listener publishes the
   request (``tfdist/stop/request`` = session n and why).
2. learned [listener, or the asking thread]: each worker that reads a request of its current
   session makes its next step end look (``check_at``), then publishes the steps it completed
   (``n/report/RANK``). A worker whose session n ended first had published its final step count
   there already, marked ended: a request never waits for a worker that moved on.
3. agreed step [main thread]: at its next step end, each worker reads every report and takes
   ``S = max(steps) + 1``: no worker can be past it, since a step's collectives need every worker.
   An S beyond the end of the session (a request in its last step) means no stop: the session
   ends as it would have.
4. verdict [main thread, at step S]: every worker publishes whether a stop signal reached it
   (``n/final/RANK``) and reads every worker's: a preemption if any did. Every worker decides
   from the same published values, so every worker reaches the same verdict: a preemption saves
   and exits ``EXIT_PREEMPTED`` (85) on every worker together; otherwise training ends normally
   (``fit`` returns) on every worker.
5. closed [main thread]: the session ends (its ``fit`` ended, its loop called
   ``exit_if_preempted``): a round still open is dropped, and a stop signal that no verdict
   honoured (it arrived too late for this session's last step, or after the verdict) now takes
   its default action, as any signal outside a session does.

Waits are bounded: a stop a signal asked for ends every wait (reports, verdicts, leaving
together) inside the grace period (``TFDIST_GRACE_PERIOD``, which ``tfdist run --grace-period``
sets; default 25 s) with a message saying which worker did not answer; store reads back off
when the store fails. A stop signal that no step honours within the grace period (a loop that
ended without ``exit_if_preempted``, a step that never ends) takes its default action then.
A process forked from a worker (``PyDataset(use_multiprocessing=True)``'s pool) gets every stop
signal's default action back and never touches the store.

Cost per step when nothing happens: one Python int compare in ``step_done``.

Epoch ends are agreed by a collective every worker runs there (``tfdist.keras_fixes.preemption``):
a callback's ``stop_training`` set at an epoch's end on one worker stops every worker after that
epoch. The resume position of the next ``fit`` (a mid-epoch backup's steps done, an
``hvd.elastic`` commit's batch) is ``resume_at`` in that ``fit``'s session, and ends with it.
"""

from __future__ import annotations

import ctypes
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
ASKED_TIMEOUT_S = 120.0  # a stop a callback asked for: how long a worker waits for the others' answers
LEAVE_TIMEOUT_S = 20.0
_TICK_S = 0.1  # how often the stop thread looks at this process's own flags (the store: every POLL_SECONDS)
_libc = ctypes.CDLL(None)  # loaded now: the stop thread may need libc's signal() late
_MARGIN_S = 3.0  # of the grace period, kept for the message and the exit


@dataclasses.dataclass(frozen=True)
class Decision:
    """The stop every worker agreed on: after ``step``; ``preempt``: save and exit EXIT_PREEMPTED."""

    step: int
    preempt: bool
    why: str


class _Session:
    """One fit, custom loop or ``hvd.elastic`` run: the scope of its rounds and of its resume position."""

    def __init__(self, number: int, kind: str):
        self.number, self.kind = number, kind
        self.completed = 0             # steps the main thread completed [main]
        self.check_at = sys.maxsize    # the main thread looks once ``completed`` reaches it [listener sets 0]
        self.why: str | None = None    # the request this worker learned of [under the plane's lock]
        self.deadline = float("inf")   # when waits of this round give up (monotonic)
        self.reported = False          # this worker's report is published [under the lock]
        self.asked = False             # this worker published a request [under the lock]
        self.target: int | None = None  # the agreed step [main]
        self.decision: Decision | None = None  # the verdict, at the agreed step [main]
        self.closed = False            # [under the lock]
        self.resume_steps = 0          # steps the first epoch of this fit skips (a mid-epoch resume) [main]

    def key(self, what: str, rank: int | None = None) -> str:
        return f"{_PREFIX}{self.number}/{what}" + ("" if rank is None else f"/{rank}")


class _Plane:
    """This process's agreed stop. The main thread owns the sessions and decides; the stop thread only
    publishes (requests, reports) and runs the grace period out; the signal handler only notes a signal."""

    def __init__(self):
        self.rank, self.size, self.signals, self.grace = 0, 1, (), cluster.DEFAULT_GRACE_SECONDS
        self.shared = False  # several workers and a store: rounds go through the store
        self.started = False
        self.lock = threading.Lock()  # never taken by the signal handler
        self.sessions = 0
        self.session: _Session | None = None
        self.signalled: str | None = None  # a stop signal this process received and no verdict honoured yet
        self.signalled_at = 0.0            # when (monotonic)
        self.signal_session = 0            # the session it arrived in
        self.forked = False

    def start(self, rank: int, size: int, signals: tuple[signal.Signals, ...], grace: float) -> None:
        self.rank, self.size, self.signals, self.grace = rank, size, signals, grace
        self.shared, self.started = size > 1 and kvstore.available(), True
        for sig in signals:
            signal.signal(sig, self.on_signal)
        os.register_at_fork(after_in_child=self.after_fork_in_child)
        if self.shared and rank == 0:
            kvstore.put(_REQUEST, "")  # exists from the start: reading it never leaves a call pending
        if self.shared or signals:
            threading.Thread(target=self.run, name="tfdist-stop", daemon=True).start()

    # Sessions [main thread] -------------------------------------------------------------------

    def open(self, kind: str) -> _Session:
        self.close()
        self.sessions += 1
        with self.lock:
            self.session = _Session(self.sessions, kind)
        return self.session

    def close(self, failed: bool = False) -> None:
        """Ends the session; a stop signal it did not honour acts now (``failed``: once the error has been
        raised, within the grace period, so that the error is seen first)."""
        session = self.session
        if session is None or session.closed:
            return
        with self.lock:
            session.closed = True
            if self.shared and not session.reported:
                session.reported = True
                kvstore.put(session.key("report", self.rank), json.dumps({"step": session.completed, "ended": True}))
        if self.signalled is not None and self.signal_session == session.number and not failed and not (
                session.decision is not None and session.decision.preempt):
            self._default_action("training ended before the agreed stop it asked for")

    # Asking [signal handler, main thread, listener] -------------------------------------------

    def on_signal(self, signum: int, frame) -> None:
        session = self.session
        if self.forked or session is None or session.closed:
            signal.signal(signum, signal.SIG_DFL)  # not training: nothing to save; act as if unhandled
            signal.raise_signal(signum)
            return
        if self.signalled is not None or (session.decision is not None and session.decision.preempt):
            return  # one stop at a time: this process is stopping already
        # No locks here (the main thread may hold one): plain writes the stop thread acts on.
        self.signalled_at, self.signal_session = time.monotonic(), session.number
        self.signalled = signal.Signals(signum).name
        if not self.shared:
            session.why, session.check_at = f"{self.signalled} to worker {self.rank}", 0

    def request(self, why: str) -> None:
        session = self.session
        if session is None or session.closed:
            return
        if not self.shared:
            session.why, session.check_at = session.why or why, 0
            return
        self._ask(session, why, signalled=False)

    def _ask(self, session: _Session, why: str, signalled: bool) -> None:
        with self.lock:
            if session.asked or session.closed:
                return
            session.asked = True
        kvstore.put(_REQUEST, json.dumps({"session": session.number, "why": why, "signal": signalled}))
        self._learn(session, why, signalled)

    def _learn(self, session: _Session, why: str, signalled: bool) -> None:
        """Publishes the steps completed so far, after making the next step end look (the order matters)."""
        with self.lock:
            if session.reported or session.closed:
                return
            session.why, session.reported = why, True
            session.deadline = time.monotonic() + (max(1.0, self.grace - _MARGIN_S) if signalled else ASKED_TIMEOUT_S)
            session.check_at = 0
            kvstore.put(session.key("report", self.rank), json.dumps({"step": session.completed, "ended": False}))

    def run(self) -> None:
        """The stop thread: publishes this worker's signal as a request, learns of requests, runs grace periods out."""
        next_read = 0.0
        while not self.forked:
            time.sleep(_TICK_S)
            if self.signalled is not None and time.monotonic() - self.signalled_at > self.grace:
                self._default_action(f"no agreed step honoured it within the grace period ({self.grace:g} s)")
            session = self.session
            if not self.shared or session is None or session.closed:
                continue
            if self.signalled is not None and self.signal_session == session.number:
                self._ask(session, f"{self.signalled} to worker {self.rank}", signalled=True)
            if time.monotonic() >= next_read and not session.reported:
                next_read = time.monotonic() + POLL_SECONDS
                value = kvstore.get(_REQUEST)
                asked = json.loads(value) if value else None
                if asked and asked["session"] == session.number:
                    self._learn(session, asked["why"], asked["signal"])

    # Deciding [main thread] -------------------------------------------------------------------

    def decide(self, session: _Session) -> Decision | None:
        if session.target is None:
            steps = [session.completed]
            if self.shared:
                steps = [int(report["step"]) + 1 for report in self._everyones(session, "report")]
            session.target = session.check_at = max(steps)
        if session.completed < session.target:
            return None
        if session.decision is None:
            signalled = self.signalled is not None and self.signal_session == session.number
            finals = [{"preempt": signalled, "why": f"{self.signalled} to worker {self.rank}"}]
            if self.shared:
                kvstore.put(session.key("final", self.rank), json.dumps(finals[0]))
                finals = self._everyones(session, "final")
            signals = [final["why"] for final in finals if final["preempt"]]
            session.decision = Decision(session.target, bool(signals), ", ".join(signals) or session.why or "")
            if session.decision.preempt:
                self.signalled = None  # honoured: this worker saves and exits now
        return session.decision

    def _everyones(self, session: _Session, what: str) -> list[dict]:
        found = []
        for rank in range(self.size):
            value = kvstore.wait_for(session.key(what, rank), session.deadline)
            if value is None:
                raise RuntimeError(
                    f"tfdist: worker {self.rank} agreed to stop with every worker ({session.why}), but worker {rank} "
                    f"did not answer in time (it may have died, or be stuck in a step): stopping without saving.")
            found.append(json.loads(value))
        return found

    def leave_preempted(self, message: str) -> None:
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        session = self.session
        left = min(LEAVE_TIMEOUT_S, max(2.0, session.deadline - time.monotonic()))
        kvstore.leave_together(session.key(""), self.rank, self.size if self.shared else 1, EXIT_PREEMPTED, left)

    # Signals no stop honours ------------------------------------------------------------------

    def _default_action(self, why: str) -> None:
        """The stop signal no verdict honoured ends this process as it would have without tfdist."""
        name, self.signalled = self.signalled, None
        if name is None:
            return
        print(f"tfdist: worker {self.rank}: {name} now takes its default action: {why}.", file=sys.stderr, flush=True)
        sig = signal.Signals[name]
        if threading.current_thread() is threading.main_thread():
            signal.signal(sig, signal.SIG_DFL)
        else:  # only the main thread may use the signal module
            _libc.signal(int(sig), 0)  # SIG_DFL
        os.kill(os.getpid(), sig)

    def after_fork_in_child(self) -> None:
        self.forked, self.session, self.signalled = True, None, None
        for sig in self.signals:
            signal.signal(sig, signal.SIG_DFL)


_plane = _Plane()


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


def grace_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The grace period ``TFDIST_GRACE_PERIOD`` gives (seconds; default 25).

    Raises:
        ValueError: not a number of seconds >= 0.
    """
    raw = (os.environ if environ is None else environ).get(cluster.ENV_GRACE_PERIOD, "").strip()
    if not raw:
        return cluster.DEFAULT_GRACE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{cluster.ENV_GRACE_PERIOD}={raw!r} is not a number of seconds: set it to the time between "
                         f"a stop signal and SIGKILL, e.g. {cluster.DEFAULT_GRACE_SECONDS:g} (tfdist run "
                         "--grace-period sets it).")
    return value


def start(rank: int, size: int) -> bool:
    """Arms the agreed stop in this process (once): this worker's place in the job, the signal handlers
    and the stop thread. Returns whether signals are handled (not outside the main thread, nor with none).
    """
    if _plane.started:
        return bool(_plane.signals)
    if threading.current_thread() is not threading.main_thread():
        return False
    _plane.start(rank, size, signals_from_env(), grace_from_env())
    return bool(_plane.signals)


def begin_fit() -> None:
    """Opens the session of a ``fit`` (closing any other): a signal now asks for a stop."""
    _plane.open("fit")


def end_fit(failed: bool = False) -> None:
    """Closes the ``fit``'s session, if still open: its steps ended, or it ``failed`` (an error on its way out)."""
    if _current("fit") is not None:
        _plane.close(failed)


def end_loop() -> None:
    """Closes a custom loop's (or ``hvd.elastic.run``'s) session, if one is open."""
    if _current("loop") is not None:
        _plane.close()


def _current(kind: str) -> _Session | None:
    session = _plane.session
    return session if session is not None and session.kind == kind and not session.closed else None


def in_fit() -> bool:
    """Whether a ``fit`` runs (it counts the steps itself; ``should_stop`` is for custom loops)."""
    return _current("fit") is not None


def request(why: str) -> None:
    """Asks every worker to stop after one agreed step (idempotent within a session)."""
    _plane.request(why)


def step_done() -> Decision | None:
    """Counts a completed step of the ``fit`` (Keras' batch end); returns the agreed stop once this is its step."""
    session = _plane.session
    if session is None:
        return None
    session.completed += 1
    if session.completed < session.check_at:
        return None
    return _plane.decide(session)


def should_stop(step: int) -> bool:
    """Call after each step of a custom loop with the steps completed: True at the step every worker stops after.

    The first call opens the loop's session (a stop signal then asks for a stop); ``exit_if_preempted``
    after the loop closes it.

    Args:
        step: steps completed so far (the same count on every worker).
    """
    session = _current("loop") or _plane.open("loop")
    session.completed = step
    if step < session.check_at:
        return False
    return _plane.decide(session) is not None


def decision() -> Decision | None:
    """The stop agreed in the current session, once this worker reached its step."""
    session = _plane.session
    return session.decision if session is not None else None


def exit_preempted(message: str) -> None:
    """Prints ``message`` (worker 0), waits for every worker to get here, and exits EXIT_PREEMPTED."""
    _plane.leave_preempted(message)


def exit_if_preempted() -> None:
    """After a custom loop (and after saving at the step ``should_stop`` returned True for): exits EXIT_PREEMPTED
    (85) when the stop was a preemption (a signal), on every worker together; else closes the loop's session
    (a stop signal from now on takes its default action) and returns."""
    found = decision()
    if found is not None and found.preempt:
        exit_preempted(f"tfdist: preempted ({found.why}): every worker stopped after step {found.step}; "
                       f"exiting with code {EXIT_PREEMPTED}")
    end_loop()


def resume_at(steps: int) -> None:
    """Makes the first epoch of the running ``fit`` start at step ``steps`` (a mid-epoch resume)."""
    session = _current("fit")
    if session is not None:
        session.resume_steps = steps


def take_resume() -> int:
    """The steps the running ``fit``'s first epoch skips, once (0 afterwards)."""
    session = _current("fit")
    if session is None:
        return 0
    steps, session.resume_steps = session.resume_steps, 0
    return steps


def armed() -> bool:
    """Whether stop signals are handled in this process."""
    return bool(_plane.signals)


def rank() -> int:
    return _plane.rank
