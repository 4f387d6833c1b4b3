"""Rounds every worker must take part in (a save of sharded state), and where each worker is, so a round fails
fast when a worker cannot be taking part.

A worker's *point* is where its fits are: ``(fits of the job begun, epochs of this fit whose callbacks ended)``
inside a fit, ``(fits begun, END)`` outside one. Workers that run the same fits pass the same points in the same
order (each fit's steps are collectives, and so is each epoch's end after its callbacks: ``tfdist.keras_fixes``).
A round is keyed on what every worker has alike: its point and the k-th round at that point (never on what is
being saved, habit 16). Each worker that enters a round publishes its arrival; a worker that sees every arrival
writes the verdict "go", one that finds a worker that cannot be coming writes "fail" and why; the store keeps the
first verdict written (an insert refuses a key that exists), and every worker follows that one, so no worker goes
into the round's collectives alone.

Cannot be coming, decided at once (exact):
* it exited (an atexit hook publishes it; without one, ``os._exit`` or SIGKILL, its pid is gone, seen from a worker
  in the same pid namespace of the same machine boot);
* it went on past this point (a later fit or epoch) without entering the round;
* it is in a later round at this point (the workers' rounds are out of step);
* (for a worker other than 0) worker 0 is gone: the store it holds refuses reads at once.
Decided after ``SKEW_S``, by worker 0 only: a worker at the same point outside any fit whose heartbeat moves (it is
alive: sleeping, or doing other work, e.g. at the end of its script) and that has not entered. A worker 0 doing
work of its own before the round is waited for up to the caller's bound, as is a worker that is behind (still in
the fit) or frozen (no heartbeat: a C call holding Python's lock): it may still come.

Each process publishes its point from one daemon thread (``track``): at once when it changes (in a fit: at its start,
each epoch's end and its end), and every ``BEAT_S`` while the process is outside fit and rounds (its heartbeat).
Standard library and ``tfdist.kvstore`` only.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import threading
import time

from tfdist import kvstore

SKEW_S = 10.0  # how long worker 0 waits for a live worker outside fit, at its point, to enter the round
BEAT_S = 1.0  # a heartbeat's period outside fit
ALIVE_S = 5 * BEAT_S  # a worker whose heartbeat moved within this is alive (else it may be frozen: waited for)
END = 1 << 30  # the second part of a point outside fit
_READ_S = 0.5  # a round's reads of the others' arrivals wait this long, together, each time
_REFUSALS = 3  # reads in a row that the store refuses at once: it is gone (a frozen one makes them wait)
_KEY = "tfdist/save_rounds/"

_lock = threading.Lock()  # guards _me (the main thread's changes, the publisher's reads)
_writing = threading.Lock()  # one write of _me at a time, so two never land out of order
_changed = threading.Event()
_me = {"fit": 0, "epoch": -1, "depth": 0, "round": None, "exited": False, "beat": 0}
_rounds = [(0, END), 0]  # the point of this process's last round, and how many it entered there
_tracked: dict = {}  # rank, pid once ``track`` ran


def point(state: dict) -> tuple[int, int]:
    """The point a worker's published state says it is at."""
    return (state["fit"], state["epoch"] + 1 if state["depth"] else END)


def describe(state: dict) -> str:
    """Where a worker's published state says it is ("in fit 2, after epoch 1", "after fit 1"), for messages."""
    if state["exited"]:
        return "exited"
    if state["depth"]:
        return f"in fit {state['fit']}" + (f", after epoch {state['epoch'] + 1}" if state["epoch"] >= 0 else "")
    return f"after fit {state['fit']}" if state["fit"] else "before any fit"


def fit_began() -> None:
    """The main thread began a fit of the job, before any collective of it (every worker does)."""
    _update(fit=_me["fit"] + 1, epoch=-1, depth=_me["depth"] + 1)


def epoch_ended(epoch: int) -> None:
    """The callbacks of the job's fit's ``epoch`` (0-based, as Keras counts) ended, before its end's collectives: a
    save in one of them is behind this point."""
    if _me["depth"]:
        _update(epoch=epoch)


def fit_ended() -> None:
    """The job's fit returned or raised."""
    _update(depth=max(0, _me["depth"] - 1))


def _update(**changes) -> None:
    with _lock:
        _me.update(changes)
    _changed.set()


@functools.cache
def _pid_space() -> str | None:
    """Which processes ``os.kill`` sees: this machine's boot and this pid namespace (Linux; else None)."""
    try:
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _gone(rank: int) -> bool:
    """Whether worker ``rank``'s process is gone, where this process can tell (the same pid space): one that left
    without its atexit hook (``os._exit``, SIGKILL). Its launcher reaps it within moments."""
    found = kvstore.get(f"{_KEY}process/{rank}", 100)
    pid, space = json.loads(found) if found else (None, None)
    if space is None or space != _pid_space():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's), or cannot be asked
        return False
    return False


def track(rank: int) -> None:
    """Publishes this worker's point from now on (once per process; nothing without a store)."""
    if _tracked or not kvstore.available():
        return
    _tracked.update(rank=rank, pid=os.getpid())
    # Written once, never deleted: a state being rewritten (delete, then set) is absent for a moment, for good
    # when the process dies in that moment.
    kvstore.put(f"{_KEY}process/{rank}", json.dumps([os.getpid(), _pid_space()]))
    atexit.register(_publish_exit)
    threading.Thread(target=_publisher, name="tfdist-save-rounds", daemon=True).start()


