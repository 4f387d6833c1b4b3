"""The hang watchdog: a worker stuck in one call, or silent, for longer than the hang timeout stops the job.

``TFDIST_HANG_TIMEOUT`` (``tfdist run --hang-timeout S``) is S in seconds: 600 by default, 0 turns
the watchdog off. It lives in each worker process, started with its multi-worker strategy, so it
works the same however the workers were started (tfdist run, mpirun, srun, Ray, by hand).

Marks. A thread is "in a call" from entering a ``tf.function`` (a Keras train step, a custom loop's
step: ``tfdist.runtime_hooks`` marks them) or one of tfdist's eager collectives
(``tfdist.process_group``) until it returns; ``enter``/``leave`` note the outermost call of each
thread with a few attribute writes. No thread per collective (TensorFlow's own collective timeout
starts one per collective: docs/performance.md).

Heartbeats. One daemon thread per process wakes every S/10 seconds (1 to 10 s). At every wake-up it
publishes this worker's state in TensorFlow's coordination-service key-value store (one small write:
a heartbeat number one higher than the last, its current call or the last one it left and for how
many seconds, whether its CPU was busy since the last wake-up) and reads each peer's. A reader
judges a peer by its own monotonic clock: the time it last saw the peer's heartbeat number change.
Clocks of different hosts are never compared; the seconds a state gives are durations.

Hangs. A worker reports a hang when
* a peer has sent no new heartbeat for S seconds (dead, or frozen: stopped, swapping, or in a C call
  that holds Python's lock), whatever its last state said. A worker that exits publishes that it
  did (atexit): it is gone, not silent;
* a thread of this worker has been in one call for S seconds, waiting (CPU idle) or busy (spinning,
  or computing one call longer than S), unless a peer is busy inside a call it has been in for less
  than S (tracing or computing: progress). So a slow first step (tracing) is not a hang when it takes
  less than S, and S must exceed the longest single call (``fit``: one call per ``steps_per_execution``).
Reporting prints the report (what each worker was doing, how long ago its last heartbeat came, and its
last ``RECENT_CALLS`` calls with their durations: a flight recorder, published with each heartbeat)
and every thread's Python stack, writes the report to the store and exits with ``EXIT_HANG``; every
other worker prints its own stacks and exits with the same code at its next wake-up (worker 0, which
holds the store, last); a reporter that has no peer left to leave with (all silent) exits at once.
While the store does not answer (worker 0 frozen, or gone: a worker 0 that exited takes it along) a
worker publishes nothing and hears no heartbeat; it reports the silence only once it has been in one
call for S seconds itself, and exits at once.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping

import tensorflow as tf
from tfdist import cluster, events, kvstore, stop_signals

ENV = cluster.ENV_HANG_TIMEOUT
EXIT_HANG = cluster.EXIT_HANG
DEFAULT_HANG_TIMEOUT = 600.0
# CPU seconds per second (all threads) under which a process counts as waiting, not working.
IDLE_CPU = 0.05
_PREFIX = "tfdist/watchdog/"

active = False  # whether this process's watchdog runs (tfdist's eager collectives skip their marks otherwise)
_on_start: list[Callable[[], Any]] = []
_local = threading.local()
_marks: list["_Mark"] = []
_marks_lock = threading.Lock()
_started_at = time.monotonic()
RECENT_CALLS = 8
_recent: collections.deque = collections.deque(maxlen=RECENT_CALLS)  # (what, entered, left or None), all threads


class _Mark:
    """The outermost call a thread is in (``depth`` > 0), or the one it last left."""

    __slots__ = ("thread", "depth", "owner", "label", "number", "since", "recent")

    def __init__(self, thread: threading.Thread):
        self.thread, self.depth, self.owner, self.label, self.number, self.since = thread, 0, None, None, 0, time.monotonic()
        self.recent: list = []  # its entry in the flight recorder (``_recent``)

    def describe(self) -> str:
        if self.owner is None:
            return "nothing yet"
        if self.label is None:  # a tf.function
            return f"call {self.number} of tf.function {getattr(self.owner, '_name', '?')!r}"
        ranks = getattr(self.owner, "ranks", None)
        return f"eager {self.label} #{self.number}" + (f" (group of ranks {list(ranks)})" if ranks else "")


def enter(owner: Any, label: str | None = None) -> None:
    """Notes that this thread enters a call of ``owner`` (a tf.function; with ``label``, an eager collective's)."""
    try:
        mark = _local.mark
    except AttributeError:
        mark = _local.mark = _Mark(threading.current_thread())
        with _marks_lock:
            _marks.append(mark)
    mark.depth += 1
    if mark.depth == 1:
        number = owner.__dict__.get("_tfdist_calls", 0) + 1
        owner._tfdist_calls = number
        mark.owner, mark.label, mark.number, mark.since = owner, label, number, time.monotonic()
        mark.recent = [mark.describe(), mark.since, None]
        _recent.append(mark.recent)


def watched(method: Callable) -> Callable:
    """Decorates a ``ProcessGroup`` collective so that its eager calls are marked (``enter``/``leave``) and noted
    for the timeline (``tfdist.events``)."""
    label = f"tfdist.{method.__name__}"

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        if not tf.executing_eagerly():
            return method(group, *args, **kwargs)
        began = time.time()
        if active:
            enter(group, label)
        try:
            return method(group, *args, **kwargs)
        finally:
            if active:
                leave()
            events.span("collective", label, began)

    return run


def leave() -> None:
    """Notes that this thread returned from the call ``enter`` noted."""
    mark = _local.mark
    mark.depth -= 1
    if mark.depth == 0:
        mark.since = mark.recent[2] = time.monotonic()


def on_start(hook: Callable[[], Any]) -> None:
    """Runs ``hook`` when the watchdog starts, or now if it runs (``tfdist.runtime_hooks``' tf.function marks)."""
    if active:
        hook()
    elif hook not in _on_start:
        _on_start.append(hook)


def timeout_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The hang timeout in seconds that ``environ`` (default ``os.environ``) asks for; 0 means off.

    Raises:
        ValueError: the value is not a number of seconds >= 0.
    """
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return DEFAULT_HANG_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{ENV}={raw!r} is not a number of seconds: set it to e.g. {DEFAULT_HANG_TIMEOUT:g} "
                         "(the default), or 0 to turn the hang watchdog off.")
    return value


def start(rank: int, size: int, timeout: float | None = None) -> bool:
    """Starts this process's watchdog thread (once); returns whether it runs.

    Args:
        rank: this worker's rank (0 holds the coordination service).
        size: the job's worker count.
        timeout: seconds; None reads ``TFDIST_HANG_TIMEOUT``. 0 turns it off.
    """
    global active
    timeout = timeout_from_env() if timeout is None else timeout
    if active or timeout <= 0 or size < 2:
        return active
    for hook in _on_start:
        hook()
    active = True
    watchdog = _Watchdog(rank, size, timeout)
    atexit.register(watchdog.publish_exit)
    threading.Thread(target=watchdog.run, name="tfdist-hang-watchdog", daemon=True).start()
    return True


class _Watchdog:
    """Publishes this worker's heartbeat, listens to its peers', and stops the job on a hang."""

    def __init__(self, rank: int, size: int, timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.tick = min(10.0, max(1.0, timeout / 10))
        self.cpu = (time.monotonic(), time.process_time())  # at the last wake-up
        self.pid, self.beat, self.exited, self.lock = os.getpid(), 0, False, threading.Lock()
        self.answered = True  # whether the store answered at the last wake-up
        started = time.monotonic()
        # rank -> (its last state, when this process saw its heartbeat number change)
        self.heard: dict[int, tuple[dict | None, float]] = {r: (None, started) for r in range(size) if r != rank}

    def run(self) -> None:
        # Keys that exist from the start: reading one never leaves a call pending in the store.
        self.publish(self.state(None, False, time.monotonic()))
        if self.rank == 0:
            kvstore.put(_PREFIX + "hang", "")
        while True:
            time.sleep(self.tick)
            try:
                self.check()
            except Exception as err:  # noqa: BLE001  (a watchdog must outlive a bad wake-up)
                print(f"tfdist hang watchdog (worker {self.rank}): {type(err).__name__}: {err}", file=sys.stderr)

    def check(self) -> None:
        now, cpu = time.monotonic(), time.process_time()
        busy = (cpu - self.cpu[1]) / max(now - self.cpu[0], 1e-6) >= IDLE_CPU
        self.cpu = (now, cpu)
        reported = kvstore.get(_PREFIX + "hang")  # it always exists: None means the store did not answer
        self.answered = reported is not None
        if reported:
            reported = json.loads(reported)
            self.stop(f"worker {reported['rank']} reported a hang:\n{reported['report']}", reporter=False)
        mark = _longest_call()
        state = self.state(mark, busy, now)
        if self.answered:  # else a write would wait for the store for ever
            self.publish(state)
            self.listen(now)
        long_call = mark is not None and now - mark.since >= self.timeout
        gone = {r for r, (peer, _) in self.heard.items() if peer and peer["exited"]}
        # Without the store, a silent worker 0 may have exited (taking its store along): only a worker in one call
        # that long reports it.
        silent = [r for r, (_, heard) in self.heard.items()
                  if now - heard >= self.timeout and r not in gone and (self.answered or long_call)]
        stuck = long_call and not any(
            peer and peer["what"] and peer["busy"] and peer["for"] < self.timeout for peer, _ in self.heard.values())
        if silent or stuck:
            self.stop(self.report(state, silent, stuck, now), reporter=True,
                      together=len(silent) + len(gone) < len(self.heard))

    def state(self, mark: "_Mark | None", busy: bool, now: float) -> dict:
        """This worker's state to publish (without its heartbeat number)."""
        latest = mark or max(_marks, key=lambda m: m.since, default=None)
        since = latest.since if latest else _started_at
        return {"what": mark.describe() if mark else None, "last": latest.describe() if latest else "nothing yet",
                "for": round(now - since, 1), "busy": busy, "pid": self.pid, "recent": _recent_calls(now)}

    def publish(self, state: dict, exited: bool = False) -> None:
        """Writes ``state`` with the next heartbeat number; nothing once this worker published that it exited."""
        with self.lock:
            if self.exited:
                return
            self.beat, self.exited = self.beat + 1, exited
            kvstore.put(f"{_PREFIX}state/{self.rank}", json.dumps({**state, "beat": self.beat, "exited": exited}))

    def publish_exit(self) -> None:
        """At the interpreter's exit (atexit): tells the peers this worker is gone, not frozen."""
        if os.getpid() == self.pid and self.answered:  # not in a forked child, nor to a store that would not answer
            self.publish(self.state(None, False, time.monotonic()), exited=True)

    def listen(self, now: float) -> None:
        """Reads every peer's state, noting ``now`` for each one whose heartbeat number changed."""
        for rank, (last, _) in self.heard.items():
            value = kvstore.get(f"{_PREFIX}state/{rank}")
            peer = json.loads(value) if value else None
            if peer is not None and (last is None or peer["beat"] != last["beat"]):
                self.heard[rank] = (peer, now)

    def report(self, mine: dict, silent: list[int], stuck: bool, now: float) -> str:
        """Why this worker stops the job, then each worker's line (``mine``: this worker's state)."""
        why = []
        if silent:
            why.append(f"worker(s) {silent} sent no heartbeat for {self.timeout:g} s or more (hang timeout "
                       f"{self.timeout:g} s): dead, or frozen (stopped, swapping, in a C call holding Python's lock)")
        if silent and not self.answered:
            why.append("the store (in worker 0) does not answer: while worker 0 is frozen or gone, every worker looks "
                       "silent")
        if stuck:
            cpu = "busy (spinning, or one call longer than the timeout)" if mine["busy"] else "idle (waiting)"
            why.append(f"worker {self.rank} has been in {mine['what']} for {mine['for']:.0f} s (hang timeout "
                       f"{self.timeout:g} s) with its CPU {cpu}, and no other worker is busy in a shorter call")
        lines = [f"tfdist hang watchdog: {'; '.join(why)}. Stopping the job (exit code {EXIT_HANG})."]
        if mine["what"]:
            reached = {self.rank} | {r for r, (peer, _) in self.heard.items() if peer and peer["what"] == mine["what"]}
            reached, missing = sorted(reached), sorted(set(range(self.size)) - reached)
            lines.append(f"  {mine['what']}: reached by worker(s) {reached}; not by worker(s) {missing}")
        lines += [f"  {self.describe(rank, mine, silent, now)}" for rank in range(self.size)]
        lines.append(f"  Each worker's last {RECENT_CALLS} calls (tf.functions and eager collectives), oldest first:")
        for rank in range(self.size):
            peer = mine if rank == self.rank else self.heard[rank][0]
            lines.append(f"    worker {rank}: " + ("; ".join(peer.get("recent") or ["none"]) if peer else "unknown"))
        return "\n".join(lines)

    def describe(self, rank: int, mine: dict, silent: list[int], now: float) -> str:
        """Worker ``rank``'s line in a report: what it was doing, and how long ago its last heartbeat came."""
        if rank == self.rank:
            return f"worker {rank} (pid {self.pid}): {_doing(mine)}"
        peer, heard = self.heard[rank]
        ago = now - heard
        if peer is None:
            return f"worker {rank}: silent for {ago:.0f} s; it published no state"
        if peer["exited"]:
            return f"worker {rank} (pid {peer['pid']}): exited (its last heartbeat came {ago:.0f} s ago)"
        if rank in silent:
            return f"worker {rank} (pid {peer['pid']}): silent for {ago:.0f} s; its last heartbeat said: {_doing(peer)}"
        return f"worker {rank} (pid {peer['pid']}): {_doing(peer)}; its last heartbeat came {ago:.0f} s ago"

    def stop(self, report: str, reporter: bool, together: bool = True) -> None:
        """Prints the report with this worker's stacks, publishes it (``reporter``), and exits with EXIT_HANG.

        ``together``: with the peers (``kvstore.leave_together``); False when none can leave (all silent or gone).
        """
        stop_signals.exiting()  # the launcher's SIGTERM, once a peer left, must not turn EXIT_HANG into a kill
        deadline = 2 * self.tick + 10
        last_resort = threading.Timer(deadline + 5, os._exit, (EXIT_HANG,))  # whatever the store does
        last_resort.name, last_resort.daemon = "tfdist-hang-watchdog-exit", True
        last_resort.start()
        atexit.register(os._exit, EXIT_HANG)  # a main thread that fails meanwhile (a peer left) exits with it too
        header = report if reporter else f"tfdist hang watchdog: stopping worker {self.rank}: {report}"
        sys.stderr.write(f"{header}\n{_stacks(self.rank)}"
                         f"Every worker prints its own stacks. {ENV} (tfdist run --hang-timeout) sets the timeout, "
                         "0 turns the watchdog off; see docs/troubleshooting.md.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if reporter and self.answered:  # else the store is frozen or gone: a write would wait for ever
            kvstore.put(_PREFIX + "hang", json.dumps({"rank": self.rank, "report": report}))
        if not (together and self.answered):
            os._exit(EXIT_HANG)
        kvstore.leave_together(_PREFIX, self.rank, self.size, EXIT_HANG, deadline)


def _doing(state: dict) -> str:
    """What a published state says its worker was doing, for how long, and its CPU."""
    where = (f"in {state['what']} for {state['for']:.0f} s" if state["what"]
             else f"in no call for {state['for']:.0f} s (last: {state['last']})")
    return f"{where}, CPU {'busy' if state['busy'] else 'idle'}"


def _recent_calls(now: float) -> list[str]:
    """The flight recorder: this process's last calls, oldest first, with how long each took (or is taking)."""
    return [f"{what} ({(left or now) - entered:.3g} s{'' if left else ', still in it'})"
            for what, entered, left in list(_recent)]


def _longest_call() -> "_Mark | None":
    """The mark of the thread that has been in its current call the longest, if any is in one."""
    inside = [m for m in list(_marks) if m.depth > 0 and m.thread.is_alive()]
    return min(inside, key=lambda m: m.since, default=None)


def _stacks(rank: int) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"Python stacks of worker {rank} (pid {os.getpid()}):\n"]
    for ident, frame in sys._current_frames().items():
        if not str(names.get(ident, "")).startswith("tfdist-hang-watchdog"):
            parts.append(f"  Thread {names.get(ident, ident)}:\n" + "".join(
                "    " + line for line in "".join(traceback.format_stack(frame)).splitlines(True)))
    return "".join(parts)
