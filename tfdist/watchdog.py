"""The hang watchdog: a worker that waits in a collective longer than the hang timeout stops the job.

``TFDIST_HANG_TIMEOUT`` (``tfdist run --hang-timeout S``) is S in seconds: 600 by default, 0 turns
the watchdog off. It lives in each worker process, started with its multi-worker strategy, so it
works the same however the workers were started (tfdist run, mpirun, srun, Ray, by hand).

Marks. A thread is "in a call" from entering a ``tf.function`` (a Keras train step, a custom loop's
step: ``tfdist.runtime_hooks`` marks them) or one of tfdist's eager collectives
(``tfdist.process_group``) until it returns; ``enter``/``leave`` note the outermost call of each
thread with a few attribute writes. No thread per collective (TensorFlow's own collective timeout
starts one per collective: docs/performance.md).

One daemon thread per process wakes every S/10 seconds (1 to 10 s). It publishes this worker's
state (its current call, since when, whether its CPU is busy) in TensorFlow's coordination-service
key-value store when it changes, and stops this worker when another one reported a hang there. It
reports a hang when a thread of this worker has been in the same call for S seconds while the
process used almost no CPU (waiting, not computing or tracing) or while a peer has been out of any
call that long, unless a peer is busy inside a call (still tracing or computing: progress, not a
hang). Reporting writes the report to the store, prints it and every thread's Python stack, and
exits with ``EXIT_HANG``; every other worker prints its own stack and exits with the same code at
its next wake-up (worker 0, which holds the store, last).
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
from tfdist import cluster, kvstore

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


class _Mark:
    """The outermost call a thread is in (``depth`` > 0), or the one it last left."""

    __slots__ = ("thread", "depth", "owner", "label", "number", "since")

    def __init__(self, thread: threading.Thread):
        self.thread, self.depth, self.owner, self.label, self.number, self.since = thread, 0, None, None, 0, time.monotonic()

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


def watched(method: Callable) -> Callable:
    """Decorates a ``ProcessGroup`` collective so that its eager calls are marked (``enter``/``leave``)."""
    label = f"tfdist.{method.__name__}"

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        if not active or not tf.executing_eagerly():
            return method(group, *args, **kwargs)
        enter(group, label)
        try:
            return method(group, *args, **kwargs)
        finally:
            leave()

    return run


def leave() -> None:
    """Notes that this thread returned from the call ``enter`` noted."""
    mark = _local.mark
    mark.depth -= 1
    if mark.depth == 0:
        mark.since = time.monotonic()


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
    threading.Thread(target=_Watchdog(rank, size, timeout).run, name="tfdist-hang-watchdog", daemon=True).start()
    return True


class _Watchdog:
    def __init__(self, rank: int, size: int, timeout: float):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.tick = min(10.0, max(1.0, timeout / 10))
        self.cpu = collections.deque([(time.monotonic(), time.process_time())])  # (monotonic, CPU seconds)
        self.published: tuple | None = None

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
        self.cpu.append((now, cpu))
        while len(self.cpu) > 2 and self.cpu[1][0] <= now - self.timeout:
            self.cpu.popleft()
        reported = kvstore.get(_PREFIX + "hang")
        if reported:
            reported = json.loads(reported)
            self.stop(f"worker {reported['rank']} reported a hang:\n{reported['report']}", reporter=False)
        previous = self.cpu[-2]
        busy = (cpu - previous[1]) / max(now - previous[0], 1e-6) >= IDLE_CPU
        mark = _longest_call()
        state = self.state(mark, busy, now)
        self.publish(state)
        if mark is None or now - mark.since < self.timeout:
            return
        oldest = self.cpu[0]
        idle = now - oldest[0] >= 0.9 * self.timeout and (cpu - oldest[1]) / (now - oldest[0]) < IDLE_CPU
        peers = self.peers(state)
        if any(p.get("what") and p.get("busy") for r, p in peers.items() if r != self.rank):
            return  # a peer is still tracing or computing inside a call: progress
        out_long = [r for r, p in peers.items() if not p.get("what") and time.time() - p["since"] >= self.timeout]
        if idle or out_long:
            self.stop(self.report(mark, peers, idle, now), reporter=True)

    def state(self, mark: "_Mark | None", busy: bool, now: float) -> dict:
        latest = mark or max(_marks, key=lambda m: m.since, default=None)
        since = (latest.since if latest else _started_at)
        return {"what": mark.describe() if mark else None, "last": latest.describe() if latest else "nothing yet",
                "since": time.time() - (now - since), "busy": busy, "pid": os.getpid()}

    def publish(self, state: dict) -> None:
        key = (state["what"], state["last"], state["busy"])
        if key == self.published:
            return
        kvstore.put(f"{_PREFIX}state/{self.rank}", json.dumps(state))
        self.published = key

    def peers(self, mine: dict) -> dict[int, dict]:
        found = {self.rank: mine}
        for rank in range(self.size):
            value = None if rank == self.rank else kvstore.get(f"{_PREFIX}state/{rank}")
            if value is not None:
                found[rank] = json.loads(value)
        return found

    def report(self, mark: "_Mark", peers: dict[int, dict], idle: bool, now: float) -> str:
        what = mark.describe()
        reached = sorted(r for r, p in peers.items() if p.get("what") == what)
        missing = sorted(set(range(self.size)) - set(reached))
        why = "with its CPU idle" if idle else "while a peer was in no collective"
        lines = [f"tfdist hang watchdog: worker {self.rank} has waited {now - mark.since:.0f} s (hang timeout "
                 f"{self.timeout:g} s) in {what}, {why}. Stopping the job (exit code {EXIT_HANG}).",
                 f"  reached it: worker(s) {reached}; not reached: worker(s) {missing}"]
        for rank in range(self.size):
            peer = peers.get(rank)
            if peer is None:
                lines.append(f"  worker {rank}: unknown (it published no state)")
                continue
            ago = time.time() - peer["since"]
            where = (f"in {peer['what']} for {ago:.0f} s" if peer.get("what")
                     else f"in no collective for {ago:.0f} s (last: {peer['last']})")
            lines.append(f"  worker {rank} (pid {peer['pid']}): {where}{', CPU busy' if peer.get('busy') else ''}")
        return "\n".join(lines)

    def stop(self, report: str, reporter: bool) -> None:
        """Publishes the report (``reporter``), prints it with this worker's stacks, and exits with EXIT_HANG."""
        deadline = 2 * self.tick + 10
        last_resort = threading.Timer(deadline + 5, os._exit, (EXIT_HANG,))  # whatever the store does
        last_resort.name, last_resort.daemon = "tfdist-hang-watchdog-exit", True
        last_resort.start()
        atexit.register(os._exit, EXIT_HANG)  # a main thread that fails meanwhile (a peer left) exits with it too
        if reporter:
            kvstore.put(_PREFIX + "hang", json.dumps({"rank": self.rank, "report": report}))
        header = report if reporter else f"tfdist hang watchdog: stopping worker {self.rank}: {report}"
        sys.stderr.write(f"{header}\n{_stacks(self.rank)}"
                         f"Every worker prints its own stacks. {ENV} (tfdist run --hang-timeout) sets the timeout, "
                         "0 turns the watchdog off; see docs/troubleshooting.md.\n")
        sys.stderr.flush()
        sys.stdout.flush()
        kvstore.leave_together(_PREFIX, self.rank, self.size, EXIT_HANG, deadline)


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