def _publisher() -> None:
    """Writes this worker's state when it changes, and every BEAT_S outside fit and rounds (its heartbeat)."""
    while True:
        changed = _changed.wait(BEAT_S)
        _changed.clear()
        with _lock:
            idle = not _me["depth"] and _me["round"] is None
        if _me["exited"]:
            return
        if changed or idle:
            _write()


def _write() -> None:
    with _writing:
        with _lock:
            _me["beat"] += 1
            record = json.dumps(_me)
        kvstore.put(f"{_KEY}at/{_tracked['rank']}", record)


def _publish_exit() -> None:
    """At the interpreter's exit: this worker takes part in no round any more."""
    if os.getpid() == _tracked.get("pid"):  # not in a forked child
        _update(exited=True)
        _write()


def published(rank: int, wait_s: float = 0.1) -> dict | None:
    """Worker ``rank``'s last published state (None: none within ``wait_s``, or no store)."""
    value = kvstore.get(f"{_KEY}at/{rank}", max(1, int(wait_s * 1000)))
    return json.loads(value) if value else None


def agree(rank: int, size: int, seconds: float) -> str | None:
    """Enters this worker's next round at its point and waits for every worker's; returns None when every
    worker entered it (its collectives can run), else why not (the same sentence on every worker that entered).

    ``seconds``: how long to wait for a worker that may still come (behind, frozen, or worker 0).
    """
    here = point(_me)
    if _rounds[0] != here:
        _rounds[:] = [here, 0]
    _rounds[1] += 1
    key = f"{here[0]}.{here[1]}.{_rounds[1]}"
    _update(round=key)
    try:
        prefix = f"{_KEY}round/{key}/"
        kvstore.put(prefix + str(rank), "1")
        why = _wait(prefix, key, rank, size, time.monotonic() + seconds, seconds)
        verdict = kvstore.put_once(prefix + "verdict", json.dumps([rank, why]))  # the first verdict written stands
        if verdict is None:
            return why or "the store (in worker 0) did not answer"
        by, why = json.loads(verdict)
        return f"worker {by} gave up on this save: {why}" if why and by != rank else why
    finally:
        _update(round=None)


def _wait(prefix: str, key: str, rank: int, size: int, deadline: float, seconds: float) -> str | None:
    """None once every worker entered the round (or another worker wrote a verdict), else why not."""
    pending, seen, refused = [r for r in range(size) if r != rank], {}, 0
    while True:
        began = time.monotonic()
        pending = [r for r in pending if kvstore.get(prefix + str(r), max(1, int(_READ_S * 1000) // len(pending)))
                   is None]
        if not pending or kvstore.get(prefix + "verdict", 100) is not None:
            return None  # every worker entered, or another worker decided: put_once reads the verdict
        if rank != 0:  # its own state always exists: the store refuses it at once (not after a wait) once gone
            asked = time.monotonic()
            refused = refused + 1 if published(rank, _READ_S) is None and time.monotonic() - asked < _READ_S / 2 else 0
        if refused >= _REFUSALS:
            return "worker 0 is gone: the job's store, which it holds, refuses every read"
        for r in pending:
            why = not_coming(r, published(r), dict(_me), rank, key, seen, time.monotonic(), gone=_gone(r))
            if why:
                return why
        if time.monotonic() >= deadline:
            return f"worker(s) {pending} did not take part within {seconds:g} s"
        time.sleep(max(0.0, _READ_S - (time.monotonic() - began)))  # reads of a store that fails at once: paced


def _nth(key: str) -> int:
    """The k of a round's key ``fit.phase.k``: the k-th round at that point."""
    return int(key.rsplit(".", 1)[1])


def not_coming(r: int, peer: dict | None, me: dict, rank: int, key: str, seen: dict, now: float,
               gone: bool = False) -> str | None:
    """Why worker ``r`` (its published state ``peer``; ``gone``: its process is) cannot be entering round ``key`` of
    this worker (``rank``, its state ``me``), or None while it may. ``seen`` keeps, per worker, when it was first seen
    idle at this point, its heartbeat, and when that last moved (``now``: ``time.monotonic()``). A published state
    may be stale: it then shows less than the worker did (its points and rounds only grow)."""
    if gone or (peer is not None and peer["exited"]):
        return f"worker {r} exited without taking part"
    if peer is None:
        return None
    mine = point(me)
    if point(peer) > mine:
        return f"worker {r} went on without taking part: it is {describe(peer)}, past this point ({describe(me)})"
    if point(peer) == mine and peer["round"] is not None and _nth(peer["round"]) > _nth(key):  # a stale state shows
        return (f"worker {r} is in a later round at this point (its {peer['round']}, this worker's {key}): the "  # less
                "workers' saves are out of step since one was called on some workers only")
    if rank != 0 or point(peer) != mine or peer["depth"] or peer["round"] is not None:
        return None
    first, beat, moved = seen.get(r, (now, peer["beat"], None))
    if peer["beat"] != beat:
        beat, moved = peer["beat"], now
    seen[r] = (first, beat, moved)
    if moved is not None and now - moved <= ALIVE_S and now - first >= SKEW_S:
        return (f"worker {r} is alive {describe(peer)} but has not taken part within {SKEW_S:g} s: it does "
                "something else")
    return None
