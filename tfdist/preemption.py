"""The agreed stop: every worker of a job stops after the same step, whoever asked, and only then.

This module is tfdist's one control plane for stopping a training run together: the state
machine below, its one owner per decision, and the resume position of a ``fit``. Keras' ``fit``
drives it through ``tfdist.keras_fixes.preemption``; custom loops call ``should_stop(step)``
after each step and ``exit_if_preempted()`` after the loop::

    for step in range(start, total):
        train_step(next(iterator))
        if tfdist.should_stop(step + 1):
            manager.save(step + 1)
            break
    tfdist.exit_if_preempted()

Sessions. Every stop belongs to a session: one ``fit`` (opened as it starts, closed when its
steps end or it fails), one custom loop (opened by its first ``should_stop``, closed by
``exit_if_preempted`` or the end of an ``hvd.elastic.run``). Sessions nest (a ``fit`` inside a
callback of another is one on top of it, gone at its end). In a multi-worker job, a session of
the job (a ``fit`` of a model under the job's strategy, a custom loop) is shared: numbered in the
order each worker opens them, which is the same everywhere (every worker runs the same script),
and every key it writes in the coordination service's store (``tfdist.kvstore``) carries that
number, so nothing of one session is read in another. Any other ``fit`` (a model outside the
job's strategy, on one worker) is local: it takes no number and no stop signal.

A round, in shared session n (each transition names the thread that takes it):

1. asked [main thread, or the stop thread]: a callback's ``model.stop_training`` on one worker
   of several (``request``), or a stop signal (``tfdist.stop_signals``) that arrives while a
   session that takes signals is open (otherwise it takes its default action at once). The
   arrival is noted by the stop thread at once, or by the handler in the main thread; the
   stop thread publishes the request (``tfdist/stop/request`` = session n and why).
2. learned [stop thread, or the asking thread]: each worker that reads a request of its session
   makes its next step end look (``check_at``), then publishes the steps it completed
   (``n/report/RANK``). A worker whose session n ended first had published its final step count
   there already: a request never waits for a worker that moved on.
3. agreed step [main thread]: at its next step end, each worker reads every report and takes
   ``S = max(steps) + 1``: no worker can be past it, since a step's collectives need every worker.
   An S beyond the end of the session (a request in its last step) stops nothing.
4. verdict [main thread]: at step S, and else when the steps of a ``fit`` end (before any
   callback's end), every worker publishes whether a stop signal reached it (``n/final/RANK``,
   ``n/end/RANK``) and reads every worker's: a preemption if any did. Every worker decides from
   the same published values, so all of them save and exit ``EXIT_PREEMPTED`` (85) together, or
   none does (a callback's stop: ``fit`` returns on every worker).
5. closed [main thread]: a custom loop's session ends at ``exit_if_preempted``: a stop signal no
   verdict honoured then takes its default action, as any signal outside a session does. A
   session that fails (an error on its way out) hands a signal it did not honour to the next
   session that takes signals; the grace period still runs.

Waits are bounded: a stop a signal asked for ends every wait (reports, verdicts, leaving
together) inside the grace period (``TFDIST_GRACE_PERIOD``, which every launcher sets from
``--grace-period``; default 25 s) with a message saying which worker did not answer; store reads
back off when the store fails. A stop signal that no verdict honours within the grace period (a
step that never ends, a loop that ended without ``exit_if_preempted``) takes its default action
then. A process forked from a worker (``PyDataset(use_multiprocessing=True)``'s pool) gets every
stop signal's default action back and never touches the store (tfdist's launchers signal the
training process itself, not its children).

Cost per step when nothing happens: one Python int compare in ``step_done``.

Epoch ends are agreed by a collective every worker runs there (``tfdist.keras_fixes.preemption``):
a callback's ``stop_training`` set at an epoch's end on one worker stops every worker after that
epoch. The resume position of a ``fit`` (a mid-epoch backup's steps done, an ``hvd.elastic``
commit's batch) is ``resume_at`` in that ``fit``'s session: its first training epoch takes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time

from tfdist import cluster, events, kvstore, stop_signals

EXIT_PREEMPTED = cluster.EXIT_PREEMPTED
_PREFIX = "tfdist/stop/"
_REQUEST = _PREFIX + "request"
POLL_SECONDS = 1.0  # how often the stop thread reads the store for a request
ASKED_TIMEOUT_S = 120.0  # a stop a callback asked for: how long a worker waits for the others' answers
LEAVE_TIMEOUT_S = 20.0
_MARGIN_S = 3.0  # of the grace period, kept for the message and the exit
_TICK_S = 0.1  # how often the stop thread looks at this process's own state


@dataclasses.dataclass(frozen=True)
class Decision:
    """The stop every worker agreed on: after ``step``; ``preempt``: save and exit EXIT_PREEMPTED."""

    step: int
    preempt: bool
    why: str


class _Session:
    """One fit, custom loop or ``hvd.elastic`` run: the scope of its rounds and of its resume position."""

    def __init__(self, number: int, kind: str, shared: bool, takes_signals: bool):
        self.number, self.kind, self.shared, self.takes_signals = number, kind, shared, takes_signals
        self.completed = 0             # steps the main thread completed [main]
        self.check_at = sys.maxsize    # the main thread looks once ``completed`` reaches it [stop thread sets 0]
        self.why: str | None = None    # the request this worker learned of [under the plane's lock]
        self.deadline = float("inf")   # when waits of this round give up (monotonic)
        self.reported = False          # this worker's report is published [under the lock]
        self.asked = False             # this worker published a request [under the lock]
        self.target: int | None = None  # the agreed step [main]
        self.decision: Decision | None = None  # the verdict [main]
        self.closed = False            # [under the lock]
        self.resume_steps = 0          # steps the first training epoch of this fit skips [main]
        self.resume_data = None        # where its training data starts (a tfdist.fit_start.Resume) [main]
        self.first_epoch = True        # the fit's first training epoch is still to come [main]
        self.resume_armed = False      # the next epoch iterator is the fit's first training one [main]
        self.resume_epoch = 0          # and the epoch it trains [main]

    def key(self, what: str, rank: int | None = None) -> str:
        return f"{_PREFIX}{self.number}/{what}" + ("" if rank is None else f"/{rank}")


class _Plane:
    """This process's agreed stop. The main thread owns the sessions and decides; the stop thread only
    publishes (requests, reports), notes signals and runs the grace period out."""

    def __init__(self):
        self.rank, self.size, self.grace = 0, 1, cluster.DEFAULT_GRACE_SECONDS
        self.shared = False  # several workers and a store: shared sessions' rounds go through the store
        self.started = False
        self.watcher: stop_signals.Watcher | None = None
        self.lock = threading.Lock()    # sessions' published state; never taken where a signal is noted
        self.acting = threading.Lock()  # one default action
        self.numbers = 0                # shared sessions opened so far
        self.stack: list[_Session] = []
        self.signalled: str | None = None  # a stop signal this process received and no verdict honoured yet
        self.signalled_at = 0.0            # when (monotonic)
        self.signal_session: _Session | None = None  # the session it asks to stop (None: the next one)
        self.stopping: _Session | None = None  # the session whose verdict was a preemption

    def start(self, rank: int, size: int) -> None:
        self.rank, self.size, self.grace = rank, size, stop_signals.grace_from_env()
        self.shared, self.started = size > 1 and kvstore.available(), True
        signals = stop_signals.signals_from_env() if threading.current_thread() is threading.main_thread() else ()
        if signals:
            self.watcher = stop_signals.Watcher(signals, self.note)
            self.watcher.start()
            cluster.mark_stage("stops")  # tfdist run sends its SIGTERM here, not to this process's children
        if self.shared and rank == 0:
            kvstore.put(_REQUEST, "")  # exists from the start: reading it never leaves a call pending
        if self.shared or signals:
            threading.Thread(target=self.run, name="tfdist-stop", daemon=True).start()

    # Sessions [main thread] -------------------------------------------------------------------

    def open(self, kind: str, of_the_job: bool) -> _Session:
        shared = self.shared and of_the_job
        if shared:
            self.numbers += 1
        session = _Session(self.numbers if shared else 0, kind, shared, takes_signals=shared or not self.shared)
        if self.signalled is not None and self.signal_session is None and session.takes_signals:
            self.signal_session = session  # a signal a failed session left: this one stops for it
            self._note_locally(session)
        with self.lock:
            self.stack.append(session)
        return session

    def top(self) -> _Session | None:
        return self.stack[-1] if self.stack else None

    def close(self, session: _Session, failed: bool = False) -> None:
        """Ends ``session``; a stop signal it did not honour acts now (``failed``: it waits for the next one)."""
        with self.lock:  # no store call under the lock: the stop thread takes it too
            if session in self.stack:
                del self.stack[self.stack.index(session):]
            if session.closed:
                return
            session.closed = True
            report = session.shared and not session.reported
            session.reported = session.reported or report
        if report:
            kvstore.put(session.key("report", self.rank), json.dumps({"step": session.completed, "ended": True}))
        if self.signal_session is not session:
            return
        if failed:
            self.signal_session = None
        elif not (session.decision is not None and session.decision.preempt):
            self._default_action("training ended before an agreed stop could honour it")

    def end_of_steps(self, session: _Session) -> Decision | None:
        """The verdict when a fit's steps end (every worker's ``end`` flag), then the session's end."""
        with self.lock:
            report = session.shared and not session.reported  # a late request must not wait for this worker
            session.reported = session.reported or report
        if report:
            kvstore.put(session.key("report", self.rank), json.dumps({"step": session.completed, "ended": True}))
        if session.decision is None or not session.decision.preempt:
            session.decision = self._verdict(session, "end", session.completed) or session.decision
        self.close(session)
        found = session.decision
        return found if found is not None and found.preempt else None

    # Asking [main thread, stop thread] --------------------------------------------------------

    def note(self, signum: int) -> None:
        """A stop signal arrived (the stop thread or the handler; maybe both for one arrival)."""
        if self.stopping is not None:
            return  # saving for an agreed preemption already: this one exits 85 as it is
        session = self._taking_signals()
        if session is None:
            self._default_action("no training runs to stop at an agreed step", signum)
            return
        if self.signalled is not None or (session.decision is not None and session.decision.preempt):
            return  # one stop at a time: this process is stopping already
        self.signalled_at, self.signal_session = time.monotonic(), session
        self.signalled = signal.Signals(signum).name
        self._note_locally(session)

    def _note_locally(self, session: _Session) -> None:
        if not session.shared:
            session.why, session.check_at = f"{self.signalled} to worker {self.rank}", 0

    def _taking_signals(self) -> _Session | None:
        """The innermost open session that takes stop signals."""
        return next((s for s in reversed(list(self.stack)) if s.takes_signals and not s.closed), None)

    def request(self, why: str) -> None:
        session = self.top()
        if session is None or session.closed:
            return
        if not session.shared:
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
            session.deadline = self._deadline()
            session.check_at = 0
        kvstore.put(session.key("report", self.rank), json.dumps({"step": session.completed, "ended": False}))

    def _deadline(self) -> float:
        """How long an exchange may wait for every worker: inside the grace period of a signal, else ASKED_TIMEOUT_S."""
        if self.signalled is not None:
            return max(time.monotonic() + 1.0, self.signalled_at + self.grace - _MARGIN_S)
        return time.monotonic() + ASKED_TIMEOUT_S

    def run(self) -> None:
        """The stop thread: notes signals, publishes this worker's as a request, learns of requests, runs grace
        periods out."""
        next_read = 0.0
        while True:
            if self.watcher is not None:
                self.watcher.wait(_TICK_S)
            else:
                time.sleep(_TICK_S)
            if self.signalled is not None and time.monotonic() - self.signalled_at > self.grace:
                self._default_action(f"no agreed step honoured it within the grace period ({self.grace:g} s)")
            session = self._taking_signals()
            if session is None or not session.shared:
                continue
            if self.signal_session is session:
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
            if session.shared:
                steps = [int(report["step"]) + 1 for report in self._everyones(session, "report")]
            session.target = session.check_at = max(steps)
        if session.completed < session.target:
            return None
        if session.decision is None:
            session.decision = self._verdict(session, "final", session.target) or \
                Decision(session.target, False, session.why or "")
            events.instant("stop", f"agreed stop after step {session.target}"
                                   f"{' (preempted)' if session.decision.preempt else ''}: {session.decision.why}")
        return session.decision

    def _verdict(self, session: _Session, what: str, step: int) -> Decision | None:
        """A preemption if a stop signal reached any worker in ``session`` (each publishes under ``what``)."""
        signalled = self.signal_session is session and self.signalled is not None
        flags = [{"preempt": signalled, "why": f"{self.signalled} to worker {self.rank}"}]
        if session.shared:
            session.deadline = self._deadline()  # its own: a round's may have passed (a long validation since)
            kvstore.put(session.key(what, self.rank), json.dumps(flags[0]))
            flags = self._everyones(session, what)
        signals = [flag["why"] for flag in flags if flag["preempt"]]
        if not signals:
            return None
        if signalled:
            self.signalled = None  # honoured: this worker saves and exits now
        self.stopping = session
        return Decision(step, True, ", ".join(signals))

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
        """Prints ``message`` (worker 0) and exits EXIT_PREEMPTED with every worker of the stopping session."""
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        session = self.stopping
        if session is not None and session.shared:
            left = min(LEAVE_TIMEOUT_S, max(2.0, session.deadline - time.monotonic()))
            kvstore.leave_together(session.key(""), self.rank, self.size, EXIT_PREEMPTED, left)
        kvstore.leave_together(_PREFIX + "local/", self.rank, 1, EXIT_PREEMPTED, 0)

    # Signals no stop honours ------------------------------------------------------------------

    def _default_action(self, why: str, signum: int | None = None) -> None:
        """A stop signal no verdict honoured ends this process as it would have without tfdist."""
        if not self.acting.acquire(blocking=False):
            return  # another thread (or this one, interrupted by a handler) is ending the process already
        name = self.signalled if signum is None else signal.Signals(signum).name
        self.signalled = None
        if name is None:
            self.acting.release()
            return
        print(f"tfdist: worker {self.rank}: {name} takes its default action: {why}.", file=sys.stderr, flush=True)
        stop_signals.default_action(signal.Signals[name])

    def after_fork_in_child(self) -> None:
        self.stack, self.signalled, self.signal_session = [], None, None
        self.lock, self.acting = threading.Lock(), threading.Lock()


_plane = _Plane()
os.register_at_fork(after_in_child=_plane.after_fork_in_child)


def start(rank: int, size: int) -> bool:
    """Arms the agreed stop in this process (once): this worker's place in the job, the stop signals'
    handlers and the stop thread. Returns whether stop signals are handled (not outside the main thread).
    """
    if not _plane.started:  # from any thread (Ray Train runs the training function in one): only the signal
        _plane.start(rank, size)  # handlers need the main thread
    return armed()


def begin_fit(of_the_job: bool) -> object:
    """Opens the session of a ``fit`` (on top of any open one) and returns it, for ``end_fit``; ``of_the_job``:
    its model is under the job's multi-worker strategy (a shared session), else a local one."""
    return _plane.open("fit", of_the_job)


def end_of_steps() -> Decision | None:
    """A ``fit``'s steps ended (before its callbacks' end): the preemption every worker agreed on, if any;
    the session closes."""
    session = _current("fit")
    return None if session is None else _plane.end_of_steps(session)


def end_fit(session: object, failed: bool = False) -> None:
    """Closes the session ``begin_fit`` returned, if still open: its ``fit`` ``failed`` (an error on its way out),
    or its steps ended without ``end_of_steps``."""
    _plane.close(session, failed)


def end_loop(failed: bool = False) -> None:
    """Closes a custom loop's (or ``hvd.elastic.run``'s) session, if one is open (``failed``: an error on its
    way out)."""
    session = _current("loop")
    if session is not None:
        _plane.close(session, failed)


def _current(kind: str) -> _Session | None:
    session = _plane.top()
    return session if session is not None and session.kind == kind and not session.closed else None


def in_fit() -> bool:
    """Whether a ``fit`` runs (it counts the steps itself; ``should_stop`` is for custom loops)."""
    return _current("fit") is not None


def request(why: str) -> None:
    """Asks every worker to stop after one agreed step (idempotent within a session)."""
    _plane.request(why)


def step_done() -> Decision | None:
    """Counts a completed step of the ``fit`` (Keras' batch end); returns the agreed stop once this is its step."""
    session = _plane.top()
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
    session = _current("loop") or _plane.open("loop", of_the_job=True)
    session.completed = step
    if step < session.check_at:
        return False
    return _plane.decide(session) is not None


def decision() -> Decision | None:
    """The stop agreed in the current session, once this worker reached its step."""
    session = _plane.top()
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


def resume_at(steps: int, data=None) -> None:
    """Makes the first training epoch of the running ``fit`` start at step ``steps`` (a mid-epoch resume);
    ``data``: where its data starts (a ``tfdist.fit_start.Resume``), for the dataset that trains."""
    session = _current("fit")
    if session is not None:
        session.resume_steps, session.resume_data = steps, data


def arm_resume(epoch: int) -> None:
    """The running ``fit``'s next epoch iterator is its training one for ``epoch`` (``fit`` enumerates it right
    after its callbacks' ``on_epoch_begin``): it, and no evaluation before it, takes the resume position."""
    session = _current("fit")
    if session is not None:
        session.resume_armed, session.resume_epoch = session.first_epoch, epoch


def take_resume() -> tuple[int, object, int] | None:
    """For the running ``fit``'s first training epoch, once: ``(steps it skips, where its data starts, the
    epoch)`` (``resume_at``'s; 0 and None for a fit from its start). None for every other epoch iterator."""
    session = _current("fit")
    if session is None or not session.resume_armed:
        return None
    session.first_epoch = session.resume_armed = False
    taken = (session.resume_steps, session.resume_data, session.resume_epoch)
    session.resume_steps, session.resume_data = 0, None
    return taken


def armed() -> bool:
    """Whether stop signals are handled in this process."""
    return _plane.watcher is not None


def rank() -> int:
    return _plane.rank
